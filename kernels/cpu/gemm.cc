#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace relgen::cpu {
namespace {

constexpr int kP = PackedMatrix::kPanel;
constexpr int kRowChunk = 128;  // rows per pass over the weights (keeps x in cache)

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

// R rows x 16 outputs, as L vectors V per row; acc[r] += x[r][kk] * panel[kk] for kk = 0..k-1 in
// order. The same expression for every R and V, so a row's result does not depend on its block.
template <typename V, int R>
__attribute__((always_inline)) inline void Micro(const float* x, int ldx, const float* panel, int k,
                                                 const float* bias, int ncols, float* y, int ldy) {
  constexpr int L = kP * sizeof(float) / sizeof(V);
  V acc[R][L];
  for (int r = 0; r < R; ++r) {
    for (int l = 0; l < L; ++l) acc[r][l] = V{};
  }
  const V* w = reinterpret_cast<const V*>(panel);
  for (int kk = 0; kk < k; ++kk) {
    V wk[L];
    for (int l = 0; l < L; ++l) wk[l] = w[kk * L + l];
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * ldx + kk];
      for (int l = 0; l < L; ++l) acc[r][l] += xr * wk[l];
    }
  }
  constexpr int kLanes = sizeof(V) / sizeof(float);
  for (int r = 0; r < R; ++r) {
    float* yr = y + static_cast<int64_t>(r) * ldy;
    for (int c = 0; c < ncols; ++c) {
      const float v = acc[r][c / kLanes][c % kLanes];
      yr[c] = bias != nullptr ? v + bias[c] : v;
    }
  }
}

// Rows left over after the last full block of RB: one Micro<R> for R = left.
template <typename V, int R>
__attribute__((always_inline)) inline void Tail(int left, const float* x, int k, const float* panel,
                                                const float* bias, int ncols, float* y, int ldy) {
  if constexpr (R > 0) {
    if (left == R) {
      Micro<V, R>(x, k, panel, k, bias, ncols, y, ldy);
    } else {
      Tail<V, R - 1>(left, x, k, panel, bias, ncols, y, ldy);
    }
  }
}

// RB rows per micro-kernel call: as many as keep RB x 16 accumulators, one panel row and a
// broadcast in the vector registers (16 ymm with AVX2, 32 zmm with AVX-512).
template <typename V, int RB>
__attribute__((always_inline)) inline void PanelRangeT(const float* x, int rows, const PackedMatrix& w,
                                                       const float* bias, float* y, int p_begin, int p_end) {
  const int k = w.k(), n = w.n();
  for (int r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int r1 = std::min(rows, r0 + kRowChunk);
    for (int p = p_begin; p < p_end; ++p) {
      const float* panel = w.panel(p);
      const int c0 = p * kP;
      const int ncols = std::min(kP, n - c0);
      const float* b = bias != nullptr ? bias + c0 : nullptr;
      int r = r0;
      for (; r + RB <= r1; r += RB) {
        Micro<V, RB>(x + int64_t{r} * k, k, panel, k, b, ncols, y + int64_t{r} * n + c0, n);
      }
      Tail<V, RB - 1>(r1 - r, x + int64_t{r} * k, k, panel, b, ncols, y + int64_t{r} * n + c0, n);
    }
  }
}

using PanelFn = void (*)(const float*, int, const PackedMatrix&, const float*, float*, int, int);

__attribute__((target("avx512f"))) void PanelRangeAvx512(const float* x, int rows, const PackedMatrix& w,
                                                         const float* bias, float* y, int p_begin, int p_end) {
  PanelRangeT<V16, 8>(x, rows, w, bias, y, p_begin, p_end);
}
__attribute__((target("avx2,fma"))) void PanelRangeAvx2(const float* x, int rows, const PackedMatrix& w,
                                                        const float* bias, float* y, int p_begin, int p_end) {
  PanelRangeT<V8, 6>(x, rows, w, bias, y, p_begin, p_end);
}
void PanelRangeBase(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin,
                    int p_end) {
  PanelRangeT<V4, 2>(x, rows, w, bias, y, p_begin, p_end);
}

PanelFn Kernel(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512: return PanelRangeAvx512;
    case GemmIsa::kAvx2: return PanelRangeAvx2;
    case GemmIsa::kBase: break;
  }
  return PanelRangeBase;
}

void Run(PanelFn fn, const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
         ThreadPool* pool) {
  if (rows == 0) return;
  if (pool == nullptr) {
    fn(x, rows, w, bias, y, 0, w.panels());
    return;
  }
  pool->ParallelFor(w.panels(), [&](int begin, int end) { fn(x, rows, w, bias, y, begin, end); });
}

}  // namespace

void PackedMatrix::Free::operator()(float* p) const { std::free(p); }

PackedMatrix::PackedMatrix(const float* w, int n, int k) : n_(n), k_(k) {
  const size_t count = static_cast<size_t>(panels()) * k * kP;
  const size_t bytes = (count * sizeof(float) + 63) / 64 * 64;
  data_.reset(static_cast<float*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
  float* d = data_.get();
  std::memset(d, 0, bytes);
  for (int o = 0; o < n; ++o) {
    float* panel = d + static_cast<int64_t>(o / kP) * k * kP;
    for (int kk = 0; kk < k; ++kk) panel[kk * kP + o % kP] = w[static_cast<int64_t>(o) * k + kk];
  }
}

std::vector<GemmIsa> SupportedGemmIsas() {
  // Dispatch by hand, not target_clones: GCC's clone resolver runs before TSan's runtime is up.
  __builtin_cpu_init();
  std::vector<GemmIsa> isas;
  if (__builtin_cpu_supports("avx512f")) isas.push_back(GemmIsa::kAvx512);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isas.push_back(GemmIsa::kAvx2);
  isas.push_back(GemmIsa::kBase);
  return isas;
}

const char* GemmIsaName(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512: return "avx512";
    case GemmIsa::kAvx2: return "avx2";
    case GemmIsa::kBase: break;
  }
  return "base";
}

void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool) {
  // Chosen once per process, so every row of a run takes the same arithmetic.
  static const PanelFn fn = Kernel(SupportedGemmIsas().front());
  Run(fn, x, rows, w, bias, y, pool);
}

void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool, GemmIsa isa) {
  Run(Kernel(isa), x, rows, w, bias, y, pool);
}

}  // namespace relgen::cpu
