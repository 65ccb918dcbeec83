// Elementwise and per-row kernels of the decoder: embedding, norms, bias + activation, gating,
// residual adds, and the bf16 rounding of cuBLAS operands.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

__global__ void EmbeddingKernel(const int32_t* ids, int n, const float* table, int dim, float scale, float* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= int64_t{n} * dim) return;
  const int64_t row = i / dim, col = i % dim;
  out[i] = table[int64_t{ids[row]} * dim + col] * scale;
}

__global__ void NormKernel(bool layernorm, const float* x, int dim, const float* w, const float* b, float eps, float* y) {
  __shared__ float red[32];
  const float* xr = x + int64_t{blockIdx.x} * dim;
  float* yr = y + int64_t{blockIdx.x} * dim;
  auto block_sum = [&](float v) {
    v = WarpSum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    if (threadIdx.x < 32) t = WarpSum(t);
    if (threadIdx.x == 0) red[0] = t;
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
  };
  float mean = 0.f;
  if (layernorm) {
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    mean = block_sum(s) / dim;
  }
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += (xr[i] - mean) * (xr[i] - mean);
  const float inv = rsqrtf(block_sum(ss) / dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    yr[i] = (xr[i] - mean) * inv * w[i] + (b != nullptr ? b[i] : 0.f);
  }
}

// `batch` matrices of n = rows * cols elements, batch_stride apart, each with its own bias row.
__global__ void BiasActivateKernel(float* y, int64_t n, int cols, const float* bias, int act, int batch,
                                   int64_t batch_stride) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n * batch) return;
  const int64_t b = i / n, e = i % n;
  float* const at = y + b * batch_stride + e;
  const float v = *at + (bias != nullptr ? bias[b * cols + e % cols] : 0.f);
  *at = Act(act, v);
}

__global__ void GatedKernel(int act, float* x, const float* gate, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) x[i] = Act(act, x[i]) * gate[i];
}

__global__ void AddKernel(float* y, const float* x, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) y[i] += x[i];
}

__global__ void RoundToBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) y[i] = Bf16Bits(x[i]);
}

}  // namespace

cudaError_t Embedding(const int32_t* ids, int n, const float* table, int dim, float scale, float* out, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(EmbeddingKernel, Blocks(int64_t{n} * dim, 256), 256, 0, s)(ids, n, table, dim, scale, out);
  return cudaGetLastError();
}

cudaError_t Norm(bool layernorm, const float* x, int rows, int dim, const float* w, const float* b, float eps, float* y,
                 cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  RELGEN_LAUNCH(NormKernel, rows, 256, 0, s)(layernorm, x, dim, w, b, eps, y);
  return cudaGetLastError();
}

cudaError_t BiasActivate(float* y, int rows, int cols, const float* bias, int act, cudaStream_t s, int batch,
                         int64_t batch_stride) {
  const int64_t n = int64_t{rows} * cols;
  if (n == 0 || batch == 0) return cudaSuccess;
  RELGEN_LAUNCH(BiasActivateKernel, Blocks(n * batch, 256), 256, 0, s)(y, n, cols, bias, act, batch, batch_stride);
  return cudaGetLastError();
}

cudaError_t ActivateGated(int act, float* x, const float* gate, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(GatedKernel, Blocks(n, 256), 256, 0, s)(act, x, gate, n);
  return cudaGetLastError();
}

cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(AddKernel, Blocks(n, 256), 256, 0, s)(y, x, n);
  return cudaGetLastError();
}

cudaError_t RoundToBf16(const float* x, int64_t n, uint16_t* y, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(RoundToBf16Kernel, Blocks(n, 256), 256, 0, s)(x, n, y);
  return cudaGetLastError();
}

}  // namespace relgen::cuda
