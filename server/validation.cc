#include "server/validation.h"

#include <algorithm>

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"

namespace relgen::server {
namespace {

grpc::Status Invalid(absl::string_view field, absl::string_view what) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat(field, ": ", what));
}

// The prompt (Generate) or context (Score), `noun` naming which: text after the model's BOS, or
// token ids.
template <typename Msg>
grpc::Status ToPrompt(const Msg& in, const ModelConfig& c, const Tokenizer& tokenizer, const Options& options,
                      absl::string_view noun, std::vector<int32_t>* out) {
  if (in.has_text()) {
    if (in.text().empty()) return Invalid("text", absl::StrCat("the ", noun, " is empty; give text or token_ids"));
    if (static_cast<int64_t>(in.text().size()) > options.max_prompt_bytes) {
      return Invalid("text", absl::StrCat(in.text().size(), " bytes; allowed at most ", options.max_prompt_bytes,
                                          " (--max_prompt_bytes)"));
    }
    if (c.bos_token_id >= 0 && c.bos_before_text) out->push_back(c.bos_token_id);
    for (int32_t t : tokenizer.Encode(in.text())) out->push_back(t);
  } else if (in.has_token_ids()) {
    if (in.token_ids().ids().empty()) return Invalid("token_ids", absl::StrCat("the ", noun, " is empty"));
    for (int i = 0; i < in.token_ids().ids_size(); ++i) {
      const int32_t t = in.token_ids().ids(i);
      if (t < 0 || t >= c.vocab_size) {
        return Invalid("token_ids", absl::StrCat("ids[", i, "] = ", t, "; allowed 0..", c.vocab_size - 1));
      }
    }
    out->assign(in.token_ids().ids().begin(), in.token_ids().ids().end());
  } else {
    return Invalid(noun, "missing; set text or token_ids");
  }
  return grpc::Status::OK;
}

grpc::Status ToRequestId(const std::string& id, Request* out) {
  if (id.size() > kMaxRequestIdBytes) {
    return Invalid("request_id", absl::StrCat(id.size(), " bytes; allowed at most ", kMaxRequestIdBytes));
  }
  out->id = id;
  return grpc::Status::OK;
}

grpc::Status ToControls(const v1::GenerateRequest& in, const ModelConfig& c, Request* out) {
  SamplingParams& p = out->sampling;
  auto id_range = [&](int32_t t) { return absl::StrCat("; allowed 0..", c.vocab_size - 1); };
  auto in_vocab = [&](int32_t t) { return t >= 0 && t < c.vocab_size; };
  p.presence_penalty = in.has_presence_penalty() ? in.presence_penalty() : 0.0f;
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return Invalid("presence_penalty", absl::StrCat(p.presence_penalty, "; allowed -2..2 (0 = off)"));
  }
  p.frequency_penalty = in.has_frequency_penalty() ? in.frequency_penalty() : 0.0f;
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return Invalid("frequency_penalty", absl::StrCat(p.frequency_penalty, "; allowed -2..2 (0 = off)"));
  }
  p.min_p = in.has_min_p() ? in.min_p() : 0.0f;
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return Invalid("min_p", absl::StrCat(p.min_p, "; allowed 0..1 (0 = off)"));
  p.min_tokens = in.has_min_tokens() ? in.min_tokens() : 0;
  if (p.min_tokens < 0 || p.min_tokens > out->stop.max_new_tokens) {
    return Invalid("min_tokens", absl::StrCat(p.min_tokens, "; allowed 0..max_new_tokens (", out->stop.max_new_tokens, ")"));
  }
  if (in.logit_bias_size() > kMaxLogitBias) {
    return Invalid("logit_bias", absl::StrCat(in.logit_bias_size(), " entries; allowed at most ", kMaxLogitBias));
  }
  for (const auto& [t, b] : in.logit_bias()) {
    if (!in_vocab(t)) return Invalid("logit_bias", absl::StrCat("token id ", t, id_range(t)));
    if (!(b >= -100.0f && b <= 100.0f)) {
      return Invalid("logit_bias", absl::StrCat("the bias of token ", t, " is ", b, "; allowed -100..100"));
    }
    p.logit_bias.emplace_back(t, b);
  }
  for (int i = 0; i < in.allowed_token_ids_size(); ++i) {
    const int32_t t = in.allowed_token_ids(i);
    if (!in_vocab(t)) return Invalid("allowed_token_ids", absl::StrCat("allowed_token_ids[", i, "] = ", t, id_range(t)));
    p.allowed_token_ids.push_back(t);
  }
  std::sort(p.allowed_token_ids.begin(), p.allowed_token_ids.end());
  p.allowed_token_ids.erase(std::unique(p.allowed_token_ids.begin(), p.allowed_token_ids.end()), p.allowed_token_ids.end());
  if (p.allowed_token_ids.size() > kMaxAllowedTokens) {
    return Invalid("allowed_token_ids",
                   absl::StrCat(p.allowed_token_ids.size(), " distinct ids; allowed at most ", kMaxAllowedTokens));
  }
  if (in.bad_words_size() > kMaxBadWords) {
    return Invalid("bad_words", absl::StrCat(in.bad_words_size(), " words; allowed at most ", kMaxBadWords));
  }
  int words = 0;
  for (int i = 0; i < in.bad_words_size(); ++i) {
    const auto& w = in.bad_words(i).ids();
    if (w.empty()) return Invalid("bad_words", absl::StrCat("bad_words[", i, "] is empty; each word needs 1 or more ids"));
    for (int32_t t : w) {
      if (!in_vocab(t)) return Invalid("bad_words", absl::StrCat("bad_words[", i, "] holds ", t, id_range(t)));
    }
    words += w.size();
    p.bad_words.emplace_back(w.begin(), w.end());
  }
  if (words > kMaxBadWordTokens) {
    return Invalid("bad_words", absl::StrCat(words, " tokens in all; allowed at most ", kMaxBadWordTokens));
  }
  p.no_repeat_ngram_size = in.has_no_repeat_ngram_size() ? in.no_repeat_ngram_size() : 0;
  if (p.no_repeat_ngram_size < 0 || p.no_repeat_ngram_size > kMaxNoRepeatNgram) {
    return Invalid("no_repeat_ngram_size",
                   absl::StrCat(p.no_repeat_ngram_size, "; allowed 0..", kMaxNoRepeatNgram, " (0 = off)"));
  }
  out->skip_special_tokens = !in.has_skip_special_tokens() || in.skip_special_tokens();
  return grpc::Status::OK;
}

}  // namespace

grpc::Status ToEngineRequest(const v1::GenerateRequest& in, const ModelConfig& c,
                             const Tokenizer& tokenizer, const Options& options, Request* out) {
  if (grpc::Status s = ToRequestId(in.request_id(), out); !s.ok()) return s;
  if (grpc::Status s = ToPrompt(in, c, tokenizer, options, "prompt", &out->prompt); !s.ok()) return s;
  if (in.has_truncate_prompt_tokens()) {
    const int keep = in.truncate_prompt_tokens();
    if (keep < 0 || keep > c.max_seq_len) {
      return Invalid("truncate_prompt_tokens", absl::StrCat(keep, "; allowed 0..", c.max_seq_len, " (0 = off)"));
    }
    if (keep > 0 && static_cast<int>(out->prompt.size()) > keep) {
      out->prompt.erase(out->prompt.begin(), out->prompt.end() - keep);
    }
  }
  const int n = static_cast<int>(out->prompt.size());
  if (c.encoder_decoder && n > c.max_seq_len) {
    return Invalid(in.has_text() ? "text" : "token_ids",
                   absl::StrCat("the input is ", n, " tokens; the model's encoder takes at most ", c.max_seq_len));
  }
  if (!c.encoder_decoder && n >= c.max_seq_len) {
    return Invalid(in.has_text() ? "text" : "token_ids",
                   absl::StrCat("the prompt is ", n, " tokens; the model's context is ", c.max_seq_len,
                                " tokens, so at most ", c.max_seq_len - 1, " prompt tokens"));
  }
  const int max_new = in.has_max_new_tokens() ? in.max_new_tokens() : options.default_max_new_tokens;
  if (max_new < 1 || max_new > options.max_new_tokens) {
    return Invalid("max_new_tokens", absl::StrCat(max_new, "; allowed 1..", options.max_new_tokens));
  }
  if (c.encoder_decoder && max_new > c.max_seq_len) {
    return Invalid("max_new_tokens", absl::StrCat(max_new, " exceeds the model's decoder context of ", c.max_seq_len,
                                                  " tokens; allowed 1..", c.max_seq_len));
  }
  if (!c.encoder_decoder && n + max_new > c.max_seq_len) {
    return Invalid("max_new_tokens", absl::StrCat(max_new, " after a prompt of ", n, " tokens exceeds the model's context of ",
                                                  c.max_seq_len, " tokens; allowed 1..", c.max_seq_len - n));
  }
  out->stop.max_new_tokens = max_new;

  SamplingParams& p = out->sampling;
  p.temperature = in.has_temperature() ? in.temperature() : 1.0f;
  if (!(p.temperature >= 0.0f && p.temperature <= 100.0f)) {
    return Invalid("temperature", absl::StrCat(p.temperature, "; allowed 0..100 (0 = greedy)"));
  }
  p.top_k = in.has_top_k() ? in.top_k() : 0;
  if (p.top_k < 0 || p.top_k > c.vocab_size) {
    return Invalid("top_k", absl::StrCat(p.top_k, "; allowed 0..", c.vocab_size, " (0 = off)"));
  }
  p.top_p = in.has_top_p() ? in.top_p() : 1.0f;
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return Invalid("top_p", absl::StrCat(p.top_p, "; allowed (0, 1]"));
  p.repetition_penalty = in.has_repetition_penalty() ? in.repetition_penalty() : 1.0f;
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= 10.0f)) {
    return Invalid("repetition_penalty", absl::StrCat(p.repetition_penalty, "; allowed (0, 10] (1 = off)"));
  }
  if (in.has_seed()) {
    p.seed = in.seed();
  } else {
    static thread_local std::mt19937_64 rng(std::random_device{}());
    p.seed = rng();
  }
  if (in.has_logprobs()) {
    if (in.logprobs() < 0 || in.logprobs() > kMaxLogprobs) {
      return Invalid("logprobs", absl::StrCat(in.logprobs(), "; allowed 0..", kMaxLogprobs));
    }
    p.logprobs = in.logprobs();
  }
  if (in.stop_size() > kMaxStopStrings) {
    return Invalid("stop", absl::StrCat(in.stop_size(), " strings; allowed at most ", kMaxStopStrings));
  }
  for (int i = 0; i < in.stop_size(); ++i) {
    const size_t len = in.stop(i).size();
    if (len < 1 || len > kMaxStopStringBytes) {
      return Invalid("stop", absl::StrCat("stop[", i, "] is ", len, " bytes; allowed 1..", kMaxStopStringBytes));
    }
    out->stop.stop_strings.push_back(in.stop(i));
  }
  if (in.stop_token_ids_size() > kMaxStopTokenIds) {
    return Invalid("stop_token_ids", absl::StrCat(in.stop_token_ids_size(), " ids; allowed at most ", kMaxStopTokenIds));
  }
  for (int i = 0; i < in.stop_token_ids_size(); ++i) {
    const int32_t t = in.stop_token_ids(i);
    if (t < 0 || t >= c.vocab_size) {
      return Invalid("stop_token_ids", absl::StrCat("stop_token_ids[", i, "] = ", t, "; allowed 0..", c.vocab_size - 1));
    }
    out->stop.stop_token_ids.push_back(t);
  }
  out->stop.ignore_eos = in.ignore_eos();
  out->n = in.has_n() ? in.n() : 1;
  if (out->n < 1 || out->n > kMaxSamples) {
    return Invalid("n", absl::StrCat(out->n, " samples; allowed 1..", kMaxSamples));
  }
  out->num_beams = in.has_num_beams() ? in.num_beams() : 1;
  if (out->num_beams < 1 || out->num_beams > kMaxBeams) {
    return Invalid("num_beams", absl::StrCat(out->num_beams, "; allowed 1..", kMaxBeams));
  }
  out->num_return_sequences = in.has_num_return_sequences() ? in.num_return_sequences() : 1;
  if (out->num_return_sequences < 1 || out->num_return_sequences > out->num_beams) {
    return Invalid("num_return_sequences",
                   absl::StrCat(out->num_return_sequences, "; allowed 1..num_beams (", out->num_beams, ")"));
  }
  out->length_penalty = in.has_length_penalty() ? in.length_penalty() : 1.0f;
  if (!(out->length_penalty >= -100.0f && out->length_penalty <= 100.0f)) {
    return Invalid("length_penalty", absl::StrCat(out->length_penalty, "; allowed -100..100"));
  }
  switch (in.early_stopping()) {
    case v1::EARLY_STOPPING_FALSE: out->early_stopping = EarlyStopping::kFalse; break;
    case v1::EARLY_STOPPING_TRUE: out->early_stopping = EarlyStopping::kTrue; break;
    case v1::EARLY_STOPPING_NEVER: out->early_stopping = EarlyStopping::kNever; break;
    default: return Invalid("early_stopping", absl::StrCat(in.early_stopping(), "; allowed FALSE, TRUE, NEVER"));
  }
  if (out->num_beams > 1) {
    // What beam search leaves out, each named (the engine checks the rest).
    const char* conflict = out->n > 1 ? "n" : in.has_logprobs() ? "logprobs" : in.has_prompt_logprobs() ? "prompt_logprobs"
                         : in.stop_size() > 0 ? "stop" : in.stop_token_ids_size() > 0 ? "stop_token_ids"
                         : in.has_repetition_penalty() && in.repetition_penalty() != 1.0f ? "repetition_penalty"
                         : in.has_presence_penalty() && in.presence_penalty() != 0.0f ? "presence_penalty"
                         : in.has_frequency_penalty() && in.frequency_penalty() != 0.0f ? "frequency_penalty" : nullptr;
    if (conflict != nullptr) {
      return Invalid(conflict, absl::StrCat("not with num_beams > 1 (", out->num_beams,
                                            "); beam search returns num_return_sequences sequences, ends a beam at "
                                            "the end-of-sequence token or max_new_tokens, and applies the controls "
                                            "that ban or bias tokens"));
    }
  }
  if (in.has_prompt_logprobs()) {
    if (in.prompt_logprobs() < 0 || in.prompt_logprobs() > kMaxPromptLogprobs) {
      return Invalid("prompt_logprobs", absl::StrCat(in.prompt_logprobs(), "; allowed 0..", kMaxPromptLogprobs));
    }
    if (c.encoder_decoder) {
      // The encoder's input is read, not predicted: there is nothing to score.
      return Invalid("prompt_logprobs", absl::StrCat("the model is encoder-decoder (", c.architecture,
                                                     "): its input has no log-probabilities; allowed on decoder "
                                                     "models only (leave it unset)"));
    }
    out->prompt_logprobs = in.prompt_logprobs();
  }
  return ToControls(in, c, out);
}

grpc::Status ToEngineRequest(const v1::ScoreRequest& in, const ModelConfig& c, const Tokenizer& tokenizer,
                             const Options& options, Request* out) {
  if (grpc::Status s = ToRequestId(in.request_id(), out); !s.ok()) return s;
  if (grpc::Status s = ToPrompt(in, c, tokenizer, options, "context", &out->prompt); !s.ok()) return s;
  const int n = static_cast<int>(out->prompt.size());
  const char* const context_field = in.has_text() ? "text" : "token_ids";
  if (c.encoder_decoder && n > c.max_seq_len) {
    return Invalid(context_field,
                   absl::StrCat("the context is ", n, " tokens; the model's encoder takes at most ", c.max_seq_len));
  }
  if (!c.encoder_decoder && n >= c.max_seq_len) {
    return Invalid(context_field, absl::StrCat("the context is ", n, " tokens; the model's context is ", c.max_seq_len,
                                               " tokens, so at most ", c.max_seq_len - 1,
                                               " context tokens (a continuation needs one)"));
  }
  const int k = in.continuations_size();
  if (k < 1 || k > kMaxContinuations) {
    return Invalid("continuations", absl::StrCat(k, " continuations; allowed 1..", kMaxContinuations));
  }
  out->continuations.resize(k);
  for (int i = 0; i < k; ++i) {
    const v1::Continuation& cont = in.continuations(i);
    std::vector<int32_t>& ids = out->continuations[i];
    const std::string name = absl::StrCat("continuations[", i, "]");
    if (cont.has_text()) {
      if (static_cast<int64_t>(cont.text().size()) > options.max_prompt_bytes) {
        return Invalid("continuations", absl::StrCat(name, " is ", cont.text().size(), " bytes; allowed at most ",
                                                     options.max_prompt_bytes, " (--max_prompt_bytes)"));
      }
      ids = tokenizer.Encode(cont.text());
      // Scored after the context, so a BOS the tokenizer puts before every text does not belong.
      if (!c.encoder_decoder && c.bos_token_id >= 0 && !ids.empty() && ids[0] == c.bos_token_id) {
        ids.erase(ids.begin());
      }
    } else if (cont.has_token_ids()) {
      for (int j = 0; j < cont.token_ids().ids_size(); ++j) {
        const int32_t t = cont.token_ids().ids(j);
        if (t < 0 || t >= c.vocab_size) {
          return Invalid("continuations", absl::StrCat(name, ".token_ids: ids[", j, "] = ", t, "; allowed 0..",
                                                       c.vocab_size - 1));
        }
      }
      ids.assign(cont.token_ids().ids().begin(), cont.token_ids().ids().end());
    }
    const int m = static_cast<int>(ids.size());
    if (m == 0) {
      return Invalid("continuations", absl::StrCat(name, " is empty; each continuation needs at least one token "
                                                         "(set text or token_ids)"));
    }
    // The decoder's context holds decoder_start_token_id before the continuation.
    if (c.encoder_decoder && m > c.max_seq_len - 1) {
      return Invalid("continuations", absl::StrCat(name, " is ", m, " tokens; the model's decoder takes at most ",
                                                   c.max_seq_len - 1, " after its start token"));
    }
    if (!c.encoder_decoder && n + m > c.max_seq_len) {
      return Invalid("continuations", absl::StrCat(name, " is ", m, " tokens after a context of ", n,
                                                   " tokens: together over the model's context of ", c.max_seq_len,
                                                   " tokens; allowed at most ", c.max_seq_len - n,
                                                   " continuation tokens after this context"));
    }
  }
  out->sampling.logprobs = in.has_top_logprobs() ? in.top_logprobs() : 0;
  if (out->sampling.logprobs < 0 || out->sampling.logprobs > kMaxLogprobs) {
    return Invalid("top_logprobs", absl::StrCat(out->sampling.logprobs, "; allowed 0..", kMaxLogprobs));
  }
  out->sampling.temperature = 0.0f;  // nothing is sampled
  out->stop.max_new_tokens = 1;      // unused when scoring; kept inside every limit
  return grpc::Status::OK;
}

}  // namespace relgen::server
