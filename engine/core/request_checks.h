// Every rule about a request's fields, written once: the engine checks each request it is given
// against them (Engine::SubmitGroup), whichever API it came from, so the gRPC service and the HTTP
// API refuse the same request with the same message. A refusal is INVALID_ARGUMENT
// "field: value; allowed ...", the field also carried as the status's payload (ErrorField), so an
// API can name it without reading the message.
//
// Field names are the wire's (relgen.v1): the prompt is "prompt" ("context" when scoring),
// sampling.logprobs is "logprobs" ("top_logprobs" when scoring), stop.* are "stop" and
// "stop_token_ids", sampling.* and the rest are their own names.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace relgen {

struct Request;
struct ModelConfig;

// The served limits on a request (the server's flags set those it has; the rest are the defaults
// its API documents). One set, held by EngineConfig, read by the checks and nowhere else.
struct RequestLimits {
  int max_new_tokens = 4096;  // --max_new_tokens
  int max_stop_strings = 16;
  int max_stop_string_bytes = 256;
  int max_stop_token_ids = 64;  // at most kMaxMinTokensBanned - 1 (min_tokens bans them and EOS)
  int max_logprobs = 20;        // logprobs, prompt_logprobs and top_logprobs alike
  int max_request_id_bytes = 128;
};

// The KV cache a request must fit whole (blocks of block_size tokens).
struct KvCapacity {
  int num_blocks = 0;
  int block_size = 16;
};

// INVALID_ARGUMENT "field: what", with `field` as its payload.
absl::Status FieldError(absl::string_view field, absl::string_view what);
// The field a FieldError names; empty for any other status.
std::string ErrorField(const absl::Status& status);
// `field` (logprobs, prompt_logprobs, top_logprobs) outside 0..limits.max_logprobs. An API whose
// wire can say "unset" refuses a negative value it was sent with this, as the checks do.
absl::Status LogprobsError(absl::string_view field, int value, const RequestLimits& limits);

// OK, or the first rule `r` breaks. Reads r as given (truncate_prompt_tokens not yet applied).
absl::Status CheckRequest(const Request& r, const ModelConfig& config, const RequestLimits& limits,
                          const KvCapacity& kv);

// Keeps the prompt's last truncate_prompt_tokens tokens (0: all). Idempotent, so an API may apply
// it to learn the prompt as kept before the engine applies it again.
void TruncatePrompt(Request* r);
// What the sampler takes as given (engine/backends/sampler.h): logit_bias sorted by id,
// allowed_token_ids sorted and unique, min_tokens_banned filled (stop ids, and `eos` unless the
// request ignores it). For a request CheckRequest passed.
void PrepareControls(Request* r, int32_t eos);

}  // namespace relgen
