#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <cstdlib>
#include <cstring>

#include "kernels/bf16.h"

#include <cpuid.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace relgen::cpu {
#define RELGEN_BF16_PANELS(ns) \
  namespace ns {                \
  void Panels(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin, int p_end); \
  }
RELGEN_BF16_PANELS(bf16dot)
RELGEN_BF16_PANELS(bf16amx)
RELGEN_BF16_PANELS(bf16amx_emulated)
#undef RELGEN_BF16_PANELS
namespace {

// Full unrolling of the micro-kernel's loops over its register arrays (see Micro). clang too: at -O2
// (the ASan tree's) it left the bf16 pair loop rolled without it.
#define RELGEN_UNROLL _Pragma("GCC unroll 64")

constexpr int kP = PackedMatrix::kPanel;
constexpr int kRowChunk = 128;  // rows per pass over the weights (keeps x in cache)
// bf16 panels are widened once for this many rows or more (below it the narrow kernel was faster: bloom-560m
// at 8 rows 164 -> 124 ms a step with it; staged ahead from 12 rows on, 175 against 184).
constexpr int kStageRows = 12;

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

typedef uint32_t U4 __attribute__((vector_size(16)));
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint32_t U16 __attribute__((vector_size(64)));

// The 32-bit lane vectors as wide as V (float x N): a bf16 pair per lane.
template <int N> struct Narrow;
template <> struct Narrow<4> { using U = U4; };
template <> struct Narrow<8> { using U = U8; };
template <> struct Narrow<16> { using U = U16; };

// Row kk of a panel, lanes [lane, lane + N) as float (bf16 exactly): float32 rows are [k][16];
// bf16 rows come in pairs, [k / 2][16][2], a pair's even row in the low half of each 32-bit lane.
// (Through a reference: returning a vector type from a function of no target draws an ABI warning.)
template <typename V, typename T>
__attribute__((always_inline)) inline void LoadRow(const T* panel, int kk, int lane, V& v) {
  using U = typename Narrow<sizeof(V) / sizeof(float)>::U;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, panel + static_cast<int64_t>(kk) * kP + lane, sizeof v);
  } else {
    U u;
    std::memcpy(&u, panel + static_cast<int64_t>(kk / 2) * (2 * kP) + 2 * lane, sizeof u);
    if (kk % 2 == 0) {
      u <<= 16;
    } else {
      u &= 0xffff0000u;
    }
    std::memcpy(&v, &u, sizeof v);
  }
}

// Asks for the panel data `ahead` elements on, into L2. A block reads its panels once from memory
// and the hardware prefetcher alone fell behind on one stream: a decode step of 6 rows read the
// weights at ~25 GB/s where the 1-row kernel's three streams reached 34 (12 rows: 142 -> 107 ms a
// step of bloom-560m's 2.24 GB with this, 1 row unchanged). Past a panel's end the address lies in
// the next panel or past the allocation; a prefetch cannot fault, and the integer arithmetic keeps
// the pointer from leaving its object.
template <typename T>
__attribute__((always_inline)) inline void PrefetchL2(const T* p, int64_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + ahead * sizeof(T)), 0, 2);
}
constexpr int kPrefetchRows = 128;  // panel rows of 64 bytes ahead: 8 KiB a stream

// R rows x P panels of 16 outputs, as L vectors V per row; acc[r] += x[r][kk] * panel[kk] for
// kk = 0..k-1 in order. The same expression for every R, P and V, so a row's result does not
// depend on its block. (P > 1 gives a few rows independent chains to hide the FMA latency.)
// Every loop over the register arrays is unrolled by force: left to -O2, GCC kept the 1 x 3 and
// 2 x 2 shapes (6 and 4 vectors a row) as loops over stack arrays, the accumulators and the panel
// rows in memory, and a batch-1 decode streamed its weights at half the machine's read bandwidth.
template <typename V, typename T, int R, int P = 1>
__attribute__((always_inline)) inline void Micro(const float* x, int ldx, const T* panel, int64_t pstride, int k,
                                                 const float* scale, const float* bias, int ncols, float* y,
                                                 int ldy) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  constexpr int Lp = kP / kLanes;
  constexpr int L = P * Lp;
  V acc[R][L];
  RELGEN_UNROLL
  for (int r = 0; r < R; ++r) {
    RELGEN_UNROLL
    for (int l = 0; l < L; ++l) acc[r][l] = V{};
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int kk = 0; kk < k; ++kk) {
      RELGEN_UNROLL
      for (int q = 0; q < P; ++q) PrefetchL2(panel + q * pstride, static_cast<int64_t>(kk + kPrefetchRows) * kP);
      V wk[L];
      RELGEN_UNROLL
      for (int l = 0; l < L; ++l) LoadRow(panel + (l / Lp) * pstride, kk, (l % Lp) * kLanes, wk[l]);
      RELGEN_UNROLL
      for (int r = 0; r < R; ++r) {
        const float xr = x[r * ldx + kk];
        RELGEN_UNROLL
        for (int l = 0; l < L; ++l) acc[r][l] += xr * wk[l];
      }
    }
  } else {
    // bf16: one load per pair of rows, split into row kk (a shift) and row kk + 1 (a mask); the
    // multiply-adds in the same order as above.
    using U = typename Narrow<kLanes>::U;
    for (int kk = 0; kk < k; kk += 2) {
      RELGEN_UNROLL
      for (int q = 0; q < P; ++q) PrefetchL2(panel + q * pstride, static_cast<int64_t>(kk / 2 + kPrefetchRows) * (2 * kP));
      U pair[L];
      RELGEN_UNROLL
      for (int l = 0; l < L; ++l) {
        std::memcpy(&pair[l], panel + (l / Lp) * pstride + static_cast<int64_t>(kk / 2) * (2 * kP) + 2 * (l % Lp) * kLanes,
                    sizeof(U));
      }
      RELGEN_UNROLL
      for (int h = 0; h < 2; ++h) {
        if (kk + h == k) break;  // an odd k's last pair has one row
        V wk[L];
        RELGEN_UNROLL
        for (int l = 0; l < L; ++l) {
          const U u = h == 0 ? pair[l] << 16 : pair[l] & 0xffff0000u;
          std::memcpy(&wk[l], &u, sizeof(V));
        }
        RELGEN_UNROLL
        for (int r = 0; r < R; ++r) {
          const float xr = x[r * ldx + kk + h];
          RELGEN_UNROLL
          for (int l = 0; l < L; ++l) acc[r][l] += xr * wk[l];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + static_cast<int64_t>(r) * ldy;
    for (int c = 0; c < ncols; ++c) {
      float v = acc[r][c / kLanes][c % kLanes];
      if (scale != nullptr) v *= scale[c];
      yr[c] = bias != nullptr ? v + bias[c] : v;
    }
  }
}

// A block of `rows` (0..R) rows over P panels: one Micro<rows, P>.
template <typename V, typename T, int R, int P>
__attribute__((always_inline)) inline void Block(int rows, const float* x, int k, const T* panel, int64_t pstride,
                                                 const float* scale, const float* bias, int ncols, float* y, int ldy) {
  if constexpr (R > 0) {
    if (rows == R) {
      Micro<V, T, R, P>(x, k, panel, pstride, k, scale, bias, ncols, y, ldy);
    } else {
      Block<V, T, R - 1, P>(rows, x, k, panel, pstride, scale, bias, ncols, y, ldy);
    }
  }
}

// The most rows left after the last full block that run over two panels at once: as many as keep
// their accumulators for both panels, the two panels' rows and a broadcast in the vector registers
// (16 ymm with AVX2: 2 rows; all of them with AVX-512). One panel gives a tail too few accumulator
// chains to hide the FMA latency (AVX2, 2 rows: 4 chains where 2 ports x 4 cycles want 8), and a
// decode step at concurrency 8 is 6 + 2 rows.
template <typename V, int RB, int PB>
constexpr int PairTailRows() {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  constexpr int kRegs = kLanes == 16 ? 32 : 16;
  constexpr int kVecs = 2 * (kP / kLanes);  // a row's accumulators over two panels; also the panels' rows
  int t = PB > 1 ? RB - 1 : 0;
  while (t + 1 < RB && (t + 1) * kVecs + kVecs + 1 <= kRegs) ++t;
  return t;
}

// RB rows per micro-kernel call: as many as keep RB x 16 accumulators, one panel row and a
// broadcast in the vector registers (16 ymm with AVX2, 32 zmm with AVX-512).
template <typename V, typename T, int RB, int PB>
__attribute__((always_inline)) inline void PanelRangeT(const float* x, int rows, const PackedMatrix& w,
                                                       const float* bias, float* y, int p_begin, int p_end) {
  constexpr int kPairTail = PairTailRows<V, RB, PB>();
  const int k = w.k(), n = w.n();
  for (int r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int r1 = std::min(rows, r0 + kRowChunk);
    int p = p_begin;
    if (r1 - r0 <= 2) {
      // One or two rows (decode at small batch): three or two panels at once, all full.
      const int64_t pstride = int64_t{w.padded_k()} * kP;
      const float* s = w.scales();
      for (; r1 - r0 == 1 && p + 3 <= p_end && (p + 3) * kP <= n; p += 3) {
        Micro<V, T, 1, 3>(x + int64_t{r0} * k, k, static_cast<const T*>(w.panel(p)), pstride, k,
                          s != nullptr ? s + p * kP : nullptr, bias != nullptr ? bias + p * kP : nullptr, 3 * kP,
                          y + int64_t{r0} * n + p * kP, n);
      }
      for (; r1 - r0 == 2 && p + 2 <= p_end && (p + 2) * kP <= n; p += 2) {
        Micro<V, T, 2, 2>(x + int64_t{r0} * k, k, static_cast<const T*>(w.panel(p)), pstride, k,
                          s != nullptr ? s + p * kP : nullptr, bias != nullptr ? bias + p * kP : nullptr, 2 * kP,
                          y + int64_t{r0} * n + p * kP, n);
      }
    }
    while (p < p_end) {
      // Many rows: PB panels at once where whole (two on AVX-512: 16 accumulators for 2 panel
      // loads and 8 broadcasts per k, where one panel spent 9 loads on 8 FMAs).
      constexpr bool kFloat = std::is_same_v<T, float>;
      const bool stage = !kFloat && r1 - r0 >= kStageRows;
      const int tail = (r1 - r0) % RB;
      const bool two = ((kFloat || stage) && PB > 1) || (tail > 0 && tail <= kPairTail);
      const int np = two && p + 2 <= p_end && (p + 2) * kP <= n ? 2 : 1;
      const T* panel = static_cast<const T*>(w.panel(p));
      const int c0 = p * kP;
      const int ncols = std::min(np * kP, n - c0);
      const float* s = w.scales() != nullptr ? w.scales() + c0 : nullptr;
      const float* b = bias != nullptr ? bias + c0 : nullptr;
      float* yc = y + c0;
      const float* wf = nullptr;
      if constexpr (!kFloat) {
        if (stage) {
          // Widen the panels once into float (exact) and run the float kernel on them. Each weight
          // enters the same multiply-add as in the narrow kernel, so the bits are the same.
          static thread_local std::vector<float> staged;
          constexpr int kLanes = sizeof(V) / sizeof(float);
          staged.resize(static_cast<size_t>(np) * k * kP);
          for (int q = 0; q < np; ++q) {
            const T* src = panel + static_cast<int64_t>(q) * w.padded_k() * kP;
            float* dst = staged.data() + static_cast<size_t>(q) * k * kP;
            for (int kk = 0; kk < k; ++kk) {
              for (int lane = 0; lane < kP; lane += kLanes) {
                V wide;
                LoadRow(src, kk, lane, wide);
                std::memcpy(dst + static_cast<size_t>(kk) * kP + lane, &wide, sizeof wide);
              }
            }
          }
          wf = staged.data();
        }
      } else {
        wf = panel;
      }
      int r = r0;
      if (wf != nullptr) {
        const int64_t ps = int64_t{k} * kP;
        if (np == 2) {
          for (; r + RB <= r1; r += RB) {
            if constexpr (PB > 1) {
              Micro<V, float, RB, 2>(x + int64_t{r} * k, k, wf, ps, k, s, b, ncols, yc + int64_t{r} * n, n);
            } else {
              Micro<V, float, RB>(x + int64_t{r} * k, k, wf, 0, k, s, b, kP, yc + int64_t{r} * n, n);
              Micro<V, float, RB>(x + int64_t{r} * k, k, wf + ps, 0, k, s != nullptr ? s + kP : nullptr,
                                  b != nullptr ? b + kP : nullptr, kP, yc + int64_t{r} * n + kP, n);
            }
          }
          Block<V, float, kPairTail, 2>(r1 - r, x + int64_t{r} * k, k, wf, ps, s, b, ncols, yc + int64_t{r} * n, n);
        } else {
          for (; r + RB <= r1; r += RB) {
            Micro<V, float, RB>(x + int64_t{r} * k, k, wf, 0, k, s, b, ncols, yc + int64_t{r} * n, n);
          }
          Block<V, float, RB - 1, 1>(r1 - r, x + int64_t{r} * k, k, wf, 0, s, b, ncols, yc + int64_t{r} * n, n);
        }
      } else {
        const int64_t ps = int64_t{w.padded_k()} * kP;
        for (; r + RB <= r1; r += RB) {
          for (int q = 0; q < np; ++q) {
            Micro<V, T, RB>(x + int64_t{r} * k, k, panel + q * ps, 0, k, s != nullptr ? s + q * kP : nullptr,
                            b != nullptr ? b + q * kP : nullptr, std::min(kP, ncols - q * kP),
                            yc + int64_t{r} * n + q * kP, n);
          }
        }
        if (np == 2) {
          Block<V, T, kPairTail, 2>(r1 - r, x + int64_t{r} * k, k, panel, ps, s, b, ncols, yc + int64_t{r} * n, n);
        } else {
          Block<V, T, RB - 1, 1>(r1 - r, x + int64_t{r} * k, k, panel, 0, s, b, ncols, yc + int64_t{r} * n, n);
        }
      }
      p += np;
    }
  }
}

using PanelFn = void (*)(const float*, int, const PackedMatrix&, const float*, float*, int, int);

#define RELGEN_PANEL_FNS(T, SUFFIX)                                                                              \
  __attribute__((target("avx512f"))) void PanelRangeAvx512##SUFFIX(                                             \
      const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin, int p_end) {   \
    PanelRangeT<V16, T, 8, 2>(x, rows, w, bias, y, p_begin, p_end);                                               \
  }                                                                                                              \
  __attribute__((target("avx2,fma"))) void PanelRangeAvx2##SUFFIX(                                              \
      const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin, int p_end) {   \
    PanelRangeT<V8, T, 6, 1>(x, rows, w, bias, y, p_begin, p_end);                                                \
  }                                                                                                              \
  void PanelRangeBase##SUFFIX(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,     \
                              int p_begin, int p_end) {                                                          \
    PanelRangeT<V4, T, 2, 1>(x, rows, w, bias, y, p_begin, p_end);                                                \
  }                                                                                                              \
  PanelFn Kernel##SUFFIX(GemmIsa isa) {                                                                          \
    switch (isa) {                                                                                               \
      case GemmIsa::kAvx512: return PanelRangeAvx512##SUFFIX;                                                    \
      case GemmIsa::kAvx2: return PanelRangeAvx2##SUFFIX;                                                        \
      case GemmIsa::kBase: break;                                                                                \
    }                                                                                                            \
    return PanelRangeBase##SUFFIX;                                                                               \
  }

RELGEN_PANEL_FNS(float, F32)
RELGEN_PANEL_FNS(uint16_t, Bf16)
#undef RELGEN_PANEL_FNS

PanelFn Kernel(GemmIsa isa, WeightType type) {
  switch (type) {
    case WeightType::kBf16: return KernelBf16(isa);
    case WeightType::kInt8:  // LinearInt8
    case WeightType::kF32: break;
  }
  return KernelF32(isa);
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

// 2 MiB or more on 2 MiB-aligned memory, its whole 2 MiB pages marked for transparent huge pages: a
// batch-1 decode step streams every weight once, and 4 KiB pages' TLB misses cost a stream of 2 GB
// about 9% of its bandwidth (docs/benchmarks.md). The tail stays on 4 KiB pages, so no huge page
// holds memory past the end. Advice only: where the kernel declines, 4 KiB pages.
char* AllocateWeights(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (bytes < kHuge) return static_cast<char*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64)));
  char* p = static_cast<char*>(std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge));
#if defined(MADV_HUGEPAGE)
  if (p != nullptr) madvise(p, bytes / kHuge * kHuge, MADV_HUGEPAGE);
#endif
  return p;
}

void PackedMatrix::Free::operator()(char* p) const { std::free(p); }

PackedMatrix::PackedMatrix(const float* w, int n, int k, WeightType type)
    : PackedMatrix(n, k, type, [w, k](int o, float* out) {
        std::memcpy(out, w + static_cast<int64_t>(o) * k, static_cast<size_t>(k) * sizeof(float));
      }) {}

PackedMatrix::PackedMatrix(int n, int k, WeightType type, const std::function<void(int row, float* out)>& row_of)
    : n_(n), k_(k), type_(type) {
  const int eb = WeightTypeBytes(type);
  const int k4 = padded_k();
  const size_t bytes = (static_cast<size_t>(panels()) * k4 * kP * eb + 63) / 64 * 64;
  data_.reset(AllocateWeights(bytes));
  char* d = data_.get();
  std::memset(d, 0, bytes);
  if (type == WeightType::kInt8) {
    scales_.assign(static_cast<size_t>(panels()) * kP, 0.0f);
    offsets_.assign(static_cast<size_t>(panels()) * kP, 0);
  }
  std::vector<float> buffer(static_cast<size_t>(k));
  const float* row = buffer.data();
  for (int o = 0; o < n; ++o) {
    row_of(o, buffer.data());
    const int64_t base = static_cast<int64_t>(o / kP) * k * kP + o % kP;
    switch (type) {
      case WeightType::kF32:
        for (int kk = 0; kk < k; ++kk) reinterpret_cast<float*>(d)[base + kk * kP] = row[kk];
        break;
      case WeightType::kBf16: {
        const int64_t base2 = static_cast<int64_t>(o / kP) * k4 * kP + o % kP * 2;
        for (int kk = 0; kk < k; ++kk) reinterpret_cast<uint16_t*>(d)[base2 + kk / 2 * (2 * kP) + kk % 2] = ToBf16(row[kk]);
        break;
      }
      case WeightType::kInt8: {
        float amax = 0;
        for (int kk = 0; kk < k; ++kk) amax = std::max(amax, std::fabs(row[kk]));
        const float scale = amax > 0 ? amax / 127.0f : 1.0f;
        scales_[o] = scale;
        int32_t sum = 0;
        const int64_t base4 = static_cast<int64_t>(o / kP) * k4 * kP + o % kP * 4;
        for (int kk = 0; kk < k; ++kk) {
          const auto q = static_cast<int8_t>(std::clamp(std::nearbyint(row[kk] / scale), -127.0f, 127.0f));
          reinterpret_cast<int8_t*>(d)[base4 + kk / 4 * (4 * kP) + kk % 4] = q;
          sum += q;
        }
        offsets_[o] = 128 * sum;
        break;
      }
    }
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
  if (w.type() == WeightType::kInt8) {
    static const Int8Isa int8_isa = SupportedInt8Isas().front();
    LinearInt8(x, rows, w, bias, y, pool, int8_isa);
    return;
  }
  // Chosen once per process, so every row of a run takes the same arithmetic.
  static const GemmIsa isa = SupportedGemmIsas().front();
  Run(Kernel(isa, w.type()), x, rows, w, bias, y, pool);
}

std::string GemmPathName(WeightType t, bool bf16_inputs) {
  if (t == WeightType::kInt8) return std::string(Int8IsaName(SupportedInt8Isas().front())) + " int8 dot products";
  const GemmIsa isa = SupportedGemmIsas().front();
  return std::string(GemmIsaName(isa)) + (isa == GemmIsa::kBase ? " float32 multiply-adds" : " float32 FMA") +
         (bf16_inputs ? ", inputs rounded to bf16" : "");
}

std::string Bf16DotPathName() {
  if (!Bf16DotSupported()) return "none (no AMX-BF16 or AVX-512 BF16)";
  const Bf16Isa isa = SupportedBf16Isas().front();
  return std::string(Bf16IsaName(isa)) + (isa == Bf16Isa::kAvx512Bf16 ? " bf16 dot products" : " bf16 tiles");
}

bool AmxUsable(int edx_bit) {
  // AMX-TILE is CPUID leaf 7 EDX bit 24.
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || (d & (1u << 24)) == 0 || (d & (1u << edx_bit)) == 0) return false;
#if defined(__linux__)
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

std::vector<Bf16Isa> SupportedBf16Isas() {
  __builtin_cpu_init();
  std::vector<Bf16Isa> isas;
  if (AmxUsable(22)) isas.push_back(Bf16Isa::kAmx);
  // AVX-512 BF16: CPUID leaf 7, subleaf 1, EAX bit 5 (AVX-512 BW for the interleave).
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 5)) != 0) {
    isas.push_back(Bf16Isa::kAvx512Bf16);
  }
  return isas;
}

const char* Bf16IsaName(Bf16Isa isa) {
  switch (isa) {
    case Bf16Isa::kAmx: return "amx-bf16";
    case Bf16Isa::kAmxEmulated: return "amx-bf16 (emulated)";
    case Bf16Isa::kAvx512Bf16: break;
  }
  return "avx512-bf16";
}

bool Bf16DotSupported() {
  static const bool supported = !SupportedBf16Isas().empty();
  return supported;
}

void LinearBf16Dot(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool,
                   Bf16Isa isa) {
  switch (isa) {
    case Bf16Isa::kAmx: Run(bf16amx::Panels, x, rows, w, bias, y, pool); return;
    case Bf16Isa::kAmxEmulated: Run(bf16amx_emulated::Panels, x, rows, w, bias, y, pool); return;
    case Bf16Isa::kAvx512Bf16: Run(bf16dot::Panels, x, rows, w, bias, y, pool); return;
  }
}

void LinearBf16Dot(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool) {
  // Chosen once per process, so every row of a run takes the same arithmetic.
  static const Bf16Isa isa = SupportedBf16Isas().front();
  LinearBf16Dot(x, rows, w, bias, y, pool, isa);
}

void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool, GemmIsa isa) {
  if (w.type() == WeightType::kInt8) {
    LinearPacked(x, rows, w, bias, y, pool);
    return;
  }
  Run(Kernel(isa, w.type()), x, rows, w, bias, y, pool);
}

}  // namespace relgen::cpu
