#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace relgen::cpu {
namespace {

constexpr int kP = PackedMatrix::kPanel;
constexpr int kRowBlock = 8;    // rows per micro-kernel (accumulators in registers)
constexpr int kRowChunk = 128;  // rows per pass over the weights (keeps x in cache)

typedef float V16 __attribute__((vector_size(64)));

// R rows x 16 outputs; acc[r] += x[r][kk] * panel[kk] for kk = 0..k-1 in order. The same
// expression for every R, so a row's result does not depend on its block.
template <int R>
__attribute__((always_inline)) inline void Micro(const float* x, int ldx, const float* panel, int k,
                                                 const float* bias, int ncols, float* y, int ldy) {
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V16{};
  const V16* w = reinterpret_cast<const V16*>(panel);
  for (int kk = 0; kk < k; ++kk) {
    const V16 wk = w[kk];
    for (int r = 0; r < R; ++r) acc[r] += x[r * ldx + kk] * wk;
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + static_cast<int64_t>(r) * ldy;
    for (int c = 0; c < ncols; ++c) yr[c] = bias != nullptr ? acc[r][c] + bias[c] : acc[r][c];
  }
}

#ifdef RELGEN_TSAN
// The clone resolver runs before TSan's runtime is up, and TSan instruments it: one plain version.
#define RELGEN_CLONES
#else
#define RELGEN_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif

RELGEN_CLONES
void PanelRange(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                int p_begin, int p_end) {
  const int k = w.k(), n = w.n();
  for (int r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int r1 = std::min(rows, r0 + kRowChunk);
    for (int p = p_begin; p < p_end; ++p) {
      const float* panel = w.panel(p);
      const int c0 = p * kP;
      const int ncols = std::min(kP, n - c0);
      const float* b = bias != nullptr ? bias + c0 : nullptr;
      int r = r0;
      for (; r + kRowBlock <= r1; r += kRowBlock) {
        Micro<kRowBlock>(x + static_cast<int64_t>(r) * k, k, panel, k, b, ncols, y + static_cast<int64_t>(r) * n + c0, n);
      }
      const float* xr = x + static_cast<int64_t>(r) * k;
      float* yr = y + static_cast<int64_t>(r) * n + c0;
      switch (r1 - r) {
        case 7: Micro<7>(xr, k, panel, k, b, ncols, yr, n); break;
        case 6: Micro<6>(xr, k, panel, k, b, ncols, yr, n); break;
        case 5: Micro<5>(xr, k, panel, k, b, ncols, yr, n); break;
        case 4: Micro<4>(xr, k, panel, k, b, ncols, yr, n); break;
        case 3: Micro<3>(xr, k, panel, k, b, ncols, yr, n); break;
        case 2: Micro<2>(xr, k, panel, k, b, ncols, yr, n); break;
        case 1: Micro<1>(xr, k, panel, k, b, ncols, yr, n); break;
        default: break;
      }
    }
  }
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

void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool) {
  if (rows == 0) return;
  if (pool == nullptr) {
    PanelRange(x, rows, w, bias, y, 0, w.panels());
    return;
  }
  pool->ParallelFor(w.panels(), [&](int begin, int end) { PanelRange(x, rows, w, bias, y, begin, end); });
}

}  // namespace relgen::cpu
