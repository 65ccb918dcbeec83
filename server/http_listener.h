// An HTTP/1.1 listener on cpp-httplib (Debian's libcpp-httplib): the OpenAI-compatible API
// (server/openai_api.h) and the admin routes (/metrics, /healthz, /readyz) run on it. Each
// connection is served by one thread of a fixed pool; connections beyond the pool wait, in order,
// for a thread. A streaming response holds its thread until it ends.
#pragma once

#include <httplib.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace relgen::server {

class HttpListener {
 public:
  struct Settings {
    std::string tls_cert, tls_key;  // both set: HTTPS
    std::string tls_client_ca;      // set: clients must present a certificate it signed
    int threads = 4;
    int64_t max_body_bytes = 1 << 20;  // larger request bodies are answered 413
    double read_timeout_seconds = 10;  // one read of a request's bytes
    int keep_alive_seconds = 5;        // an idle keep-alive connection is closed after this
    double write_timeout_seconds = 5;  // one write of the response
    // The kernel's send buffer per connection (0: the kernel's own, which grows to megabytes): what
    // a reader that stops reading can hold before the server's writes wait on it.
    int send_buffer_bytes = 0;
    // Answers compressed (gzip, or br) when the request's Accept-Encoding offers it; off, every
    // answer goes as is, whatever the client offers (a client whose decoder cannot read what it
    // offers still reads every answer). Server-sent events are never compressed.
    bool compression = false;
  };
  // `what` names the listener in errors ("HTTP", "metrics").
  HttpListener(std::string what, const Settings& settings);
  ~HttpListener();

  // The routes; set them before Start.
  httplib::Server& server() { return *server_; }
  // Binds HOST:PORT (port 0 picks one) and serves on a thread of its own until Stop. Returns the
  // bound port.
  absl::StatusOr<int> Start(const std::string& listen);
  // Stops accepting and waits for the connections being served.
  void Stop();

 private:
  std::string what_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> ended_{false};  // the serving thread returned
};

}  // namespace relgen::server
