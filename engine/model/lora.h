// LoRA adapters as PEFT saves them (adapter_config.json + adapter_model.safetensors), checked
// against the base model they adapt and mapped onto its relgen tensor names. An adapted projection
// computes y = x W^T + b + scale * ((x A^T) B^T), with A [rank, in], B [out, rank] and scale
// lora_alpha / rank (lora_alpha / sqrt(rank) with use_rslora), as PEFT's LoRA Linear does.
// A fused projection's adapter (BLOOM's query_key_value, MPT's Wqkv) adapts q, k and v: the same A,
// and the rows of B that belong to each part, in the fused layout of the base weights.
// Thread-safety: immutable after loading; safe to share.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/model.h"

namespace relgen {

// One adapted projection of the base.
struct LoraWeights {
  int rank = 0;
  int in = 0, out = 0;
  float scale = 0.0f;
  std::vector<float> a;  // [rank, in]
  std::vector<float> b;  // [out, rank]
};

struct LoraAdapter {
  std::string name;
  std::string dir;
  int rank = 0;  // the largest of its projections'
  // By the base's relgen matrix name ("layers.0.attn.q.weight", "encoder.layers.1.ffn.up.weight").
  std::map<std::string, LoraWeights> targets;
  int64_t bytes() const;
};

// Reads the adapter in `dir` for `base` (a Hugging Face checkpoint; Model::peft_modules). Refuses,
// naming the file, key or tensor and what is allowed: a config that is not LoRA or asks for what
// relgen does not apply (modules_to_save, DoRA, trained biases, layer replication), a tensor for a
// module the base does not have or relgen does not adapt, a shape that does not fit the module, A
// and B of different ranks, a rank other than the config's, a rank over `max_rank`.
absl::StatusOr<std::shared_ptr<const LoraAdapter>> LoadLoraAdapter(const std::string& name, const std::string& dir,
                                                                   const Model& base, int max_rank);

}  // namespace relgen
