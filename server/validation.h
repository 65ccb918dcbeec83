// Turns a GenerateRequest or a ScoreRequest into an engine Request, or an INVALID_ARGUMENT status
// that names the field, what was wrong and what is allowed.
#pragma once

#include <grpcpp/support/status.h>

#include "engine/core/engine.h"
#include "relgen/v1/generation.pb.h"
#include "server/options.h"

namespace relgen::server {

inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxStopStringBytes = 256;
inline constexpr int kMaxStopTokenIds = 64;
inline constexpr int kMaxLogprobs = 20;
inline constexpr int kMaxRequestIdBytes = 128;
static_assert(kMaxLogprobs == kMaxPromptLogprobs, "logprobs and prompt_logprobs share one documented range");

grpc::Status ToEngineRequest(const v1::GenerateRequest& in, const ModelConfig& config,
                             const Tokenizer& tokenizer, const Options& options, Request* out);
// A scoring request: out->continuations set, sampling.logprobs = top_logprobs (default 0).
grpc::Status ToEngineRequest(const v1::ScoreRequest& in, const ModelConfig& config, const Tokenizer& tokenizer,
                             const Options& options, Request* out);

}  // namespace relgen::server
