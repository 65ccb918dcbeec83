// Turns a GenerateRequest into an engine Request, or an INVALID_ARGUMENT status that names the
// field, what was wrong and what is allowed.
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

grpc::Status ToEngineRequest(const v1::GenerateRequest& in, const ModelConfig& config,
                             const Tokenizer& tokenizer, const Options& options, Request* out);

}  // namespace relgen::server
