// CUDA backend: the decoder forward on one GPU, float32 (weights and the K/V cache float32 or bf16), with the
// kernels of kernels/cuda (the projections through cuda::Linear, or cuBLAS: CudaOptions). Built
// where nvcc is found (RELGEN_WITH_CUDA), and in test trees against relgen's SIMT emulator
// (tests/simt), where Describe().device is "simt-emulator:N".
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backends/backend.h"
#include "engine/model/model.h"
#include "kernels/storage_types.h"

namespace relgen {

// Number of CUDA devices usable now (0 without a driver or device, or in a build without CUDA).
int CudaDeviceCount();

// Bytes of device KV pool per token (every layer's K and V, in `kv_type`).
int64_t CudaKvBytesPerToken(const ModelConfig& config, KvType kv_type = KvType::kF32);

struct CudaOptions {
  int device = 0;
  int block_size = 16;
  // The KV pool: this many blocks, or with 0, `kv_memory_fraction` of the device memory free after
  // the weights, the step buffers and `headroom_bytes`.
  int num_blocks = 0;
  double kv_memory_fraction = 0.9;
  // How the pool stores K and V: float32, or bf16 (KvType's rule: rounded to nearest even when
  // written, widened exactly when read, float32 arithmetic), half the bytes per token.
  KvType kv_type = KvType::kF32;
  // The largest step the engine's scheduler forms (--max_batch_tokens, --max_num_seqs): its buffers
  // are allocated at start, so no step can run out of device memory later.
  int max_step_tokens = 512;
  int max_step_seqs = 64;
  int max_step_encoder_tokens = 2048;  // input tokens encoded in one step (the scheduler's budget)
  // Left free for cuBLAS's workspace and the allocator's slack.
  int64_t headroom_bytes = int64_t{64} << 20;
  // Decode steps (one new token per sequence, nothing to encode) run as a CUDA graph captured once
  // per batch size: one launch instead of one per kernel and GEMM. Outputs are the same bits.
  bool graphs = true;
  // The projections (and the LM head): relgen's kernel (cuda::Linear), whose rows are batch
  // invariant and which applies bias, activation and residual in the same launch; or cuBLAS
  // (`cublas_gemms`: SGEMM in pedantic mode over float32 weights; over bf16 weights GemmEx on the
  // tensor cores, each input rounded to bf16 first, float32 sums), which picks its algorithm, and so
  // a row's order of summation, by the problem's shape (a row's bits may change with the rows
  // beside it) and needs a launch of its own for bias and activation.
  bool cublas_gemms = false;
  // Keys per attention block (flash-decoding's split): fixed, not chosen per step, because a row's
  // bits depend on where its keys are split. Fewer keys per split give more blocks (batch 1 wants
  // them), at the cost of more partial results to merge.
  int attention_split_keys = 128;
  // The projections' weights (and the LM head's): float32, or bf16 (WeightType::kBf16, the CPU
  // backend's weight-only rule: rounded to nearest even at load, widened exactly, float32 sums),
  // half the weight bytes a decode step reads. int8 is the CPU's alone. Embeddings, norms, biases and relative tables stay
  // float32.
  WeightType weight_type = WeightType::kF32;
  // bf16 weights' projections on tensor cores (cuda::LinearMma: x rounded to bf16 per element, float
  // accumulation in a fixed order, rows batch invariant), instead of relgen's float32 kernel over the
  // widened weights. Needs weight_type kBf16.
  bool tensor_cores = false;
  // Attention on tensor cores (cuda::AttentionMma: q, the skew / Shaw E rows and the softmax weights
  // rounded to bf16, float accumulation; prefill and decode the same bits) wherever the pool is bf16
  // and head_dim is 16, 32, 64 or 128; elsewhere (the encoder's float32 K/V, other head sizes)
  // cuda::Attention. Needs kv_type kBf16.
  bool attention_tensor_cores = false;
};

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(std::shared_ptr<const Model> model, const CudaOptions& options);
// A pool of kv.num_blocks blocks, the default step limits.
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(std::shared_ptr<const Model> model, KvCacheConfig kv,
                                                        int device = 0);

}  // namespace relgen
