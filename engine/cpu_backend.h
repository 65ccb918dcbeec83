// CPU backend: float32 decoder forward with the kernels of kernels/cpu (GEMMs through cblas).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace relgen {

// Bytes of KV pool per token (every layer's K and V, float32).
int64_t CpuKvBytesPerToken(const ModelConfig& config);

// Allocates the KV pool of `kv` (num_blocks >= 1). `threads` 0 uses every hardware thread.
absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(std::shared_ptr<const Model> model,
                                                       KvCacheConfig kv, int threads = 0);

}  // namespace relgen
