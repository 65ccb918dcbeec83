// Picks and creates the backend for a --device setting, and sizes its KV pool.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backends/backend.h"
#include "engine/model/model.h"

namespace relgen {

struct DeviceOptions {
  std::string device = "auto";  // auto (CUDA when a device is present), cpu, cuda, cuda:N
  int64_t kv_cache_tokens = 0;  // 0: size by memory fraction (host memory or free device memory)
  double kv_cache_memory_fraction = 0.2;
  int kv_block_size = 16;
  int threads = 0;  // CPU threads
  std::string weights_dtype = "f32";  // dense weights: f32, bf16, or on the CPU int8
  std::string kv_cache_dtype = "f32";  // K/V cache elements: f32 or bf16
  // CUDA projections: "invariant" (relgen's kernel, rows batch invariant) or "cublas"
  // (CudaOptions::cublas_gemms).
  std::string cuda_gemm = "invariant";
  int cuda_split_keys = 128;  // CudaOptions::attention_split_keys
  // The largest step the engine's scheduler forms (--max_batch_tokens, --max_num_seqs): a device
  // backend allocates its buffers at start.
  int max_step_tokens = 512;
  int max_step_seqs = 64;
};

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(std::shared_ptr<const Model> model, const DeviceOptions& options);

}  // namespace relgen
