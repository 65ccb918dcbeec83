// Optional bearer-token authentication of GenerationService calls (--auth_token_file).
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>

#include "absl/strings/string_view.h"

namespace relgen::server {

// Equality whose running time depends on the lengths only, never on where the bytes differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// OK when `token` is empty (auth off) or the metadata carries "authorization: Bearer <token>";
// UNAUTHENTICATED otherwise, saying what is expected but never echoing what was sent.
grpc::Status CheckBearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                              absl::string_view token);

}  // namespace relgen::server
