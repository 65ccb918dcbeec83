// Picks and creates the backend for a --device setting, and sizes its KV pool.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backends/backend.h"
#include "engine/model/model.h"

namespace relgen {

inline constexpr double kCudaKvDefaultFraction = 0.9;

struct DeviceOptions {
  std::string device = "auto";  // auto (CUDA when a device is present), cpu, cuda, cuda:N
  int64_t kv_cache_tokens = 0;  // 0: size by memory fraction (host memory or free device memory)
  // 0: the device's default: on a GPU kCudaKvDefaultFraction of what the weights, the largest step's
  // buffers and the headroom leave; on the CPU max_step_seqs whole sequences, within
  // kCpuKvDefaultFraction of the memory available (its pages taken only as used).
  double kv_cache_memory_fraction = 0;
  int kv_block_size = 16;
  int threads = 0;  // CPU threads
  // Dense weights: f32, bf16, on the CPU int8, or auto (ResolveDeviceOptions).
  std::string weights_dtype = "auto";
  std::string kv_cache_dtype = "auto";  // K/V cache elements: f32, bf16 or auto (ResolveDeviceOptions)
  // CPU projections' inputs: f32, bf16 (rounded first; with bf16 weights AMX-BF16 or AVX-512 BF16
  // dot products where the CPU has them: ProjectionInputs::kBf16Dot), or auto (ResolveDeviceOptions).
  std::string activations_dtype = "auto";
  // CUDA projections: "invariant" (relgen's kernel, float32 arithmetic, rows batch invariant),
  // "cublas" (CudaOptions::cublas_gemms), "mma" (tensor cores over bf16 weights,
  // CudaOptions::tensor_cores), or auto (invariant until the tensor cores' kernel is timed).
  std::string cuda_gemm = "auto";
  std::string cuda_attention = "simt";  // simt (relgen's float32 kernels) or mma (tensor cores, bf16 cache)
  int cuda_split_keys = 128;  // CudaOptions::attention_split_keys
  // The largest step the engine's scheduler forms (--max_batch_tokens, --max_num_seqs): a device
  // backend allocates its buffers at start.
  int max_step_tokens = 512;
  int max_step_seqs = 64;
  int max_step_encoder_tokens = 2048;  // --max_encoder_tokens
};

// `o` with every choice made: the device (auto: CUDA when a GPU is present), its index in
// `cuda_index`, and the storage and projections that `auto` picks for it. On a GPU: bf16 weights
// and a bf16 cache, relgen's projection kernel. On the CPU: a bf16 checkpoint computes from bf16
// weights with bf16 K/V, any other in float32, so no CPU default loses the checkpoint's precision;
// bf16 weights take bf16 inputs where the CPU multiplies bf16 pairs (AMX-BF16, AVX-512 BF16).
// INVALID_ARGUMENT names an unknown value and the allowed ones.
absl::StatusOr<DeviceOptions> ResolveDeviceOptions(const Model& model, DeviceOptions o, int* cuda_index = nullptr);

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(std::shared_ptr<const Model> model, const DeviceOptions& options);

}  // namespace relgen
