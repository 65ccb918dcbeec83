// LD_PRELOAD fault injection for connect_fault_test: the next N TCP connect() calls of the process
// fail with ENOENT. That is what Debian 12's gRPC (1.51) sees when it reads errno after other calls
// overwrote connect's EINPROGRESS (fixed upstream later, grpc PR #35064): a fatal connect error on a healthy
// server. relgen_fail_connects(N), or RELGEN_FAIL_CONNECTS=N in the environment, arms it.
#include <dlfcn.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>

namespace {
std::atomic<int> remaining{[] {
  const char* n = std::getenv("RELGEN_FAIL_CONNECTS");
  return n != nullptr ? std::atoi(n) : 0;
}()};
}  // namespace

extern "C" void relgen_fail_connects(int n) { remaining.store(n); }

extern "C" int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  using Connect = int (*)(int, const struct sockaddr*, socklen_t);
  static const Connect real = reinterpret_cast<Connect>(dlsym(RTLD_NEXT, "connect"));
  int type = 0;
  socklen_t type_len = sizeof(type);
  const bool tcp = addr != nullptr && (addr->sa_family == AF_INET || addr->sa_family == AF_INET6) &&
                   getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM;
  if (tcp && remaining.fetch_sub(1) > 0) {
    errno = ENOENT;
    return -1;
  }
  return real(fd, addr, len);
}
