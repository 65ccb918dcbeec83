// Runs relgen-server as a child process on loopback for integration tests, and reads /metrics.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace relgen::testing {

class ServerProcess {
 public:
  // Starts the server with `args` (plus loopback listen flags) and waits for its startup line.
  bool Start(const std::vector<std::string>& args, std::string* error) {
    int out[2];
    if (pipe(out) != 0) return false;
    pid_ = fork();
    if (pid_ == 0) {
      // Sanitizer trees check the server with options of its own (the test client is not checked).
      if (const char* tsan = std::getenv("RELGEN_SERVER_TSAN_OPTIONS")) setenv("TSAN_OPTIONS", tsan, 1);
      dup2(out[1], 1);
      dup2(out[1], 2);
      close(out[0]);
      std::vector<std::string> all = {Binary(), "--listen", "127.0.0.1:0", "--metrics_listen", "127.0.0.1:0",
                                       "--http_listen", "127.0.0.1:0"};
      all.insert(all.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& a : all) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    fd_ = out[0];
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::string line;
    while (std::chrono::steady_clock::now() < give_up) {
      if (!ReadLine(&line)) break;
      output_ += line + "\n";
      std::smatch m;
      if (std::regex_search(line, m, std::regex("gRPC on 127\\.0\\.0\\.1:(\\d+).*metrics on 127\\.0\\.0\\.1:(\\d+)"))) {
        port_ = std::stoi(m[1]);
        metrics_port_ = std::stoi(m[2]);
        if (std::regex_search(line, m, std::regex("HTTP on 127\\.0\\.0\\.1:(\\d+)"))) http_port_ = std::stoi(m[1]);
        // Keep draining the output so the server never blocks on a full pipe.
        reader_ = std::thread([this] {
          std::string l;
          while (ReadLine(&l)) tail_ += l + "\n";
        });
        return true;
      }
    }
    *error = "no startup line; output:\n" + output_;
    return false;
  }

  // Waits for the process to exit; returns its exit status (or -1).
  int Wait(std::string* output = nullptr) {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    if (reader_.joinable()) reader_.join();
    if (output != nullptr) *output = output_ + tail_;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  void Signal(int sig) { kill(pid_, sig); }
  ~ServerProcess() {
    bool died = false;
    if (pid_ > 0) {
      // A server that ended on its own while the test still held it is a crash: say so.
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        died = true;
        fprintf(stderr, "--- relgen-server ended on its own: %s %d\n", WIFSIGNALED(status) ? "signal" : "exit status",
                WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
        pid_ = -1;
        if (reader_.joinable()) reader_.join();
      } else {
        kill(pid_, SIGKILL);
        Wait();
      }
    }
    if (died || std::getenv("RELGEN_TEST_SERVER_OUTPUT") != nullptr) {
      fprintf(stderr, "--- server output\n%s%s", output_.c_str(), tail_.c_str());
    }
    if (reader_.joinable()) reader_.join();
    if (fd_ >= 0) close(fd_);
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  int metrics_port() const { return metrics_port_; }
  int http_port() const { return http_port_; }  // the OpenAI-compatible API (0: off)
  const std::string& startup_output() const { return output_; }

  static std::string Binary() {
    const char* b = std::getenv("RELGEN_SERVER_BIN");
    return b != nullptr ? b : "relgen-server";
  }

 private:
  bool ReadLine(std::string* line) {
    line->clear();
    char c;
    while (true) {
      const ssize_t n = read(fd_, &c, 1);
      if (n <= 0) return !line->empty();
      if (c == '\n') return true;
      line->push_back(c);
    }
  }

  pid_t pid_ = -1;
  int fd_ = -1;
  int port_ = 0, metrics_port_ = 0, http_port_ = 0;
  std::string output_, tail_;
  std::thread reader_;
};

// METHOD http://127.0.0.1:port<path> with `body` (JSON): the whole response (status line, headers,
// body).
inline std::string HttpRequest(int port, const std::string& method, const std::string& path,
                               const std::string& body_out = "") {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::string body;
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    std::string req = method + " " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n";
    if (method != "GET") {
      req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body_out.size()) + "\r\n";
    }
    req += "\r\n" + body_out;
    if (write(s, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = read(s, buf, sizeof(buf))) > 0) body.append(buf, n);
    }
  }
  close(s);
  return body;
}

inline std::string HttpGet(int port, const std::string& path) { return HttpRequest(port, "GET", path); }

// The server's test hooks (started with --enable_test_hooks): hold the engine before its next step
// and let it go on. Once Pause returns, no step runs, so requests sent stay in flight.
inline bool PauseEngine(int metrics_port) {
  return HttpRequest(metrics_port, "POST", "/testing/pause").find("200 OK") != std::string::npos;
}
inline bool ResumeEngine(int metrics_port) {
  return HttpRequest(metrics_port, "POST", "/testing/resume").find("200 OK") != std::string::npos;
}
// While paused: the engine runs one more step (once it has work), then holds again.
inline bool StepEngine(int metrics_port) {
  return HttpRequest(metrics_port, "POST", "/testing/step").find("200 OK") != std::string::npos;
}

// GET http://127.0.0.1:port/metrics, the body.
inline std::string Scrape(int port) {
  const std::string r = HttpGet(port, "/metrics");
  const size_t start = r.find("\r\n\r\n");
  return start == std::string::npos ? r : r.substr(start + 4);
}

// Resident set size of a process in bytes (0 when unknown).
inline int64_t RssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

// Socket inodes of the established TCP connections whose local port is `port` (the server side of
// connections to a listener on it), from /proc/net/tcp and tcp6.
inline std::vector<std::string> EstablishedOnPort(int port) {
  std::vector<std::string> inodes;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      const size_t colon = local.rfind(':');
      if (colon == std::string::npos || state != "01") continue;  // 01: ESTABLISHED
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) inodes.push_back(inode);
    }
  }
  return inodes;
}

// Socket inodes a process holds open.
inline std::set<std::string> SocketInodesOf(pid_t pid) {
  std::set<std::string> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char target[256];
    const ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string t(target, n);
    if (t.rfind("socket:[", 0) == 0) out.insert(t.substr(8, t.size() - 9));
  }
  closedir(d);
  return out;
}

// Sample lines "name{labels} value" -> value; the key is the text before the value. A series with
// an `api` label (the API a call came by) also adds to the key without it, the sum over APIs:
// relgen_requests_received_total{api="grpc"} counts in relgen_requests_received_total too.
inline std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  const std::regex api_label("api=\"[a-z]+\",?");
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    const std::string key = line.substr(0, sp);
    const double v = std::strtod(line.c_str() + sp + 1, nullptr);
    out[key] = v;
    if (key.find("{api=") == std::string::npos) continue;
    std::string total = std::regex_replace(key, api_label, "");
    if (total.size() >= 2 && total.compare(total.size() - 2, 2, "{}") == 0) total.resize(total.size() - 2);
    out[total] += v;
  }
  return out;
}

}  // namespace relgen::testing
