// A loaded model: validated config plus float32 weights, immutable and shareable across threads.
// Tensor names and shapes are fixed by the config (ExpectedTensors) and documented in
// docs/model-format.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"

namespace relgen {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// "[d0, d1, ...]", for messages.
std::string ShapeStr(const std::vector<int64_t>& shape);

// Refuses a tensor that is not F32/F16/BF16 or not of `shape`; `origin` names the file in the message.
absl::Status CheckFloatTensor(const TensorInfo& t, absl::string_view name, const std::vector<int64_t>& shape,
                              absl::string_view origin);

// Every tensor a model with this config must carry, in file order of the documentation.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// Pointers into Model's storage; null where the config has no such tensor.
struct LayerWeights {
  const float* attn_norm_w = nullptr;  // [d_model]
  const float* attn_norm_b = nullptr;  // [d_model] (layernorm)
  const float* wq = nullptr;           // [heads*head_dim, d_model]
  const float* bq = nullptr;
  const float* wk = nullptr;
  const float* bk = nullptr;
  const float* wv = nullptr;
  const float* bv = nullptr;
  const float* wo = nullptr;  // [d_model, heads*head_dim]
  const float* bo = nullptr;
  const float* ffn_norm_w = nullptr;
  const float* ffn_norm_b = nullptr;
  const float* w_up = nullptr;  // [ffn_dim, d_model]
  const float* b_up = nullptr;
  const float* w_gate = nullptr;  // [ffn_dim, d_model] (gated FFN)
  const float* b_gate = nullptr;
  const float* w_down = nullptr;  // [d_model, ffn_dim]
  const float* b_down = nullptr;
  const float* rel_k = nullptr;     // skew [Hs, M, head_dim]; shaw [Hs, 2k+1, head_dim]
  const float* rel_v = nullptr;     // shaw relative values [Hs, 2k+1, head_dim]
  const float* rel_bias = nullptr;  // t5 [Hs, num_buckets]
  // Cross-attention of an encoder-decoder model's decoder layers: norm, then q of the decoder state
  // and k, v of the encoder output.
  const float* cross_norm_w = nullptr;
  const float* cross_norm_b = nullptr;
  const float* cq = nullptr;
  const float* cq_b = nullptr;
  const float* ck = nullptr;
  const float* ck_b = nullptr;
  const float* cv = nullptr;
  const float* cv_b = nullptr;
  const float* co = nullptr;  // [d_model, heads*head_dim]
  const float* co_b = nullptr;
};

// Float32 tensors by relgen name (docs/model-format.md), as a checkpoint mapping produces them.
using TensorMap = std::unordered_map<std::string, std::vector<float>>;

class Model {
 public:
  // Loads a model directory: relgen's own format (config.json + model.safetensors) or a Hugging
  // Face checkpoint (config.json with model_type; engine/model/hf_checkpoint.h).
  static absl::StatusOr<std::shared_ptr<const Model>> Load(const std::string& dir);
  // `dir` is only recorded (for reporting and for files beside the weights, e.g. a tokenizer).
  static absl::StatusOr<std::shared_ptr<const Model>> FromFiles(ModelConfig config,
                                                                const std::string& weights_path,
                                                                std::string dir = "");
  // Takes tensors already mapped to relgen names and float32: every expected one must be there with
  // its shape, finite, and nothing else. `origin` names where they came from, in errors.
  static absl::StatusOr<std::shared_ptr<const Model>> FromTensors(ModelConfig config, TensorMap tensors,
                                                                  DType file_dtype, const std::string& origin,
                                                                  std::string dir = "");

  const ModelConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  const LayerWeights& layer(int i) const { return layers_[i]; }
  // Encoder-decoder models: the encoder's layers (rel_bias the encoder's own table) and final norm.
  const LayerWeights& encoder_layer(int i) const { return encoder_layers_[i]; }
  const float* encoder_final_norm_w() const { return encoder_final_norm_w_; }
  const float* encoder_final_norm_b() const { return encoder_final_norm_b_; }
  // Exact T5 bucket of each signed relative position -max_distance..max_distance (encoder, t5 only).
  const std::vector<int32_t>& t5_encoder_bucket_table() const { return t5_encoder_table_; }
  const float* embed() const { return embed_; }
  const float* embed_norm_w() const { return embed_norm_w_; }  // null without embedding_norm
  const float* embed_norm_b() const { return embed_norm_b_; }
  const float* final_norm_w() const { return final_norm_w_; }
  const float* final_norm_b() const { return final_norm_b_; }
  const float* lm_head() const { return lm_head_; }  // the embedding when tied
  // Exact T5 bucket of each causal distance 0..max_distance (t5 only).
  const std::vector<int32_t>& t5_bucket_table() const { return t5_table_; }
  const std::vector<float>& alibi_slopes() const { return alibi_slopes_; }
  int64_t num_parameters() const { return num_parameters_; }
  int64_t float_bytes() const { return num_parameters_ * static_cast<int64_t>(sizeof(float)); }
  // Weight dtype on disk (the first tensor's), for reporting.
  DType file_dtype() const { return file_dtype_; }

 private:
  Model() = default;
  const float* Get(const std::string& name) const;

  ModelConfig config_;
  std::string dir_;
  TensorMap storage_;
  std::vector<LayerWeights> layers_;
  std::vector<LayerWeights> encoder_layers_;
  const float* encoder_final_norm_w_ = nullptr;
  const float* encoder_final_norm_b_ = nullptr;
  std::vector<int32_t> t5_encoder_table_;
  const float* embed_ = nullptr;
  const float* embed_norm_w_ = nullptr;
  const float* embed_norm_b_ = nullptr;
  const float* final_norm_w_ = nullptr;
  const float* final_norm_b_ = nullptr;
  const float* lm_head_ = nullptr;
  std::vector<int32_t> t5_table_;
  std::vector<float> alibi_slopes_;
  int64_t num_parameters_ = 0;
  DType file_dtype_ = DType::kF32;
};

}  // namespace relgen
