#include "server/validation.h"

#include <random>

#include "absl/strings/str_cat.h"

namespace relgen::server {
namespace {

absl::Status TextTooLong(absl::string_view field, absl::string_view name, size_t bytes, const Options& options) {
  return FieldError(field, absl::StrCat(name, bytes, " bytes; allowed at most ", options.max_prompt_bytes,
                                        " (--max_prompt_bytes)"));
}

// The prompt (Generate) or context (Score), `noun` naming which: text after the model's BOS, or
// token ids.
template <typename Msg>
absl::Status ToPrompt(const Msg& in, const ModelConfig& c, const Tokenizer& tokenizer, const Options& options,
                      absl::string_view noun, std::vector<int32_t>* out) {
  if (in.has_text()) {
    // An empty text is refused even where the model's BOS would make it a prompt of one token.
    if (in.text().empty()) return FieldError("text", absl::StrCat("the ", noun, " is empty; give text or token_ids"));
    if (static_cast<int64_t>(in.text().size()) > options.max_prompt_bytes) {
      return TextTooLong("text", "", in.text().size(), options);
    }
    if (absl::Status st = tokenizer.Check(in.text()); !st.ok()) return FieldError("text", st.message());
    if (c.bos_token_id >= 0 && c.bos_before_text) out->push_back(c.bos_token_id);
    for (int32_t t : tokenizer.Encode(in.text())) out->push_back(t);
  } else if (in.has_token_ids()) {
    out->assign(in.token_ids().ids().begin(), in.token_ids().ids().end());
  } else {
    return FieldError(noun, "missing; set text or token_ids");
  }
  return absl::OkStatus();
}

absl::Status ToEarlyStopping(v1::EarlyStopping in, EarlyStopping* out) {
  switch (in) {
    case v1::EARLY_STOPPING_FALSE: *out = EarlyStopping::kFalse; return absl::OkStatus();
    case v1::EARLY_STOPPING_TRUE: *out = EarlyStopping::kTrue; return absl::OkStatus();
    case v1::EARLY_STOPPING_NEVER: *out = EarlyStopping::kNever; return absl::OkStatus();
    default: return FieldError("early_stopping", absl::StrCat(in, "; allowed FALSE, TRUE, NEVER"));
  }
}

// The sampling parameters and controls, each unset one at its default.
void ToSampling(const v1::GenerateRequest& in, SamplingParams* p) {
  p->temperature = in.has_temperature() ? in.temperature() : 1.0f;
  p->top_k = in.has_top_k() ? in.top_k() : 0;
  p->top_p = in.has_top_p() ? in.top_p() : 1.0f;
  p->repetition_penalty = in.has_repetition_penalty() ? in.repetition_penalty() : 1.0f;
  if (in.has_seed()) {
    p->seed = in.seed();
  } else {
    static thread_local std::mt19937_64 rng(std::random_device{}());
    p->seed = rng();
  }
  p->presence_penalty = in.has_presence_penalty() ? in.presence_penalty() : 0.0f;
  p->frequency_penalty = in.has_frequency_penalty() ? in.frequency_penalty() : 0.0f;
  p->min_p = in.has_min_p() ? in.min_p() : 0.0f;
  p->min_tokens = in.has_min_tokens() ? in.min_tokens() : 0;
  for (const auto& [t, b] : in.logit_bias()) p->logit_bias.emplace_back(t, b);
  p->allowed_token_ids.assign(in.allowed_token_ids().begin(), in.allowed_token_ids().end());
  for (const auto& w : in.bad_words()) p->bad_words.emplace_back(w.ids().begin(), w.ids().end());
  p->no_repeat_ngram_size = in.has_no_repeat_ngram_size() ? in.no_repeat_ngram_size() : 0;
}

}  // namespace

absl::Status ToEngineRequest(const v1::GenerateRequest& in, const ModelConfig& c, const Tokenizer& tokenizer,
                             const Options& options, const RequestLimits& limits, Request* out) {
  out->id = in.request_id();
  if (absl::Status s = ToPrompt(in, c, tokenizer, options, "prompt", &out->prompt); !s.ok()) return s;
  out->truncate_prompt_tokens = in.truncate_prompt_tokens();
  out->stop.max_new_tokens = in.has_max_new_tokens() ? in.max_new_tokens() : options.default_max_new_tokens;
  ToSampling(in, &out->sampling);
  // Unset means none, so a negative value set is refused rather than read as none.
  if (in.has_logprobs() && in.logprobs() < 0) return LogprobsError("logprobs", in.logprobs(), limits);
  if (in.has_prompt_logprobs() && in.prompt_logprobs() < 0) {
    return LogprobsError("prompt_logprobs", in.prompt_logprobs(), limits);
  }
  if (in.has_logprobs()) out->sampling.logprobs = in.logprobs();
  if (in.has_prompt_logprobs()) out->prompt_logprobs = in.prompt_logprobs();
  out->stop.stop_strings.assign(in.stop().begin(), in.stop().end());
  out->stop.stop_token_ids.assign(in.stop_token_ids().begin(), in.stop_token_ids().end());
  out->stop.ignore_eos = in.ignore_eos();
  out->n = in.has_n() ? in.n() : 1;
  out->num_beams = in.has_num_beams() ? in.num_beams() : 1;
  out->num_return_sequences = in.has_num_return_sequences() ? in.num_return_sequences() : 1;
  out->length_penalty = in.has_length_penalty() ? in.length_penalty() : 1.0f;
  out->skip_special_tokens = !in.has_skip_special_tokens() || in.skip_special_tokens();
  out->adapter = in.adapter();
  return ToEarlyStopping(in.early_stopping(), &out->early_stopping);
}

absl::Status ToEngineRequest(const v1::ScoreRequest& in, const ModelConfig& c, const Tokenizer& tokenizer,
                             const Options& options, const RequestLimits& limits, Request* out) {
  out->id = in.request_id();
  out->adapter = in.adapter();
  if (absl::Status s = ToPrompt(in, c, tokenizer, options, "context", &out->prompt); !s.ok()) return s;
  // No continuation would make it a request to generate.
  if (in.continuations_size() == 0) {
    return FieldError("continuations", absl::StrCat("0 continuations; allowed 1..", kMaxContinuations));
  }
  for (int i = 0; i < in.continuations_size(); ++i) {
    const v1::Continuation& cont = in.continuations(i);
    std::vector<int32_t>& ids = out->continuations.emplace_back();
    if (cont.has_text()) {
      if (static_cast<int64_t>(cont.text().size()) > options.max_prompt_bytes) {
        return TextTooLong("continuations", absl::StrCat("continuations[", i, "] is "), cont.text().size(), options);
      }
      if (absl::Status st = tokenizer.Check(cont.text()); !st.ok()) {
        return FieldError("continuations", absl::StrCat("continuations[", i, "]: ", st.message()));
      }
      ids = tokenizer.Encode(cont.text());
      // Scored after the context, so a BOS the tokenizer puts before every text does not belong.
      if (!c.encoder_decoder && c.bos_token_id >= 0 && !ids.empty() && ids[0] == c.bos_token_id) {
        ids.erase(ids.begin());
      }
    } else if (cont.has_token_ids()) {
      ids.assign(cont.token_ids().ids().begin(), cont.token_ids().ids().end());
    }
  }
  if (in.has_top_logprobs() && in.top_logprobs() < 0) return LogprobsError("top_logprobs", in.top_logprobs(), limits);
  out->sampling.logprobs = in.has_top_logprobs() ? in.top_logprobs() : 0;
  out->sampling.temperature = 0.0f;  // nothing is sampled
  out->stop.max_new_tokens = 1;      // unused when scoring; kept inside every limit
  return absl::OkStatus();
}

}  // namespace relgen::server
