#include "engine/core/request_checks.h"

#include <algorithm>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "engine/backends/kv_pool.h"
#include "engine/core/request.h"
#include "engine/model/config.h"

namespace relgen {
namespace {

// The payload's key: a type URL, as absl::Status wants one.
constexpr absl::string_view kFieldPayload = "type.googleapis.com/relgen.v1.FieldError";

bool InVocab(int32_t t, const ModelConfig& c) { return t >= 0 && t < c.vocab_size; }
std::string IdAllowed(const ModelConfig& c) { return absl::StrCat("; allowed 0..", c.vocab_size - 1); }
bool InRange(float v, float lo, float hi) { return v >= lo && v <= hi; }  // false for NaN

// The prompt's tokens as kept (truncate_prompt_tokens).
int KeptTokens(const Request& r) {
  const int n = static_cast<int>(r.prompt.size());
  return r.truncate_prompt_tokens > 0 ? std::min(n, r.truncate_prompt_tokens) : n;
}

// The KV cache's size in tokens, for the messages.
int64_t PoolTokens(const KvCapacity& kv) { return int64_t{kv.num_blocks} * kv.block_size; }

absl::Status CheckPrompt(const Request& r, const ModelConfig& c, bool scoring) {
  const char* const noun = scoring ? "context" : "prompt";
  const int m = c.max_seq_len;
  if (r.truncate_prompt_tokens < 0 || r.truncate_prompt_tokens > m) {
    return FieldError("truncate_prompt_tokens", absl::StrCat(r.truncate_prompt_tokens, "; allowed 0..", m, " (0 = off)"));
  }
  if (r.prompt.empty()) return FieldError(noun, "empty; allowed 1 or more tokens");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (!InVocab(r.prompt[i], c)) return FieldError(noun, absl::StrCat("ids[", i, "] = ", r.prompt[i], IdAllowed(c)));
  }
  const int n = KeptTokens(r);
  if (c.encoder_decoder && n > m) {
    return FieldError(noun, absl::StrCat("the input is ", n, " tokens; the model's encoder takes at most ", m));
  }
  if (!c.encoder_decoder && n >= m) {
    return FieldError(noun, absl::StrCat("the ", noun, " is ", n, " tokens; the model's context is ", m,
                                         " tokens, so at most ", m - 1, " ", noun, " tokens",
                                         scoring ? " (a continuation needs one)" : ""));
  }
  return absl::OkStatus();
}

// Generating: max_new_tokens within the served limit, the model's context and the KV cache.
absl::Status CheckLength(const Request& r, const ModelConfig& c, const RequestLimits& limits, const KvCapacity& kv) {
  const int n = KeptTokens(r), m = r.stop.max_new_tokens, ctx = c.max_seq_len;
  // 0 is the prompt alone: its log-probabilities (prompt_logprobs) and no new token.
  if (m < 0 || m > limits.max_new_tokens) {
    return FieldError("max_new_tokens", absl::StrCat(m, "; allowed 0..", limits.max_new_tokens));
  }
  // An encoder-decoder model's input and output have a context each; the last output token is
  // never fed back.
  if (c.encoder_decoder && m > ctx) {
    return FieldError("max_new_tokens", absl::StrCat(m, " exceeds the model's decoder context of ", ctx,
                                                     " tokens; allowed 0..", ctx));
  }
  if (!c.encoder_decoder && n + m > ctx) {
    return FieldError("max_new_tokens", absl::StrCat(m, " after a prompt of ", n, " tokens exceeds the model's context of ",
                                                     ctx, " tokens; allowed 0..", ctx - n));
  }
  const int bs = kv.block_size;
  const int need = c.encoder_decoder ? BlocksForTokens(n, bs) + BlocksForTokens(m, bs) : BlocksForTokens(n + m, bs);
  if (need <= kv.num_blocks) return absl::OkStatus();
  // What max_new_tokens could be with this prompt, or, if none, how short the prompt must be.
  const int64_t pool = PoolTokens(kv);
  const int64_t room = c.encoder_decoder ? pool - int64_t{BlocksForTokens(n, bs)} * bs : pool - n;
  const char* const prompt = c.encoder_decoder ? "input" : "prompt";
  return FieldError(room >= 1 ? "max_new_tokens" : "prompt",
                    absl::StrCat(prompt, " (", n, " tokens) + max_new_tokens (", m, ") = ", n + m,
                                 " tokens can never fit the KV cache of ", pool, " tokens; ",
                                 room >= 1 ? absl::StrCat("set max_new_tokens to at most ", room, " or shorten the ", prompt)
                                           : absl::StrCat("shorten the ", prompt, " to under ",
                                                          c.encoder_decoder ? pool - bs : pool, " tokens"),
                                 ", or start the server with a larger --kv_cache_tokens"));
}

absl::Status CheckContinuation(const Request& r, size_t i, const ModelConfig& c, const KvCapacity& kv) {
  const std::vector<int32_t>& cont = r.continuations[i];
  const std::string name = absl::StrCat("continuations[", i, "]");
  const int n = KeptTokens(r), k = static_cast<int>(cont.size()), ctx = c.max_seq_len;
  if (cont.empty()) {
    return FieldError("continuations", absl::StrCat(name, " is empty; each continuation needs at least one token "
                                                          "(set text or token_ids)"));
  }
  for (size_t j = 0; j < cont.size(); ++j) {
    if (!InVocab(cont[j], c)) {
      return FieldError("continuations", absl::StrCat(name, ": ids[", j, "] = ", cont[j], IdAllowed(c)));
    }
  }
  // The decoder's context holds decoder_start_token_id before the continuation.
  if (c.encoder_decoder && k > ctx - 1) {
    return FieldError("continuations", absl::StrCat(name, " is ", k, " tokens; the model's decoder takes at most ",
                                                    ctx - 1, " after its start token"));
  }
  if (!c.encoder_decoder && n + k > ctx) {
    return FieldError("continuations", absl::StrCat(name, " is ", k, " tokens after a context of ", n,
                                                    " tokens: together over the model's context of ", ctx,
                                                    " tokens; allowed at most ", ctx - n,
                                                    " continuation tokens after this context"));
  }
  const int bs = kv.block_size;
  const int len = k + (c.encoder_decoder ? 1 : n);
  const int need = BlocksForTokens(len, bs) + (c.encoder_decoder ? BlocksForTokens(n, bs) : 0);
  if (need <= kv.num_blocks) return absl::OkStatus();
  const int64_t pool = PoolTokens(kv);
  const int64_t room = c.encoder_decoder ? pool - int64_t{BlocksForTokens(n, bs)} * bs - 1 : pool - n;
  return FieldError("continuations",
                    absl::StrCat(name, ": ", len, " tokens can never fit the KV cache of ", pool, " tokens; ",
                                 room > 0 ? absl::StrCat("shorten ", name, " to at most ", room, " tokens")
                                          : absl::StrCat("shorten the ", c.encoder_decoder ? "input" : "context",
                                                         " to under ", c.encoder_decoder ? pool / 2 : pool, " tokens"),
                                 ", or start the server with a larger --kv_cache_tokens"));
}

// Scoring: the continuations, and what does not apply to it.
absl::Status CheckScoring(const Request& r, const ModelConfig& c, const KvCapacity& kv) {
  if (r.continuations.size() > static_cast<size_t>(kMaxContinuations)) {
    return FieldError("continuations",
                      absl::StrCat(r.continuations.size(), " continuations; allowed 1..", kMaxContinuations));
  }
  if (r.n != 1) return FieldError("n", absl::StrCat(r.n, "; allowed 1 when scoring (a score per continuation)"));
  if (r.prompt_logprobs >= 0) {
    return FieldError("prompt_logprobs", absl::StrCat(r.prompt_logprobs, "; not when scoring (leave it unset)"));
  }
  for (size_t i = 0; i < r.continuations.size(); ++i) {
    if (absl::Status st = CheckContinuation(r, i, c, kv); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status CheckSampling(const Request& r, const ModelConfig& c, const RequestLimits& limits, bool scoring) {
  const SamplingParams& p = r.sampling;
  if (!InRange(p.temperature, 0.0f, 100.0f)) {
    return FieldError("temperature", absl::StrCat(p.temperature, "; allowed 0..100 (0 = greedy)"));
  }
  if (p.top_k < 0 || p.top_k > c.vocab_size) {
    return FieldError("top_k", absl::StrCat(p.top_k, "; allowed 0..", c.vocab_size, " (0 = off)"));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return FieldError("top_p", absl::StrCat(p.top_p, "; allowed (0, 1]"));
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= 10.0f)) {
    return FieldError("repetition_penalty", absl::StrCat(p.repetition_penalty, "; allowed (0, 10] (1 = off)"));
  }
  // -1: none (an API leaves it unset).
  if (p.logprobs < -1 || p.logprobs > limits.max_logprobs) {
    return LogprobsError(scoring ? "top_logprobs" : "logprobs", p.logprobs, limits);
  }
  if (r.prompt_logprobs < -1 || r.prompt_logprobs > limits.max_logprobs) {
    return LogprobsError("prompt_logprobs", r.prompt_logprobs, limits);
  }
  if (r.prompt_logprobs >= 0 && c.encoder_decoder) {
    // The encoder's input is read, not predicted: there is nothing to score.
    return FieldError("prompt_logprobs", absl::StrCat("the model is encoder-decoder (", c.architecture,
                                                      "): its input has no log-probabilities; allowed on decoder "
                                                      "models only (leave it unset)"));
  }
  return absl::OkStatus();
}

absl::Status CheckStops(const StopCriteria& stop, const ModelConfig& c, const RequestLimits& limits) {
  if (stop.stop_strings.size() > static_cast<size_t>(limits.max_stop_strings)) {
    return FieldError("stop", absl::StrCat(stop.stop_strings.size(), " strings; allowed at most ", limits.max_stop_strings));
  }
  for (size_t i = 0; i < stop.stop_strings.size(); ++i) {
    const size_t len = stop.stop_strings[i].size();
    if (len < 1 || len > static_cast<size_t>(limits.max_stop_string_bytes)) {
      return FieldError("stop", absl::StrCat("stop[", i, "] is ", len, " bytes; allowed 1..", limits.max_stop_string_bytes));
    }
  }
  // min_tokens bans every stop id and the end-of-sequence token: the sampler's area holds that many.
  const int most_ids = std::min(limits.max_stop_token_ids, kMaxMinTokensBanned - 1);
  if (stop.stop_token_ids.size() > static_cast<size_t>(most_ids)) {
    return FieldError("stop_token_ids", absl::StrCat(stop.stop_token_ids.size(), " ids; allowed at most ", most_ids));
  }
  for (size_t i = 0; i < stop.stop_token_ids.size(); ++i) {
    const int32_t t = stop.stop_token_ids[i];
    if (!InVocab(t, c)) return FieldError("stop_token_ids", absl::StrCat("stop_token_ids[", i, "] = ", t, IdAllowed(c)));
  }
  return absl::OkStatus();
}

absl::Status CheckTokenSets(const SamplingParams& p, const ModelConfig& c) {
  if (p.logit_bias.size() > static_cast<size_t>(kMaxLogitBias)) {
    return FieldError("logit_bias", absl::StrCat(p.logit_bias.size(), " entries; allowed at most ", kMaxLogitBias));
  }
  std::vector<int32_t> biased;
  for (const auto& [t, b] : p.logit_bias) {
    if (!InVocab(t, c)) return FieldError("logit_bias", absl::StrCat("token id ", t, IdAllowed(c)));
    if (!InRange(b, -100.0f, 100.0f)) {
      return FieldError("logit_bias", absl::StrCat("the bias of token ", t, " is ", b, "; allowed -100..100"));
    }
    biased.push_back(t);
  }
  std::sort(biased.begin(), biased.end());
  if (auto twice = std::adjacent_find(biased.begin(), biased.end()); twice != biased.end()) {
    return FieldError("logit_bias", absl::StrCat("token id ", *twice, " given twice; allowed once each"));
  }
  for (size_t i = 0; i < p.allowed_token_ids.size(); ++i) {
    const int32_t t = p.allowed_token_ids[i];
    if (!InVocab(t, c)) return FieldError("allowed_token_ids", absl::StrCat("allowed_token_ids[", i, "] = ", t, IdAllowed(c)));
  }
  std::vector<int32_t> allowed = p.allowed_token_ids;
  std::sort(allowed.begin(), allowed.end());
  allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());
  if (allowed.size() > static_cast<size_t>(kMaxAllowedTokens)) {
    return FieldError("allowed_token_ids", absl::StrCat(allowed.size(), " distinct ids; allowed at most ", kMaxAllowedTokens));
  }
  if (p.bad_words.size() > static_cast<size_t>(kMaxBadWords)) {
    return FieldError("bad_words", absl::StrCat(p.bad_words.size(), " words; allowed at most ", kMaxBadWords));
  }
  size_t words = 0;
  for (size_t i = 0; i < p.bad_words.size(); ++i) {
    if (p.bad_words[i].empty()) {
      return FieldError("bad_words", absl::StrCat("bad_words[", i, "] is empty; each word needs 1 or more ids"));
    }
    for (int32_t t : p.bad_words[i]) {
      if (!InVocab(t, c)) return FieldError("bad_words", absl::StrCat("bad_words[", i, "] holds ", t, IdAllowed(c)));
    }
    words += p.bad_words[i].size();
  }
  if (words > static_cast<size_t>(kMaxBadWordTokens)) {
    return FieldError("bad_words", absl::StrCat(words, " tokens in all; allowed at most ", kMaxBadWordTokens));
  }
  return absl::OkStatus();
}

// The controls that penalise, ban or bias tokens.
absl::Status CheckControls(const Request& r, const ModelConfig& c) {
  const SamplingParams& p = r.sampling;
  if (!InRange(p.presence_penalty, -2.0f, 2.0f)) {
    return FieldError("presence_penalty", absl::StrCat(p.presence_penalty, "; allowed -2..2 (0 = off)"));
  }
  if (!InRange(p.frequency_penalty, -2.0f, 2.0f)) {
    return FieldError("frequency_penalty", absl::StrCat(p.frequency_penalty, "; allowed -2..2 (0 = off)"));
  }
  if (!InRange(p.min_p, 0.0f, 1.0f)) return FieldError("min_p", absl::StrCat(p.min_p, "; allowed 0..1 (0 = off)"));
  if (p.min_tokens < 0 || p.min_tokens > r.stop.max_new_tokens) {
    return FieldError("min_tokens",
                      absl::StrCat(p.min_tokens, "; allowed 0..max_new_tokens (", r.stop.max_new_tokens, ")"));
  }
  if (absl::Status st = CheckTokenSets(p, c); !st.ok()) return st;
  if (p.no_repeat_ngram_size < 0 || p.no_repeat_ngram_size > kMaxNoRepeatNgram) {
    return FieldError("no_repeat_ngram_size",
                      absl::StrCat(p.no_repeat_ngram_size, "; allowed 0..", kMaxNoRepeatNgram, " (0 = off)"));
  }
  return absl::OkStatus();
}

// Samples and beams: their counts, and what beam search leaves out, each named.
absl::Status CheckGroup(const Request& r, const ModelConfig& c, const KvCapacity& kv) {
  if (r.n < 1 || r.n > kMaxSamples) return FieldError("n", absl::StrCat(r.n, " samples; allowed 1..", kMaxSamples));
  if (r.num_beams < 1 || r.num_beams > kMaxBeams) {
    return FieldError("num_beams", absl::StrCat(r.num_beams, "; allowed 1..", kMaxBeams));
  }
  if (r.num_return_sequences < 1 || r.num_return_sequences > r.num_beams) {
    return FieldError("num_return_sequences",
                      absl::StrCat(r.num_return_sequences, "; allowed 1..num_beams (", r.num_beams, ")"));
  }
  if (!InRange(r.length_penalty, -100.0f, 100.0f)) {
    return FieldError("length_penalty", absl::StrCat(r.length_penalty, "; allowed -100..100"));
  }
  if (r.num_beams == 1) return absl::OkStatus();
  const SamplingParams& p = r.sampling;
  const char* conflict = !r.continuations.empty() ? "continuations" : r.n > 1 ? "n"
                         : r.stop.max_new_tokens == 0 ? "max_new_tokens" : p.logprobs >= 0 ? "logprobs"
                         : r.prompt_logprobs >= 0 ? "prompt_logprobs" : !r.stop.stop_strings.empty() ? "stop"
                         : !r.stop.stop_token_ids.empty() ? "stop_token_ids"
                         : p.repetition_penalty != 1.0f ? "repetition_penalty"
                         : p.presence_penalty != 0.0f ? "presence_penalty"
                         : p.frequency_penalty != 0.0f ? "frequency_penalty" : nullptr;
  if (conflict != nullptr) {
    return FieldError(conflict, absl::StrCat("not with num_beams > 1 (", r.num_beams,
                                             "); beam search returns num_return_sequences sequences, ends a beam at "
                                             "the end-of-sequence token or max_new_tokens, and applies the controls "
                                             "that ban or bias tokens"));
  }
  // Every beam may hold its own copy of the prompt's last block and max_new_tokens of output.
  const int k = r.num_beams, m = r.stop.max_new_tokens, n = KeptTokens(r), bs = kv.block_size;
  const int need = BlocksForTokens(n, bs) + k * (BlocksForTokens(m, bs) + 1);
  if (need <= kv.num_blocks) return absl::OkStatus();
  return FieldError("num_beams", absl::StrCat(k, " with ", c.encoder_decoder ? "an input" : "a prompt", " of ", n,
                                              " tokens and max_new_tokens ", m, " may need ", int64_t{need} * bs,
                                              " tokens of KV cache; the cache holds ", PoolTokens(kv),
                                              ": lower num_beams or max_new_tokens, or start the server with a "
                                              "larger --kv_cache_tokens"));
}

}  // namespace

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  absl::Status st = absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
  st.SetPayload(kFieldPayload, absl::Cord(field));
  return st;
}

std::string ErrorField(const absl::Status& status) {
  const auto field = status.GetPayload(kFieldPayload);
  return field ? std::string(*field) : std::string();
}

absl::Status LogprobsError(absl::string_view field, int value, const RequestLimits& limits) {
  return FieldError(field, absl::StrCat(value, "; allowed 0..", limits.max_logprobs));
}

absl::Status CheckRequest(const Request& r, const ModelConfig& c, const RequestLimits& limits, const KvCapacity& kv) {
  const bool scoring = !r.continuations.empty();
  if (r.id.size() > static_cast<size_t>(limits.max_request_id_bytes)) {
    return FieldError("request_id", absl::StrCat(r.id.size(), " bytes; allowed at most ", limits.max_request_id_bytes));
  }
  if (absl::Status st = CheckPrompt(r, c, scoring); !st.ok()) return st;
  if (absl::Status st = scoring ? CheckScoring(r, c, kv) : CheckLength(r, c, limits, kv); !st.ok()) return st;
  if (absl::Status st = CheckSampling(r, c, limits, scoring); !st.ok()) return st;
  if (absl::Status st = CheckStops(r.stop, c, limits); !st.ok()) return st;
  if (absl::Status st = CheckControls(r, c); !st.ok()) return st;
  return CheckGroup(r, c, kv);
}

void TruncatePrompt(Request* r) {
  const int keep = r->truncate_prompt_tokens;
  if (keep > 0 && static_cast<int>(r->prompt.size()) > keep) r->prompt.erase(r->prompt.begin(), r->prompt.end() - keep);
}

void PrepareControls(Request* r, int32_t eos) {
  SamplingParams& p = r->sampling;
  std::sort(p.logit_bias.begin(), p.logit_bias.end());
  std::sort(p.allowed_token_ids.begin(), p.allowed_token_ids.end());
  p.allowed_token_ids.erase(std::unique(p.allowed_token_ids.begin(), p.allowed_token_ids.end()), p.allowed_token_ids.end());
  p.min_tokens_banned.clear();
  if (p.min_tokens == 0) return;
  p.min_tokens_banned = r->stop.stop_token_ids;
  if (!r->stop.ignore_eos && eos >= 0) p.min_tokens_banned.push_back(eos);
  std::sort(p.min_tokens_banned.begin(), p.min_tokens_banned.end());
  p.min_tokens_banned.erase(std::unique(p.min_tokens_banned.begin(), p.min_tokens_banned.end()), p.min_tokens_banned.end());
}

}  // namespace relgen
