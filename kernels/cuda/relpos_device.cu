// Device instantiation of the shared relative-position index functions: fills, for every
// (query, key) pair of a window, the index a kernel would use, so tests can check device == host.
#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/relpos_device.h"
#include "kernels/relpos.h"

namespace relgen::cuda {
namespace {

__global__ void RelIndexKernel(relpos::Scheme scheme, int param, int block_length, int n,
                               const int32_t* t5_table, int t5_len, int32_t* out) {
  const int i = blockIdx.y * blockDim.y + threadIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n || j >= n) return;
  int32_t v = -2;  // not visible
  if (j <= i && j >= relpos::WindowStart(scheme, i, block_length)) {
    switch (scheme) {
      case relpos::Scheme::kSkew:
      case relpos::Scheme::kSkewLocal:
        v = relpos::SkewRow(i - j, param);
        break;
      case relpos::Scheme::kShaw:
        v = relpos::ShawRow(i, j, param);
        break;
      case relpos::Scheme::kT5:
        v = relpos::T5BucketOfDistance(t5_table, t5_len, i - j);
        break;
      default:
        v = i - j;
    }
  }
  out[i * n + j] = v;
}

}  // namespace

cudaError_t RelIndices(relpos::Scheme scheme, int param, int block_length, int n,
                       const int32_t* t5_table_host, int t5_len, int32_t* out_host) {
  int32_t* d_out = nullptr;
  int32_t* d_t5 = nullptr;
  cudaError_t err = cudaMalloc(&d_out, sizeof(int32_t) * n * n);
  if (err == cudaSuccess && t5_len > 0) {
    err = cudaMalloc(&d_t5, sizeof(int32_t) * t5_len);
    if (err == cudaSuccess) {
      err = cudaMemcpy(d_t5, t5_table_host, sizeof(int32_t) * t5_len, cudaMemcpyHostToDevice);
    }
  }
  if (err == cudaSuccess) {
    const dim3 block(16, 16);
    const dim3 grid((n + 15) / 16, (n + 15) / 16);
    RELGEN_LAUNCH(RelIndexKernel, grid, block, 0, nullptr)(scheme, param, block_length, n, d_t5, t5_len, d_out);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    err = cudaMemcpy(out_host, d_out, sizeof(int32_t) * n * n, cudaMemcpyDeviceToHost);
  }
  cudaFree(d_out);
  cudaFree(d_t5);
  return err;
}

}  // namespace relgen::cuda
