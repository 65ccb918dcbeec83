// CPU kernels for the dense parts of the decoder. All tensors are row-major float32.
// Thread-safety: every function is reentrant; none keeps state.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/activation.h"

namespace relgen::cpu {

// y[rows, out] = x[rows, in] * w[out, in]^T (+ bias[out] when not null) through cblas. y must not
// alias x. The decoder uses LinearPacked (gemm.h) instead: cblas rows depend on the row count.
void Linear(const float* x, int rows, int in, const float* w, const float* bias, int out, float* y);

// Row-wise norms over `dim`; `bias` may be null. y may alias x.
void LayerNorm(const float* x, int rows, int dim, const float* weight, const float* bias, float eps,
               float* y);
void RmsNorm(const float* x, int rows, int dim, const float* weight, float eps, float* y);

// In place on n values, at the widest vector width this CPU has.
void Activate(Activation act, float* x, int64_t n);
// The same at a given width (tests): 4, or 8 / 16 lanes where the CPU has AVX2 / AVX-512.
std::vector<int> ActivationWidths();
void ActivateWithWidth(Activation act, float* x, int64_t n, int lanes);
// x[i] = act(x[i]) * gate[i], n values (gated FFN, e.g. SwiGLU / GeGLU).
void ActivateGated(Activation act, float* x, const float* gate, int64_t n);

// out[i, :] = table[ids[i], :] * scale. Ids must be in range (checked by the caller).
void Embedding(const float* table, int dim, const int32_t* ids, int n, float scale, float* out);

// y[i] += x[i].
void AddInPlace(float* y, const float* x, int64_t n);

// Numerically stable softmax of each row, in place; entries equal to -inf get probability 0.
void SoftmaxRows(float* x, int rows, int cols, int ld);

}  // namespace relgen::cpu
