// A minimal HTTP/1.1 endpoint for the admin listener (GET /metrics, /healthz, /readyz), on a thread
// of its own.
// relgen serves metrics itself rather than through prometheus-cpp's civetweb exposer: Debian's
// civetweb runs handlers on 100 KiB stacks, which glibc's printf can overflow.
// One connection at a time, each bounded by a short I/O timeout; scrapes are small and rare.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace relgen::server {

class HttpEndpoint {
 public:
  struct Reply {
    int code = 200;  // 200 or 503
    std::string content_type = "text/plain; charset=utf-8";
    std::string body;
  };
  using Handler = std::function<Reply()>;
  ~HttpEndpoint();

  // Listens on HOST:PORT (port 0 picks one) and serves `routes` (exact paths, query ignored; keys
  // "/path" answer GET, keys "POST /path" answer POST) until destroyed. Returns the bound port.
  absl::StatusOr<int> Start(const std::string& listen, std::map<std::string, Handler> routes);

 private:
  void Serve();
  void Handle(int fd);

  std::map<std::string, Handler> routes_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace relgen::server
