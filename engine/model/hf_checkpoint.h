// Hugging Face checkpoint directories served as they are downloaded: config.json with `model_type`
// (bloom, mpt), weights in model.safetensors or sharded (model.safetensors.index.json + shards,
// memory-mapped), tokenizer.json, and generation_config.json where present. The family's config
// and tensors are mapped once, here, onto relgen's ModelConfig and tensor names; kernels never know
// where weights came from. What each family's keys do and which values are refused: docs/models.md.
// Thread-safety: plain functions without shared state.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/model/model.h"
#include "engine/model/safetensors.h"

namespace relgen {

struct HfCheckpoint {
  ModelConfig config;
  StoredTensors tensors;  // relgen names, as stored (views of the mapped files, which it keeps alive)
  DType file_dtype = DType::kF32;
};

// True when `dir`/config.json names a `model_type` (relgen's own config.json never does).
absl::StatusOr<bool> IsHfCheckpoint(const std::string& dir);

// Reads and maps a checkpoint directory. Refuses, naming the file, key or tensor and what is
// allowed: another model_type, a config value that changes the math in a way relgen does not
// implement (or that transformers and the original code disagree on), .bin-only weights (with the
// one-line conversion), a missing shard or tensor, a tensor of the wrong dtype or shape, a tensor
// the mapping does not use, a missing tokenizer.json.
absl::StatusOr<HfCheckpoint> LoadHfCheckpoint(const std::string& dir);

}  // namespace relgen
