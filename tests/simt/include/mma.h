// The SIMT emulator's warp matrix functions (nvcuda::wmma), for bf16 inputs and float accumulators
// at m16n16k16. Each lane holds the whole of an a or b tile and the accumulator elements e with
// e % 32 == its lane (what it computes, loads and stores), so each operation is exact to its
// definition and its order is fixed: d[i][j] = c[i][j], then for k = 0..15 in turn,
// d[i][j] = fmaf(a[i][k], b[k][j], d[i][j]) (a bf16 product is exact in float). Each operation is
// warp-collective, as on the device: all 32 lanes must reach it.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <type_traits>

#include "simt/device.h"

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has m16n16k16");
  static constexpr int kRows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int kCols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = kRows * kCols;
  T x[num_elements];  // [kRows][kCols]
};

namespace detail {
inline int Lane() {
  const auto& c = ::simt::detail::Ctx();
  const unsigned linear = (c.thread_idx.z * c.block_dim.y + c.thread_idx.y) * c.block_dim.x + c.thread_idx.x;
  return static_cast<int>(linear & 31u);
}
inline void Converged() { __syncwarp(); }
template <class L>
constexpr bool kRowMajor = std::is_same_v<L, row_major>;
}  // namespace detail

template <class Use, int M, int N, int K, class T, class L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, const T& v) {
  for (auto& e : f.x) e = v;
}

// matrix_a / matrix_b: the layout is the fragment's.
template <class Use, int M, int N, int K, class T, class L>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator's load names its layout");
  detail::Converged();
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::kRows; ++r) {
    for (int c = 0; c < F::kCols; ++c) {
      f.x[r * F::kCols + c] = detail::kRowMajor<L> ? p[r * ldm + c] : p[c * ldm + r];
    }
  }
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm, layout_t layout) {
  detail::Converged();
  for (int e = detail::Lane(); e < M * N; e += 32) {
    const int r = e / N, c = e % N;
    f.x[e] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
  }
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
  detail::Converged();
  for (int e = detail::Lane(); e < M * N; e += 32) {
    const int r = e / N, c = e % N;
    (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[e];
  }
  detail::Converged();
}

template <int M, int N, int K, class LA, class LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, __nv_bfloat16, LA>& a,
              const fragment<matrix_b, M, N, K, __nv_bfloat16, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  detail::Converged();
  for (int e = detail::Lane(); e < M * N; e += 32) {
    const int i = e / N, j = e % N;
    float s = c.x[e];
    for (int k = 0; k < K; ++k) s = std::fmaf(__bfloat162float(a.x[i * K + k]), __bfloat162float(b.x[k * N + j]), s);
    d.x[e] = s;
  }
}

}  // namespace nvcuda::wmma
