// Turns a GenerateRequest or a ScoreRequest into an engine Request: the wire's presence and shape
// (a prompt given, a text within --max_prompt_bytes, an enum the proto knows, an optional field
// set to a value "unset" cannot mean) and its defaults. Every rule about the request's values is
// the engine's (engine/core/request_checks.h), checked when it is submitted. A refusal here is a
// FieldError too: INVALID_ARGUMENT "field: what; allowed ...", the field as its payload.
#pragma once

#include "absl/status/status.h"
#include "engine/core/engine.h"
#include "relgen/v1/generation.pb.h"
#include "server/options.h"

namespace relgen::server {

absl::Status ToEngineRequest(const v1::GenerateRequest& in, const ModelConfig& config, const Tokenizer& tokenizer,
                             const Options& options, const RequestLimits& limits, Request* out);
// A scoring request: out->continuations set, sampling.logprobs = top_logprobs (default 0).
absl::Status ToEngineRequest(const v1::ScoreRequest& in, const ModelConfig& config, const Tokenizer& tokenizer,
                             const Options& options, const RequestLimits& limits, Request* out);

}  // namespace relgen::server
