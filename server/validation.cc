#include "server/validation.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"

namespace relgen::server {
namespace {

grpc::Status Invalid(absl::string_view field, absl::string_view what) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat(field, ": ", what));
}

}  // namespace

grpc::Status ToEngineRequest(const v1::GenerateRequest& in, const ModelConfig& c,
                             const Tokenizer& tokenizer, const Options& options, Request* out) {
  if (in.request_id().size() > kMaxRequestIdBytes) {
    return Invalid("request_id", absl::StrCat(in.request_id().size(), " bytes; allowed at most ", kMaxRequestIdBytes));
  }
  out->id = in.request_id();
  switch (in.prompt_case()) {
    case v1::GenerateRequest::kText:
      if (in.text().empty()) return Invalid("text", "the prompt is empty; give text or token_ids");
      if (static_cast<int64_t>(in.text().size()) > options.max_prompt_bytes) {
        return Invalid("text", absl::StrCat(in.text().size(), " bytes; allowed at most ", options.max_prompt_bytes,
                                            " (--max_prompt_bytes)"));
      }
      if (c.bos_token_id >= 0 && c.bos_before_text) out->prompt.push_back(c.bos_token_id);
      for (int32_t t : tokenizer.Encode(in.text())) out->prompt.push_back(t);
      break;
    case v1::GenerateRequest::kTokenIds:
      if (in.token_ids().ids().empty()) return Invalid("token_ids", "the prompt is empty");
      for (int i = 0; i < in.token_ids().ids_size(); ++i) {
        const int32_t t = in.token_ids().ids(i);
        if (t < 0 || t >= c.vocab_size) {
          return Invalid("token_ids", absl::StrCat("ids[", i, "] = ", t, "; allowed 0..", c.vocab_size - 1));
        }
      }
      out->prompt.assign(in.token_ids().ids().begin(), in.token_ids().ids().end());
      break;
    default:
      return Invalid("prompt", "missing; set text or token_ids");
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
  return grpc::Status::OK;
}

}  // namespace relgen::server
