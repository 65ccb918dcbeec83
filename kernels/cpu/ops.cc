#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

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

// The activations on four lanes (kernels/cpu/vmath.h); every element of an array goes through
// these, so an element's result does not depend on its index.
vmath::V4 Apply(Activation act, vmath::V4 v) {
  using vmath::Splat;
  switch (act) {
    case Activation::kRelu:
      return vmath::Select(v > Splat(0.0f), v, Splat(0.0f));
    case Activation::kGelu:
      return Splat(0.5f) * v * (Splat(1.0f) + vmath::Erf(v * Splat(0.70710678118654752f)));
    case Activation::kGeluTanh: {
      const vmath::V4 c = Splat(0.79788456080286536f);  // sqrt(2/pi)
      return Splat(0.5f) * v * (Splat(1.0f) + vmath::Tanh(c * (v + Splat(0.044715f) * v * v * v)));
    }
    case Activation::kSilu:
      return v / (Splat(1.0f) + vmath::Exp(-v));
  }
  return v;
}

}  // namespace

void Activate(Activation act, float* x, int64_t n) {
  vmath::Map(x, n, [act](vmath::V4 v) { return Apply(act, v); });
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
    vmath::Map(row, cols, [mx](vmath::V4 v) { return vmath::Exp(v - vmath::Splat(mx)); });
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
