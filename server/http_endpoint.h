// A minimal HTTP/1.1 endpoint for GET /metrics (Prometheus text format), on a thread of its own.
// relgen serves metrics itself rather than through prometheus-cpp's civetweb exposer: Debian's
// civetweb runs handlers on 100 KiB stacks, which glibc's printf can overflow.
// One connection at a time, each bounded by a short I/O timeout; scrapes are small and rare.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace relgen::server {

class HttpEndpoint {
 public:
  using Handler = std::function<std::string()>;  // returns the /metrics body
  ~HttpEndpoint();

  // Listens on HOST:PORT (port 0 picks one) and serves until destroyed. Returns the bound port.
  absl::StatusOr<int> Start(const std::string& listen, Handler metrics);

 private:
  void Serve();
  void Handle(int fd);

  Handler metrics_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace relgen::server
