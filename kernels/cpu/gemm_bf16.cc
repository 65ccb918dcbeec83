// bf16 x bf16 projections on AVX-512 BF16 (vdpbf16ps): each input row is rounded to bf16 (nearest
// even) once, and every output sums the products of pairs of inputs in float32, pair after pair in
// the order of k (the instruction adds a pair's two exact products to the sum; it treats denormal
// inputs and results as zero). The panels' pairs layout ([k / 2][16][2], gemm.h) is the
// instruction's operand as stored: one load per pair of k rows. An odd k's last input pairs with
// the zero padding of both operands. gemm.cc calls this only where the CPU has AVX-512 BF16.
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "kernels/bf16.h"
#include "kernels/cpu/gemm.h"

namespace relgen::cpu::bf16dot {

void Panels(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin, int p_end);

}  // namespace relgen::cpu::bf16dot

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#endif

namespace relgen::cpu::bf16dot {
namespace {

constexpr int kP = PackedMatrix::kPanel;
constexpr int kRowChunk = 128;

// Round to nearest even, as ToBf16 (a NaN stays a quiet NaN).
inline uint16_t Round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// R rows x P panels: acc[r][p] over all pairs, then + bias into y.
template <int R, int P>
inline void Block(const uint16_t* xb, int ldx, const uint16_t* panel, int64_t pstride, int k, const float* bias,
                  int ncols, float* y, int ldy) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  for (int kk = 0; kk < k; kk += 2) {  // k even: the zero padding pairs with an odd k's last row
    __m512i wp[P];
    for (int p = 0; p < P; ++p) wp[p] = _mm512_loadu_si512(panel + p * pstride + kk * kP);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, xb + r * ldx + kk, 4);
      const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(pair));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)xv, (__m512bh)wp[p]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + static_cast<int64_t>(r) * ldy;
    for (int p = 0; p < P; ++p) {
      float out[kP];
      _mm512_storeu_ps(out, acc[r][p]);
      for (int c = p * kP; c < ncols && c < (p + 1) * kP; ++c) {
        yr[c] = bias != nullptr ? out[c - p * kP] + bias[c] : out[c - p * kP];
      }
    }
  }
}

template <int R>
inline void Tail(int left, const uint16_t* xb, int ldx, const uint16_t* panel, int k, const float* bias, int ncols,
                 float* y, int ldy) {
  if constexpr (R > 0) {
    if (left == R) {
      Block<R, 1>(xb, ldx, panel, 0, k, bias, ncols, y, ldy);
    } else {
      Tail<R - 1>(left, xb, ldx, panel, k, bias, ncols, y, ldy);
    }
  }
}

constexpr int kRows = 8, kDecodePanels = 4;

}  // namespace

void Panels(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin, int p_end) {
  const int k = w.k(), n = w.n();
  const int ldx = (k + 1) / 2 * 2;
  static thread_local std::vector<uint16_t> staged;
  for (int r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int r1 = rows < r0 + kRowChunk ? rows : r0 + kRowChunk;
    staged.assign(static_cast<size_t>(r1 - r0) * ldx, 0);
    for (int r = r0; r < r1; ++r) {
      for (int i = 0; i < k; ++i) staged[static_cast<size_t>(r - r0) * ldx + i] = Round(x[static_cast<int64_t>(r) * k + i]);
    }
    const uint16_t* xb = staged.data();
    int p = p_begin;
    if (r1 - r0 == 1) {
      for (; p + kDecodePanels <= p_end && (p + kDecodePanels) * kP <= n; p += kDecodePanels) {
        Block<1, kDecodePanels>(xb, ldx, static_cast<const uint16_t*>(w.panel(p)), int64_t{w.padded_k()} * kP, ldx,
                                bias != nullptr ? bias + p * kP : nullptr, kDecodePanels * kP, y + int64_t{r0} * n + p * kP, n);
      }
    }
    for (; p < p_end; ++p) {
      const uint16_t* panel = static_cast<const uint16_t*>(w.panel(p));
      const int c0 = p * kP;
      const int ncols = n - c0 < kP ? n - c0 : kP;
      const float* b = bias != nullptr ? bias + c0 : nullptr;
      int r = r0;
      for (; r + kRows <= r1; r += kRows) {
        Block<kRows, 1>(xb + static_cast<size_t>(r - r0) * ldx, ldx, panel, 0, ldx, b, ncols, y + int64_t{r} * n + c0, n);
      }
      Tail<kRows - 1>(r1 - r, xb + static_cast<size_t>(r - r0) * ldx, ldx, panel, ldx, b, ncols, y + int64_t{r} * n + c0, n);
    }
  }
}

}  // namespace relgen::cpu::bf16dot

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
