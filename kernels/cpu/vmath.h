// exp, erf and tanh on four floats at once (SSE2, the baseline), for softmax and the activations.
// Each lane's result depends on that lane's input alone, and a caller runs every element through
// these (a tail is padded, never sent to libm), so an element's bits never depend on where it sits.
// Accuracy: exp within 2 ulp over the normal range (Cephes' degree-5 polynomial after a two-part
// ln 2 reduction), 0 below -87.34, e^88.376 above 88.376 (finite); erf within 6e-7 absolute
// (Abramowitz & Stegun 7.1.26, 1.5e-7 before float rounding); tanh within 3e-7 absolute (from exp).
// The tests compare them with libm.
#pragma once

#include <cstdint>

namespace relgen::cpu::vmath {

typedef float V4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));

__attribute__((always_inline)) inline V4 Splat(float v) { return V4{v, v, v, v}; }

__attribute__((always_inline)) inline V4 Select(I4 mask, V4 a, V4 b) {  // mask lanes all-ones: a
  return reinterpret_cast<V4>((reinterpret_cast<I4>(a) & mask) | (reinterpret_cast<I4>(b) & ~mask));
}

// Exp on any width of float lanes V (with I its int32 lanes): the same per-lane arithmetic, so a
// lane's bits do not depend on the width it ran at.
template <typename V, typename I>
__attribute__((always_inline)) inline V ExpN(V x) {
  const V zero = {};
  const I under = x < zero - 87.33654f;
  x = x > zero + 88.3762626f ? zero + 88.3762626f : x;  // keeps 2^n finite
  x = under ? zero - 87.33654f : x;
  // n = round(x / ln 2), by truncation corrected to floor of x / ln 2 + 0.5.
  const V fx = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(fx, I);
  n += reinterpret_cast<I>(__builtin_convertvector(n, V) > fx);  // true is -1: floor
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * (r * r) + r + 1.0f;
  const V scale = reinterpret_cast<V>((n + 127) << 23);
  return under ? zero : y * scale;
}

__attribute__((always_inline)) inline V4 Exp(V4 x) { return ExpN<V4, I4>(x); }

// Erf and tanh on any width, like ExpN: the same per-lane arithmetic at every width.
template <typename V, typename I>
__attribute__((always_inline)) inline V ErfN(V x) {
  const V zero = {};
  const I neg = x < zero;
  const V a = neg ? -x : x;
  const V t = (zero + 1.0f) / ((zero + 1.0f) + (zero + 0.3275911f) * a);
  V p = zero + 1.061405429f;
  p = p * t + -1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t + -0.284496736f;
  p = p * t + 0.254829592f;
  const V y = (zero + 1.0f) - p * t * ExpN<V, I>(-(a * a));
  return neg ? -y : y;
}

template <typename V, typename I>
__attribute__((always_inline)) inline V TanhN(V x) {
  // 1 - 2 / (e^{2|x|} + 1), sign restored; e^{2|x|} saturates to a large finite value.
  const V zero = {};
  const I neg = x < zero;
  const V a = neg ? -x : x;
  const V y = (zero + 1.0f) - (zero + 2.0f) / (ExpN<V, I>(a + a) + 1.0f);
  return neg ? -y : y;
}

__attribute__((always_inline)) inline V4 Erf(V4 x) { return ErfN<V4, I4>(x); }
__attribute__((always_inline)) inline V4 Tanh(V4 x) { return TanhN<V4, I4>(x); }

// f over x[0..n), four at a time; the last partial group is padded with zeros.
template <typename F>
__attribute__((always_inline)) inline void Map(float* x, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    V4 v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    v = f(v);
    __builtin_memcpy(x + i, &v, sizeof(v));
  }
  if (i < n) {
    V4 v = Splat(0.0f);
    for (int64_t l = 0; i + l < n; ++l) v[l] = x[i + l];
    v = f(v);
    for (int64_t l = 0; i + l < n; ++l) x[i + l] = v[l];
  }
}

}  // namespace relgen::cpu::vmath
