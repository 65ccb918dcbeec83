#include "server/http_endpoint.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace relgen::server {

HttpEndpoint::~HttpEndpoint() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

absl::StatusOr<int> HttpEndpoint::Start(const std::string& listen, std::map<std::string, Handler> routes) {
  routes_ = std::move(routes);
  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "': expected HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "': cannot resolve the host"));
  }
  listen_fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = listen_fd_ >= 0 && bind(listen_fd_, res->ai_addr, res->ai_addrlen) == 0 && ::listen(listen_fd_, 16) == 0;
  freeaddrinfo(res);
  if (!bound) {
    return absl::UnavailableError(absl::StrCat("cannot listen for metrics on ", listen, ": ", std::strerror(errno)));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound_port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                          : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  thread_ = std::thread([this] { Serve(); });
  return bound_port;
}

void HttpEndpoint::Serve() {
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    timeval tv{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    Handle(fd);
    close(fd);
  }
}

void HttpEndpoint::Handle(int fd) {
  std::string request;
  char buf[4096];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 16384) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, n);
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  Reply reply;
  std::string status = "200 OK";
  const size_t sp = line.find(' ');
  const std::string method = line.substr(0, sp);
  std::string path = sp == std::string::npos ? "" : line.substr(sp + 1, line.find(' ', sp + 1) - sp - 1);
  path = path.substr(0, path.find('?'));
  // GET routes are keyed by path, POST routes by "POST path".
  auto it = method == "GET" ? routes_.find(path) : method == "POST" ? routes_.find("POST " + path) : routes_.end();
  if (it != routes_.end()) {
    reply = it->second();
    if (reply.code != 200) status = "503 Service Unavailable";
  } else if (method == "GET" || method == "POST") {
    status = "404 Not Found";
    reply.body = "relgen serves";
    for (const auto& [p, h] : routes_) reply.body += (p[0] == '/' ? " GET " : " ") + p + ",";
    reply.body.back() = '\n';
  } else {
    status = "405 Method Not Allowed";
    reply.body = "only GET and POST\n";
  }
  const std::string& type = reply.content_type;
  const std::string& body = reply.body;
  const std::string response = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ",
                                            body.size(), "\r\nConnection: close\r\n\r\n", body);
  for (size_t off = 0; off < response.size();) {
    const ssize_t n = send(fd, response.data() + off, response.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += n;
  }
}

}  // namespace relgen::server
