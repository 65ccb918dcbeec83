// Device helpers the decoder's kernel files share (linear.cu, attention.cu, attention_mma.cu,
// kv_write.cu, elementwise.cu). Internal linkage, as when they lived in one file: each translation unit keeps its
// own inlined copy, so moving a kernel between files changes none of its instructions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/decoder_kernels.h"

namespace relgen::cuda {
namespace {

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float Act(int act, float v) {
  switch (act) {
    case 0: return v > 0.f ? v : 0.f;
    case 1: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    case 2: return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case 3: return v / (1.f + expf(-v));
    default: return v;
  }
}

__device__ __forceinline__ int64_t RowOffset(const KvPool& kv, const int32_t* table, int head, int pos) {
  const int64_t block = table[pos / kv.block_size];
  return ((block * kv.n_heads + head) * kv.block_size + pos % kv.block_size) * kv.head_dim;
}

// bf16 storage: cpu::ToBf16's rule (nearest even; a NaN stays a quiet NaN), on the bits so that
// no compiler flag changes it.
__device__ __forceinline__ uint16_t Bf16Bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ void Store(float* p, float f) { *p = f; }
__device__ __forceinline__ void Store(uint16_t* p, float f) { *p = Bf16Bits(f); }
__device__ __forceinline__ float Widen(float f) { return f; }
__device__ __forceinline__ float Widen(uint16_t h) { return __uint_as_float(uint32_t{h} << 16); }
// The two bf16 elements of a 32-bit word (the lower address in the low half).
__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

inline unsigned Blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// The relative terms that are a table lookup rather than a q.E product, shared by both attention
// kernel families (attention.cu, attention_mma.cu) so that their scores agree by construction.
// T5's bias for an encoder's query and key `dist` = query - key apart, from the signed bucket table
// (relpos::T5SignedBucketTable, centred at table_len / 2; farther positions clamp to its ends).
__device__ __forceinline__ float T5SignedBias(const Relative& rel, int th, int dist) {
  const int half = rel.t5_table_len / 2, relative = -dist;
  return rel.t5_bias[th * rel.t5_num_buckets +
                     rel.t5_bucket_of_distance[(relative < -half ? -half : (relative > half ? half : relative)) + half]];
}
// A causal query `dist` positions after its key: T5's bucketed bias or ALiBi's slope times the
// distance; 0 for the schemes whose term is a q.E product (skew, Shaw) or that have none.
__device__ __forceinline__ float CausalScalarBias(const Relative& rel, int th, int h, int dist) {
  switch (rel.scheme) {
    case relpos::Scheme::kT5:
      return rel.t5_bias[th * rel.t5_num_buckets + relpos::T5BucketOfDistance(rel.t5_bucket_of_distance, rel.t5_table_len, dist)];
    case relpos::Scheme::kAlibi:
      return relpos::AlibiBias(rel.alibi_slopes[h], dist);
    default:
      return 0.f;
  }
}

}  // namespace
}  // namespace relgen::cuda
