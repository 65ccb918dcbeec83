// config.json parsing of arbitrary text: refused with a message naming the problem, or a config
// whose sizes the engine can rely on.
#include <cstddef>
#include <cstdint>

#include "engine/model/config.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto c = relgen::ParseModelConfig(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!c.ok()) {
    FUZZ_CHECK(c.status().message().rfind("config.json: ", 0) == 0);
    return 0;
  }
  FUZZ_CHECK(c->vocab_size > 0 && c->d_model > 0 && c->n_layers > 0 && c->n_heads > 0 && c->head_dim > 0);
  FUZZ_CHECK(c->ffn_dim > 0 && c->max_seq_len > 0);
  FUZZ_CHECK(c->bos_token_id >= -1 && c->bos_token_id < c->vocab_size);
  FUZZ_CHECK(c->eos_token_id >= -1 && c->eos_token_id < c->vocab_size);
  FUZZ_CHECK(c->norm_eps > 0 && c->attention_scale > 0);
  if (c->tokenizer == relgen::TokenizerKind::kByte) FUZZ_CHECK(c->vocab_size >= 256);
  if (c->tokenizer == relgen::TokenizerKind::kSentencePiece) {
    // Resolved inside the model directory: no absolute path and no way out of it.
    FUZZ_CHECK(!c->tokenizer_file.empty() && c->tokenizer_file.find('/') == std::string::npos);
    FUZZ_CHECK(c->tokenizer_file != "..");
  }
  const relgen::RelativeConfig& r = c->rel;
  switch (r.scheme) {
    case relgen::relpos::Scheme::kSkew: FUZZ_CHECK(r.max_relative_position >= 1); break;
    case relgen::relpos::Scheme::kSkewLocal: FUZZ_CHECK(r.block_length >= 1 && r.max_relative_position >= 1); break;
    case relgen::relpos::Scheme::kShaw: FUZZ_CHECK(r.clip >= 1); break;
    case relgen::relpos::Scheme::kT5:
      FUZZ_CHECK(r.num_buckets >= 2 && r.max_distance > (r.bidirectional ? r.num_buckets / 4 : r.num_buckets / 2));
      break;
    default: break;
  }
  return 0;
}
