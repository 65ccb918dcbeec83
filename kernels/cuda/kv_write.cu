// Writing a step's K and V rows into the paged cache (the unfused path; the fused QKV projection
// writes them from its epilogue in linear.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

template <typename T>
__global__ void WriteKvKernel(KvPool kv, Rows rows, const float* k, const float* v) {
  const int r = blockIdx.x, h = blockIdx.y;
  const int width = kv.n_heads * kv.head_dim;
  const int32_t* table = rows.block_tables + rows.table_offset[r];
  const int64_t dst = RowOffset(kv, table, h, rows.position[r]);
  T* const pk = static_cast<T*>(kv.k);
  T* const pv = static_cast<T*>(kv.v);
  for (int d = threadIdx.x; d < kv.head_dim; d += blockDim.x) {
    Store(pk + dst + d, k[int64_t{r} * width + h * kv.head_dim + d]);
    Store(pv + dst + d, v[int64_t{r} * width + h * kv.head_dim + d]);
  }
}

}  // namespace

cudaError_t WriteKv(const KvPool& kv, const Rows& rows, const float* k, const float* v, cudaStream_t s) {
  if (rows.n == 0) return cudaSuccess;
  if (kv.type == KvElem::kBf16) {
    RELGEN_LAUNCH(WriteKvKernel<uint16_t>, dim3(rows.n, kv.n_heads), 64, 0, s)(kv, rows, k, v);
  } else {
    RELGEN_LAUNCH(WriteKvKernel<float>, dim3(rows.n, kv.n_heads), 64, 0, s)(kv, rows, k, v);
  }
  return cudaGetLastError();
}

}  // namespace relgen::cuda
