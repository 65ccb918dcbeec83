// CUDA backend: the decoder forward on one GPU, float32, with the kernels of kernels/cuda and
// cuBLAS for the projections. Built where nvcc is found (RELGEN_WITH_CUDA), and in test trees
// against relgen's SIMT emulator (tests/simt), where device() reports "simt-emulator:N".
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace relgen {

// Number of CUDA devices usable now (0 without a driver or device, or in a build without CUDA).
int CudaDeviceCount();

// Bytes of device KV pool per token (every layer's K and V, float32).
int64_t CudaKvBytesPerToken(const ModelConfig& config);

// Free device memory after the model's weights would be loaded, for sizing the KV pool.
absl::StatusOr<int64_t> CudaFreeBytes(int device);

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(std::shared_ptr<const Model> model, KvCacheConfig kv,
                                                        int device = 0);

}  // namespace relgen
