// Model configuration: the parsed and validated `config.json` of a model directory.
// Every key is documented in docs/model-format.md.
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "kernels/activation.h"
#include "kernels/relpos.h"

namespace relgen {

enum class NormKind { kLayerNorm, kRmsNorm };
enum class NormPlacement { kPre, kPost };
enum class TokenizerKind { kByte, kSentencePiece, kBpe, kWord };

struct RelativeConfig {
  relpos::Scheme scheme = relpos::Scheme::kNone;
  int max_relative_position = 0;  // skew, skew_local: rows M of E (distances 0..M-1)
  int block_length = 0;           // skew_local
  int clip = 0;                   // shaw: k
  bool relative_values = false;   // shaw
  int num_buckets = 32;           // t5
  int max_distance = 128;         // t5
  bool bidirectional = false;     // t5
  bool heads_share_table = false;
  bool share_across_layers = false;
  bool scale_with_qk = true;
  float alibi_bias_max = 8.0f;    // alibi: slopes 2^(-alibi_bias_max * h / heads) (relpos_host.h)
};

struct ModelConfig {
  std::string name;
  // Where the model came from: "relgen" (docs/model-format.md) or "hf:<model_type>" (docs/models.md),
  // and the architecture it maps ("decoder", "bloom", "mpt"). Reporting only: the math is below.
  std::string source = "relgen";
  std::string architecture = "decoder";
  int vocab_size = 0;
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int head_dim = 0;
  int ffn_dim = 0;
  Activation ffn_activation = Activation::kGelu;
  bool ffn_gated = false;
  NormKind norm = NormKind::kLayerNorm;
  NormPlacement norm_placement = NormPlacement::kPre;
  float norm_eps = 1e-5f;
  bool norm_bias = true;        // layernorm: norms carry a bias
  bool embedding_norm = false;  // a norm right after the embedding (BLOOM's word_embeddings_layernorm)
  bool linear_bias = true;
  bool tie_embeddings = false;
  float embedding_scale = 1.0f;
  float attention_scale = 0.0f;  // multiplies QK^T; 1/sqrt(head_dim) unless the config sets it
  int max_seq_len = 0;
  int bos_token_id = -1;  // -1: none
  int eos_token_id = -1;
  int pad_token_id = -1;
  // Text prompts start with bos_token_id (relgen's format). A Hugging Face tokenizer adds its own
  // special tokens (its post-processor), so its checkpoints leave this false.
  bool bos_before_text = true;
  TokenizerKind tokenizer = TokenizerKind::kByte;
  std::string tokenizer_file;  // relative to the model directory (sentencepiece, bpe, word)
  // SentencePiece as T5 uses it: sentinel tokens <extra_id_0..N-1> on the ids right above the
  // model's pieces (extra_id_0 highest), and eos_token_id after every encoded text.
  int tokenizer_extra_ids = 0;
  bool tokenizer_append_eos = false;
  RelativeConfig rel;
  // Encoder-decoder (T5): a request's tokens are the encoder's input, encoded once with
  // bidirectional self-attention (rel's buckets, both directions); the decoder starts from
  // decoder_start_token_id and its layers add cross-attention over the encoder output. Encoder
  // layers have the decoder's shapes. max_seq_len bounds the input and the output each.
  bool encoder_decoder = false;
  int n_encoder_layers = 0;
  int decoder_start_token_id = -1;
  float lm_head_input_scale = 1.0f;  // multiplies the final hidden state (tied T5: d_model^-0.5)

  int qkv_width() const { return n_heads * head_dim; }
  // Heads that own a relative table: 1 when they share it.
  int rel_table_heads() const { return rel.heads_share_table ? 1 : n_heads; }
};

// Parses and validates config.json text. Errors name the key, what was found and what is allowed.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text);
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

absl::string_view SchemeName(relpos::Scheme scheme);

}  // namespace relgen
