// A loaded model: validated config plus its weights, immutable and shareable across threads.
// Weight matrices (projections, embedding, LM head) stay as the checkpoint stores them (F32, F16 or
// BF16), memory-mapped from its files and never copied; a backend widens or packs what it computes
// with from the stored bytes. Small tensors (norms, biases, relative tables) are widened to float32
// at load. Tensor names and shapes are fixed by the config (ExpectedTensors) and documented in
// docs/model-format.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"

namespace relgen {

// A [rows, cols] matrix as the checkpoint stores it, row-major. For a third of a fused QKV
// projection, row r is row SourceRow(r) of the stored (fused) tensor.
struct StoredMatrix {
  enum class Rows : uint8_t { kAll, kChunked, kHeadInterleaved };
  DType dtype = DType::kF32;
  const uint8_t* data = nullptr;  // the stored tensor's first element; not necessarily aligned
  int64_t rows = 0, cols = 0;
  Rows layout = Rows::kAll;
  int part = 0;       // 0 q, 1 k, 2 v (fused layouts)
  int64_t head_dim = 0;  // kHeadInterleaved: rows per head and part
  bool mapped = false;   // bytes of a file mapping (ReleasePages applies), else owned memory

  int64_t numel() const { return rows * cols; }
  int64_t bytes() const { return numel() * DTypeSize(dtype); }
  int64_t SourceRow(int64_t r) const {
    switch (layout) {
      case Rows::kChunked:
        return part * rows + r;
      case Rows::kHeadInterleaved:
        return (r / head_dim * 3 + part) * head_dim + r % head_dim;
      default:
        return r;
    }
  }
  // Rows [row0, row0 + n) widened to float32 (exact) into out [n, cols].
  void Widen(int64_t row0, int64_t n, float* out) const;
  std::vector<float> ToFloat() const;
  // The first element that is not finite (a flipped exponent bit reads as inf or NaN), or -1.
  int64_t FirstNonFinite() const;
  // Drops this matrix's mapped pages from the process's resident memory (they are re-read from the
  // file if touched again): for a backend that has packed or uploaded what it needs.
  void ReleasePages() const;
};

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

// Pointers into Model's storage; null where the config has no such tensor. Matrices as stored,
// the rest float32.
struct LayerWeights {
  const float* attn_norm_w = nullptr;  // [d_model]
  const float* attn_norm_b = nullptr;  // [d_model] (layernorm)
  const StoredMatrix* wq = nullptr;           // [heads*head_dim, d_model]
  const float* bq = nullptr;
  const StoredMatrix* wk = nullptr;
  const float* bk = nullptr;
  const StoredMatrix* wv = nullptr;
  const float* bv = nullptr;
  const StoredMatrix* wo = nullptr;  // [d_model, heads*head_dim]
  const float* bo = nullptr;
  const float* ffn_norm_w = nullptr;
  const float* ffn_norm_b = nullptr;
  const StoredMatrix* w_up = nullptr;  // [ffn_dim, d_model]
  const float* b_up = nullptr;
  const StoredMatrix* w_gate = nullptr;  // [ffn_dim, d_model] (gated FFN)
  const float* b_gate = nullptr;
  const StoredMatrix* w_down = nullptr;  // [d_model, ffn_dim]
  const float* b_down = nullptr;
  const float* rel_k = nullptr;     // skew [Hs, M, head_dim]; shaw [Hs, 2k+1, head_dim]
  const float* rel_v = nullptr;     // shaw relative values [Hs, 2k+1, head_dim]
  const float* rel_bias = nullptr;  // t5 [Hs, num_buckets]
  // Cross-attention of an encoder-decoder model's decoder layers: norm, then q of the decoder state
  // and k, v of the encoder output.
  const float* cross_norm_w = nullptr;
  const float* cross_norm_b = nullptr;
  const StoredMatrix* cq = nullptr;
  const float* cq_b = nullptr;
  const StoredMatrix* ck = nullptr;
  const float* ck_b = nullptr;
  const StoredMatrix* cv = nullptr;
  const float* cv_b = nullptr;
  const StoredMatrix* co = nullptr;  // [d_model, heads*head_dim]
  const float* co_b = nullptr;
};

// Float32 tensors by relgen name (docs/model-format.md), for models made in memory (tests).
using TensorMap = std::unordered_map<std::string, std::vector<float>>;

// Tensors by relgen name as a checkpoint mapping produces them: each a StoredMatrix into bytes that
// `owners` keep alive (the mapped files), small ones already widened in `small`.
struct StoredTensors {
  std::unordered_map<std::string, StoredMatrix> matrices;
  TensorMap small;
  std::vector<std::shared_ptr<const void>> owners;
  // Hugging Face checkpoints: each projection's module path as PEFT names it (the model's module
  // tree, e.g. "transformer.h.0.self_attention.query_key_value") -> the relgen matrices it feeds
  // (one, or q, k and v of a fused projection). Empty for relgen's own format.
  std::map<std::string, std::vector<std::string>> peft_modules;
};

// Whether relgen name `name` is kept as stored (a projection, the embedding or the LM head).
bool IsStoredMatrix(const std::string& name);

// Adds stored tensor `t` as relgen tensor `name` to `out`: a matrix as a view of its mapped bytes
// (or of one third of them, for a fused QKV's `layout` and `part`), anything else widened.
void AddStored(const std::string& name, const TensorInfo& t, StoredTensors* out,
               StoredMatrix::Rows layout = StoredMatrix::Rows::kAll, int part = 0, int64_t head_dim = 0);

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
  // The same checks over tensors as stored (every expected one, of its shape, finite).
  static absl::StatusOr<std::shared_ptr<const Model>> FromStored(ModelConfig config, StoredTensors tensors,
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
  const StoredMatrix& embed() const { return *embed_; }
  const float* embed_norm_w() const { return embed_norm_w_; }  // null without embedding_norm
  const float* embed_norm_b() const { return embed_norm_b_; }
  const float* final_norm_w() const { return final_norm_w_; }
  const float* final_norm_b() const { return final_norm_b_; }
  const StoredMatrix& lm_head() const { return *lm_head_; }  // the embedding when tied
  // Exact T5 bucket of each causal distance 0..max_distance (t5 only).
  const std::vector<int32_t>& t5_bucket_table() const { return t5_table_; }
  const std::vector<float>& alibi_slopes() const { return alibi_slopes_; }
  int64_t num_parameters() const { return num_parameters_; }
  int64_t float_bytes() const { return num_parameters_ * static_cast<int64_t>(sizeof(float)); }
  // Bytes of the weights as stored (what the checkpoint's files hold of them).
  int64_t stored_bytes() const { return stored_bytes_; }
  // Bytes of the small tensors widened to float32 at load (norms, biases, relative tables).
  int64_t small_bytes() const { return small_bytes_; }
  // A matrix by relgen name, or null; a float32 small tensor by relgen name, or null.
  const StoredMatrix* Matrix(const std::string& name) const;
  const float* Small(const std::string& name) const;

  // Where a LoRA adapter's modules land (StoredTensors::peft_modules); empty: not adaptable.
  const std::map<std::string, std::vector<std::string>>& peft_modules() const { return storage_.peft_modules; }

  // Weight dtype on disk (the first tensor's), for reporting.
  DType file_dtype() const { return file_dtype_; }

 private:
  Model() = default;

  ModelConfig config_;
  std::string dir_;
  StoredTensors storage_;
  int64_t stored_bytes_ = 0, small_bytes_ = 0;
  std::vector<LayerWeights> layers_;
  std::vector<LayerWeights> encoder_layers_;
  const float* encoder_final_norm_w_ = nullptr;
  const float* encoder_final_norm_b_ = nullptr;
  std::vector<int32_t> t5_encoder_table_;
  const StoredMatrix* embed_ = nullptr;
  const float* embed_norm_w_ = nullptr;
  const float* embed_norm_b_ = nullptr;
  const float* final_norm_w_ = nullptr;
  const float* final_norm_b_ = nullptr;
  const StoredMatrix* lm_head_ = nullptr;
  std::vector<int32_t> t5_table_;
  std::vector<float> alibi_slopes_;
  int64_t num_parameters_ = 0;
  DType file_dtype_ = DType::kF32;
};

}  // namespace relgen
