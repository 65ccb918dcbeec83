#include "server/http_listener.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace relgen::server {
namespace {

void SetTimeout(double seconds, const std::function<void(time_t, time_t)>& set) {
  const auto us = static_cast<int64_t>(seconds * 1e6);
  set(static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000));
}

}  // namespace

HttpListener::HttpListener(std::string what, const Settings& s) : what_(std::move(what)) {
  if (!s.tls_cert.empty()) {
    server_ = std::make_unique<httplib::SSLServer>(s.tls_cert.c_str(), s.tls_key.c_str(),
                                                   s.tls_client_ca.empty() ? nullptr : s.tls_client_ca.c_str());
  } else {
    server_ = std::make_unique<httplib::Server>();
  }
  const int threads = std::max(1, s.threads);
  server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server_->set_payload_max_length(static_cast<size_t>(s.max_body_bytes));
  SetTimeout(s.read_timeout_seconds, [this](time_t sec, time_t us) { server_->set_read_timeout(sec, us); });
  server_->set_keep_alive_timeout(std::max(1, s.keep_alive_seconds));
  SetTimeout(s.write_timeout_seconds, [this](time_t sec, time_t us) { server_->set_write_timeout(sec, us); });
  server_->set_tcp_nodelay(true);  // a stream's small chunks go out as they are written
  if (!s.compression) {
    // cpp-httplib compresses an answer whenever the request offers an encoding it has and has no
    // switch for it: the offer is taken out of the request before routing. The Request is the
    // server's own, non-const object, handed to handlers by const reference.
    server_->set_pre_routing_handler([](const httplib::Request& req, httplib::Response&) {
      const_cast<httplib::Request&>(req).headers.erase("Accept-Encoding");
      return httplib::Server::HandlerResponse::Unhandled;
    });
  }
  if (s.send_buffer_bytes > 0) {
    // Accepted connections inherit the listening socket's send buffer.
    server_->set_socket_options([bytes = s.send_buffer_bytes](socket_t sock) {
      httplib::default_socket_options(sock);
      setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    });
  }
}

HttpListener::~HttpListener() { Stop(); }

absl::StatusOr<int> HttpListener::Start(const std::string& listen) {
  if (!server_->is_valid()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot serve ", what_, ": the TLS certificate or key is not usable"));
  }
  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what_, " address '", listen, "': expected HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  if (host.empty()) host = "0.0.0.0";
  if (port == 0) {
    port = server_->bind_to_any_port(host);
    if (port < 0) return absl::UnavailableError(absl::StrCat("cannot listen for ", what_, " on ", listen));
  } else if (!server_->bind_to_port(host, port)) {
    return absl::UnavailableError(absl::StrCat("cannot listen for ", what_, " on ", listen, ": ", std::strerror(errno)));
  }
  thread_ = std::thread([this] {
    server_->listen_after_bind();
    ended_.store(true);
  });
  // Stop before the thread runs would find nothing to stop: wait until the listener is up.
  while (!server_->is_running() && !ended_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return port;
}

void HttpListener::Stop() {
  if (!thread_.joinable()) return;
  server_->stop();
  thread_.join();
}

}  // namespace relgen::server
