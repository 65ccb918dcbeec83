#include "server/auth.h"

namespace relgen::server {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Walk the longer string whole so that neither a mismatch nor a short guess ends the loop early.
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

grpc::Status CheckBearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                              absl::string_view token) {
  if (token.empty()) return grpc::Status::OK;
  constexpr absl::string_view kScheme = "Bearer ";
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "this server requires metadata 'authorization: Bearer <token>'; none was sent");
  }
  const absl::string_view sent(it->second.data(), it->second.size());
  if (sent.substr(0, kScheme.size()) != kScheme ||
      !ConstantTimeEquals(sent.substr(kScheme.size()), token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the 'authorization' metadata is not 'Bearer <token>' with this server's token");
  }
  return grpc::Status::OK;
}

}  // namespace relgen::server
