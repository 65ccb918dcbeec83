// CPU backend: the decoder forward with the kernels of kernels/cpu, float32 arithmetic; dense
// weights stored as float32, bf16 or int8.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backends/backend.h"
#include "engine/model/model.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"

namespace relgen {

// Bytes of KV pool per token (every layer's K and V, of `kv_type` elements).
int64_t CpuKvBytesPerToken(const ModelConfig& config, cpu::KvType kv_type = cpu::KvType::kF32);

// The default pool's cap, as a fraction of the memory available at start.
inline constexpr double kCpuKvDefaultFraction = 0.2;

// Blocks for a KV pool of `tokens` tokens, or, when tokens is 0, of `memory_fraction` (0, 1] of the
// memory available now (MemAvailable); with both 0 (the default), `max_seqs` whole sequences of
// max_seq_len, at most kCpuKvDefaultFraction of it. Errors say what is too small and what would fit.
absl::StatusOr<int> CpuKvBlocks(const ModelConfig& config, int64_t tokens, double memory_fraction,
                                int block_size, cpu::KvType kv_type = cpu::KvType::kF32, int max_seqs = 0);

// How each projection's input enters the multiply. kF32: as computed. kBf16: rounded to bf16
// (nearest even) first, the lm_head input scale applied to the product: the arithmetic of the CUDA
// backend's tensor cores (with bf16 weights every product is exact in float32, so only the order of
// the float32 sums differs), their CPU twin. kBf16Dot: rounded likewise, and with bf16 weights on a
// CPU with AMX-BF16 or AVX-512 BF16 multiplied by bf16 dot products (cpu::LinearBf16Dot: pairs of products per
// float32 addition, twice the arithmetic); elsewhere the same as kBf16.
enum class ProjectionInputs { kF32, kBf16, kBf16Dot };

// Allocates the KV pool of `kv` (num_blocks >= 1). `threads` 0 uses every hardware thread.
// `weights` is how the dense layers' weights (and the LM head) are stored, `kv_type` the K/V
// cache's elements; outputs are batch invariant within each combination.
absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(std::shared_ptr<const Model> model,
                                                       KvCacheConfig kv, int threads = 0,
                                                       cpu::WeightType weights = cpu::WeightType::kF32,
                                                       cpu::KvType kv_type = cpu::KvType::kF32,
                                                       ProjectionInputs inputs = ProjectionInputs::kF32);

}  // namespace relgen
