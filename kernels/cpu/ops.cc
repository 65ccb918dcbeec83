#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

// vmath's wide helpers return vectors, but every call is inlined into a function of the matching
// target in this file: no call crosses the ABI the warning is about.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#else
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#include "kernels/cpu/vmath.h"


namespace relgen::cpu {

void Linear(const float* x, int rows, int in, const float* w, const float* bias, int out, float* y) {
  if (bias != nullptr) {
    for (int r = 0; r < rows; ++r) std::copy(bias, bias + out, y + static_cast<int64_t>(r) * out);
  }
  if (rows == 0 || out == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f, x, in, w, in,
              bias != nullptr ? 1.0f : 0.0f, y, out);
}

void LayerNorm(const float* x, int rows, int dim, const float* weight, const float* bias, float eps,
               float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * dim;
    float* yr = y + static_cast<int64_t>(r) * dim;
    double mean = 0;
    for (int i = 0; i < dim; ++i) mean += xr[i];
    mean /= dim;
    double var = 0;
    for (int i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= dim;
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    const float m = static_cast<float>(mean);
    for (int i = 0; i < dim; ++i) {
      yr[i] = (xr[i] - m) * inv * weight[i] + (bias != nullptr ? bias[i] : 0.0f);
    }
  }
}

void RmsNorm(const float* x, int rows, int dim, const float* weight, float eps, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * dim;
    float* yr = y + static_cast<int64_t>(r) * dim;
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int i = 0; i < dim; ++i) yr[i] = xr[i] * inv * weight[i];
  }
}

namespace {

// The activations on N lanes (kernels/cpu/vmath.h); every element of an array goes through
// these, so an element's result does not depend on its index. Each lane computes the same
// roundings at every width (this file never fuses a multiply-add), so the widths a CPU picks
// between give the same bits.
// (In place through a reference: returning a wide vector from a function of no target draws an
// ABI warning.)
template <typename V, typename I>
__attribute__((always_inline)) inline void Apply(Activation act, V& v) {
  const V zero = {};
  switch (act) {
    case Activation::kRelu:
      v = v > zero ? v : zero;
      return;
    case Activation::kGelu:
      v = (zero + 0.5f) * v * ((zero + 1.0f) + vmath::ErfN<V, I>(v * 0.70710678118654752f));
      return;
    case Activation::kGeluTanh: {
      const V c = zero + 0.79788456080286536f;  // sqrt(2/pi)
      v = (zero + 0.5f) * v * ((zero + 1.0f) + vmath::TanhN<V, I>(c * (v + (zero + 0.044715f) * v * v * v)));
      return;
    }
    case Activation::kSilu:
      v = v / ((zero + 1.0f) + vmath::ExpN<V, I>(-v));
      return;
  }
}

// x[0..n) through the activation N at a time; a last partial group padded with zeros.
template <typename V, typename I>
__attribute__((always_inline)) inline void ActivateN(Activation act, float* x, int64_t n) {
  constexpr int kN = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + kN <= n; i += kN) {
    V v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    Apply<V, I>(act, v);
    __builtin_memcpy(x + i, &v, sizeof(v));
  }
  if (i < n) {
    V v = {};
    for (int64_t l = 0; i + l < n; ++l) v[l] = x[i + l];
    Apply<V, I>(act, v);
    for (int64_t l = 0; i + l < n; ++l) x[i + l] = v[l];
  }
}

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));

__attribute__((target("avx512f"))) void ActivateAvx512(Activation act, float* x, int64_t n) {
  ActivateN<V16, I16>(act, x, n);
}
__attribute__((target("avx2"))) void ActivateAvx2(Activation act, float* x, int64_t n) {
  ActivateN<V8, I8>(act, x, n);
}
void ActivateBase(Activation act, float* x, int64_t n) { ActivateN<vmath::V4, vmath::I4>(act, x, n); }

using ActivateFn = void (*)(Activation, float*, int64_t);

// x[i] = exp(x[i] - shift) N at a time (the same bits at every width, as the activations).
template <typename V, typename I>
__attribute__((always_inline)) inline void ExpShiftedN(float* x, int64_t n, float shift) {
  constexpr int kN = sizeof(V) / sizeof(float);
  const V s = V{} + shift;
  int64_t i = 0;
  for (; i + kN <= n; i += kN) {
    V v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    v = vmath::ExpN<V, I>(v - s);
    __builtin_memcpy(x + i, &v, sizeof(v));
  }
  for (; i < n; ++i) {  // one lane at a time through the 4-lane form: the same per-lane arithmetic
    vmath::V4 v = vmath::Splat(0.0f);
    v[0] = x[i];
    x[i] = vmath::Exp(v - vmath::Splat(shift))[0];
  }
}

__attribute__((target("avx512f"))) void ExpShiftedAvx512(float* x, int64_t n, float shift) {
  ExpShiftedN<V16, I16>(x, n, shift);
}
__attribute__((target("avx2"))) void ExpShiftedAvx2(float* x, int64_t n, float shift) {
  ExpShiftedN<V8, I8>(x, n, shift);
}
void ExpShiftedBase(float* x, int64_t n, float shift) { ExpShiftedN<vmath::V4, vmath::I4>(x, n, shift); }

using ExpShiftedFn = void (*)(float*, int64_t, float);

ExpShiftedFn ExpShiftedOfWidth(int lanes) {
  return lanes == 16 ? ExpShiftedAvx512 : (lanes == 8 ? ExpShiftedAvx2 : ExpShiftedBase);
}

ActivateFn ActivateOfWidth(int lanes) {
  return lanes == 16 ? ActivateAvx512 : (lanes == 8 ? ActivateAvx2 : ActivateBase);
}

}  // namespace

std::vector<int> ActivationWidths() {
  __builtin_cpu_init();
  std::vector<int> widths;
  if (__builtin_cpu_supports("avx512f")) widths.push_back(16);
  if (__builtin_cpu_supports("avx2")) widths.push_back(8);
  widths.push_back(4);
  return widths;
}

void ActivateWithWidth(Activation act, float* x, int64_t n, int lanes) { ActivateOfWidth(lanes)(act, x, n); }

void Activate(Activation act, float* x, int64_t n) {
  static const ActivateFn fn = ActivateOfWidth(ActivationWidths().front());
  fn(act, x, n);
}

void ActivateGated(Activation act, float* x, const float* gate, int64_t n) {
  Activate(act, x, n);
  for (int64_t i = 0; i < n; ++i) x[i] *= gate[i];
}

void Embedding(const float* table, int dim, const int32_t* ids, int n, float scale, float* out) {
  for (int i = 0; i < n; ++i) {
    const float* row = table + static_cast<int64_t>(ids[i]) * dim;
    float* o = out + static_cast<int64_t>(i) * dim;
    for (int d = 0; d < dim; ++d) o[d] = row[d] * scale;
  }
}

void AddInPlace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void SoftmaxRows(float* x, int rows, int cols, int ld) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  static const ExpShiftedFn exp_shifted = ExpShiftedOfWidth(ActivationWidths().front());
  for (int r = 0; r < rows; ++r) {
    float* row = x + static_cast<int64_t>(r) * ld;
    // The maximum in four lanes (exact in any order), the sum in four lanes reduced in a fixed
    // order: a row's result depends on its values alone.
    vmath::V4 m4 = vmath::Splat(kNegInf);
    int c = 0;
    for (; c + 4 <= cols; c += 4) {
      vmath::V4 v;
      __builtin_memcpy(&v, row + c, sizeof(v));
      m4 = vmath::Select(v > m4, v, m4);
    }
    float mx = std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
    for (; c < cols; ++c) mx = std::max(mx, row[c]);
    if (mx == kNegInf) {  // nothing visible: all-zero weights rather than NaN
      std::fill(row, row + cols, 0.0f);
      continue;
    }
    // exp(-inf) is 0 here (masked keys).
    exp_shifted(row, cols, mx);
    vmath::V4 s4 = vmath::Splat(0.0f);
    for (c = 0; c + 4 <= cols; c += 4) {
      vmath::V4 v;
      __builtin_memcpy(&v, row + c, sizeof(v));
      s4 += v;
    }
    for (int l = 0; c < cols; ++c, ++l) s4[l] += row[c];
    const float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
    const float inv = 1.0f / sum;
    for (c = 0; c < cols; ++c) row[c] *= inv;
  }
}

}  // namespace relgen::cpu
