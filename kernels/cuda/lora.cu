// LoRA adapters applied to a projection's output, each row under its own adapter (BGMV-style: one
// launch for every adapter of a step, the adapter looked up per row on the device).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

constexpr int kLoraThreads = 256;

// One block per row (x) and range of kLoraThreads outputs (y). Its warps take the rank's dot
// products x . A[j] (lane-strided over k in order, then WarpSum's fixed butterfly), the same in
// every block of the row, then its threads their outputs (j in order): a row's bits depend on its
// own input and adapter alone. A row without an adapter of this projection returns at once, the
// whole block together (its slot and rank are the block's). A decode step's few rows still fill
// the device: a block per output range, and the A reads the ranges repeat come from L2.
__global__ void __launch_bounds__(kLoraThreads) LoraAddKernel(const float* x, int in, int out, const LoraDesc* descs,
                                                              int desc_stride, const int32_t* slot, float* y,
                                                              int64_t y_stride) {
  const int r = blockIdx.x;
  const int s = slot[r];
  if (s < 0) return;
  const LoraDesc d = descs[int64_t{s} * desc_stride];
  if (d.rank == 0) return;
  __shared__ float t[kLoraMaxRank];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* xr = x + int64_t{r} * in;
  for (int j = warp; j < d.rank; j += kLoraThreads / 32) {
    const float* aj = d.a + int64_t{j} * in;
    float sum = 0.f;
    for (int k = lane; k < in; k += 32) sum += xr[k] * aj[k];
    sum = WarpSum(sum);
    if (lane == 0) t[j] = sum;
  }
  __syncthreads();
  const int o = blockIdx.y * kLoraThreads + threadIdx.x;
  if (o >= out) return;
  const float* bo = d.b + int64_t{o} * d.rank;
  float u = 0.f;
  for (int j = 0; j < d.rank; ++j) u += t[j] * bo[j];
  y[int64_t{r} * y_stride + o] += d.scale * u;
}

}  // namespace

cudaError_t LoraAdd(const float* x, int rows, int in, int out, const LoraDesc* descs, int desc_stride,
                    const int32_t* slot, float* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RELGEN_LAUNCH(LoraAddKernel, dim3(rows, Blocks(out, kLoraThreads)), kLoraThreads, 0, stream)(x, in, out, descs, desc_stride, slot, y, int64_t{out});
  return cudaGetLastError();
}

}  // namespace relgen::cuda
