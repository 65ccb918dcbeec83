// Request validation of arbitrary bytes read as a GenerateRequest and as a ScoreRequest, the
// server's mapping and then the engine's checks: either INVALID_ARGUMENT naming the field
// ("field: what; allowed ...", the field its payload), or an engine request inside every limit.
#include <cstddef>
#include <cstdint>

#include "engine/tokenizers/tokenizer.h"
#include "server/validation.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

const relgen::RequestLimits kLimits = [] {
  relgen::RequestLimits l;
  l.max_new_tokens = 40;
  return l;
}();

// The server's mapping, then the engine's checks (a cache that holds any request the model's
// context does) and what the engine does to a checked request.
bool Accepted(const absl::Status& mapped, const relgen::ModelConfig& config, relgen::Request* out) {
  absl::Status s = mapped;
  if (s.ok()) s = relgen::CheckRequest(*out, config, kLimits, relgen::KvCapacity{1 << 20, 16});
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    const std::string field = relgen::ErrorField(s);
    FUZZ_CHECK(!field.empty());
    FUZZ_CHECK(s.message().substr(0, field.size() + 2) == field + ": ");
    return false;
  }
  relgen::TruncatePrompt(out);
  relgen::PrepareControls(out, config.eos_token_id);
  return true;
}

relgen::ModelConfig Config() {
  relgen::ModelConfig c;
  c.vocab_size = 260;
  c.max_seq_len = 64;
  c.bos_token_id = 256;
  c.eos_token_id = 257;
  return c;
}

void CheckScore(const relgen::v1::ScoreRequest& req, const relgen::ModelConfig& config, const relgen::Tokenizer& tokenizer,
                const relgen::server::Options& options) {
  relgen::Request out;
  if (!Accepted(relgen::server::ToEngineRequest(req, config, tokenizer, options, kLimits, &out), config, &out)) return;
  const int n = static_cast<int>(out.prompt.size());
  FUZZ_CHECK(n >= 1 && n < config.max_seq_len);
  for (int32_t t : out.prompt) FUZZ_CHECK(t >= 0 && t < config.vocab_size);
  FUZZ_CHECK(!out.continuations.empty() && out.continuations.size() <= static_cast<size_t>(relgen::kMaxContinuations));
  for (const auto& c : out.continuations) {
    FUZZ_CHECK(!c.empty() && n + static_cast<int>(c.size()) <= config.max_seq_len);
    for (int32_t t : c) FUZZ_CHECK(t >= 0 && t < config.vocab_size);
  }
  FUZZ_CHECK(out.sampling.logprobs >= 0 && out.sampling.logprobs <= kLimits.max_logprobs);
  FUZZ_CHECK(out.id.size() <= static_cast<size_t>(kLimits.max_request_id_bytes));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const relgen::ModelConfig config = Config();
  static const auto tokenizer = relgen::NewByteTokenizer();
  static const relgen::server::Options options = [] {
    relgen::server::Options o;
    o.default_max_new_tokens = 8;
    o.max_prompt_bytes = 48;
    return o;
  }();
  relgen::v1::ScoreRequest score;
  if (score.ParseFromArray(data, static_cast<int>(size))) CheckScore(score, config, *tokenizer, options);
  relgen::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  relgen::Request out;
  if (!Accepted(relgen::server::ToEngineRequest(req, config, *tokenizer, options, kLimits, &out), config, &out)) {
    return 0;
  }
  const int n = static_cast<int>(out.prompt.size());
  FUZZ_CHECK(n >= 1 && n < config.max_seq_len);
  for (int32_t t : out.prompt) FUZZ_CHECK(t >= 0 && t < config.vocab_size);
  if (req.has_text()) {
    FUZZ_CHECK(static_cast<int64_t>(req.text().size()) <= options.max_prompt_bytes);
    // truncate_prompt_tokens keeps the last tokens: the BOS goes with the rest of the front.
    const bool truncated = req.truncate_prompt_tokens() > 0 && n == req.truncate_prompt_tokens();
    FUZZ_CHECK(truncated || out.prompt[0] == config.bos_token_id);
  }
  // 0 is the prompt alone (its log-probabilities, no token).
  FUZZ_CHECK(out.stop.max_new_tokens >= 0 && out.stop.max_new_tokens <= kLimits.max_new_tokens);
  FUZZ_CHECK(n + out.stop.max_new_tokens <= config.max_seq_len);
  const relgen::SamplingParams& p = out.sampling;
  FUZZ_CHECK(p.temperature >= 0 && p.temperature <= 100);
  FUZZ_CHECK(p.top_k >= 0 && p.top_k <= config.vocab_size);
  FUZZ_CHECK(p.top_p > 0 && p.top_p <= 1);
  FUZZ_CHECK(p.repetition_penalty > 0 && p.repetition_penalty <= 10);
  FUZZ_CHECK(p.logprobs <= kLimits.max_logprobs);
  FUZZ_CHECK(out.stop.stop_strings.size() <= static_cast<size_t>(kLimits.max_stop_strings));
  for (const std::string& st : out.stop.stop_strings) {
    FUZZ_CHECK(!st.empty() && st.size() <= static_cast<size_t>(kLimits.max_stop_string_bytes));
  }
  FUZZ_CHECK(out.stop.stop_token_ids.size() <= static_cast<size_t>(kLimits.max_stop_token_ids));
  for (int32_t t : out.stop.stop_token_ids) FUZZ_CHECK(t >= 0 && t < config.vocab_size);
  FUZZ_CHECK(out.id.size() <= static_cast<size_t>(kLimits.max_request_id_bytes));
  FUZZ_CHECK(out.n >= 1 && out.n <= relgen::kMaxSamples);
  FUZZ_CHECK(out.prompt_logprobs >= -1 && out.prompt_logprobs <= kLimits.max_logprobs);
  FUZZ_CHECK(out.continuations.empty());
  if (req.truncate_prompt_tokens() > 0) FUZZ_CHECK(n <= req.truncate_prompt_tokens());
  FUZZ_CHECK(p.presence_penalty >= -2 && p.presence_penalty <= 2);
  FUZZ_CHECK(p.frequency_penalty >= -2 && p.frequency_penalty <= 2);
  FUZZ_CHECK(p.min_p >= 0 && p.min_p <= 1);
  FUZZ_CHECK(p.min_tokens >= 0 && p.min_tokens <= out.stop.max_new_tokens);
  FUZZ_CHECK(p.no_repeat_ngram_size >= 0 && p.no_repeat_ngram_size <= relgen::kMaxNoRepeatNgram);
  FUZZ_CHECK(p.logit_bias.size() <= static_cast<size_t>(relgen::kMaxLogitBias));
  for (const auto& [t, b] : p.logit_bias) FUZZ_CHECK(t >= 0 && t < config.vocab_size && b >= -100 && b <= 100);
  FUZZ_CHECK(p.allowed_token_ids.size() <= static_cast<size_t>(relgen::kMaxAllowedTokens));
  for (int32_t t : p.allowed_token_ids) FUZZ_CHECK(t >= 0 && t < config.vocab_size);
  size_t words = 0;
  for (const auto& w : p.bad_words) {
    FUZZ_CHECK(!w.empty());
    for (int32_t t : w) FUZZ_CHECK(t >= 0 && t < config.vocab_size);
    words += w.size();
  }
  FUZZ_CHECK(p.bad_words.size() <= static_cast<size_t>(relgen::kMaxBadWords) &&
             words <= static_cast<size_t>(relgen::kMaxBadWordTokens));
  FUZZ_CHECK(out.num_beams >= 1 && out.num_beams <= relgen::kMaxBeams);
  FUZZ_CHECK(out.num_return_sequences >= 1 && out.num_return_sequences <= out.num_beams);
  FUZZ_CHECK(out.length_penalty >= -100 && out.length_penalty <= 100);
  if (out.num_beams > 1) {
    FUZZ_CHECK(out.n == 1 && out.stop.max_new_tokens >= 1 && p.logprobs < 0 && out.prompt_logprobs < 0 &&
               out.stop.stop_strings.empty() && out.stop.stop_token_ids.empty() && p.repetition_penalty == 1 &&
               p.presence_penalty == 0 && p.frequency_penalty == 0);
  }
  return 0;
}
