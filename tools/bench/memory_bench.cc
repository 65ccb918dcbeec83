#include "tools/bench/memory_bench.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"

namespace relgen::bench {
namespace {

int64_t RssBytes() {
  std::ifstream in("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

int64_t PeakRssBytes() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

struct Result {
  int64_t extra_bytes;
  double seconds;
  double checksum;
};

// Runs `fn` in a child process so each measurement starts from a fresh heap; the child reports the
// peak resident memory above what it held just before the measured work.
template <typename Setup>
Result Measure(Setup setup) {
  int fds[2];
  if (pipe(fds) != 0) return {-1, 0, 0};
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    auto work = setup();  // allocate and touch the inputs
    const int64_t before = RssBytes();
    const auto t0 = std::chrono::steady_clock::now();
    const double checksum = work();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Result r{PeakRssBytes() - before, secs, checksum};
    if (write(fds[1], &r, sizeof(r)) != sizeof(r)) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  Result r{-1, 0, 0};
  if (read(fds[0], &r, sizeof(r)) != sizeof(r)) r.extra_bytes = -1;
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return r;
}

}  // namespace

int RunMemoryBench(const std::vector<int>& lengths, int d_model, int n_heads) {
  const int hd = d_model / n_heads;
  std::printf("Peak extra memory of the relative term in one attention prefill, D = %d (%d heads x %d)\n",
              d_model, n_heads, hd);
  std::printf("  skew: relgen's CPU prefill (whole attention call, relative table M = L)\n");
  std::printf("  naive: the Shaw R tensor [L, L, D] gathered from the table, then S_rel = Q R^T\n\n");
  std::printf("%6s | %14s %9s | %14s %9s | %8s\n", "L", "skew extra MiB", "skew s", "naive extra MiB",
              "naive s", "ratio");
  for (int L : lengths) {
    const Result skew = Measure([&] {
      auto q = std::make_shared<std::vector<float>>(Random(size_t(L) * d_model, 1));
      auto k = std::make_shared<std::vector<float>>(Random(size_t(L) * d_model, 2));
      auto v = std::make_shared<std::vector<float>>(Random(size_t(L) * d_model, 3));
      auto e = std::make_shared<std::vector<float>>(Random(size_t(n_heads) * L * hd, 4));
      auto out = std::make_shared<std::vector<float>>(size_t(L) * d_model, 0.0f);
      auto table = std::make_shared<int32_t>(0);
      return [=] {
        cpu::KvView kv{k->data(), v->data(), table.get(), L, n_heads, hd};
        // K/V arrive in the cache layout [heads, L, hd]; the layout does not change the scratch.
        cpu::RelativeParams rel;
        rel.scheme = relpos::Scheme::kSkew;
        rel.table_k = e->data();
        rel.rows = L;
        cpu::AttentionDims dims{n_heads, hd, 1.0f / std::sqrt(float(hd))};
        cpu::AttentionPrefill(dims, rel, kv, q->data(), 0, L, out->data());
        double s = 0;
        for (float x : *out) s += x;
        return s;
      };
    });
    const Result naive = Measure([&] {
      auto q = std::make_shared<std::vector<float>>(Random(size_t(L) * d_model, 1));
      auto e = std::make_shared<std::vector<float>>(Random(size_t(L) * d_model, 4));
      return [=] {
        // R[i][j] = E[L-1-(i-j)] for j <= i (zero above): an [L, L, D] tensor, as in the seeds.
        std::vector<float> r(size_t(L) * L * d_model, 0.0f);
        for (int i = 0; i < L; ++i) {
          for (int j = 0; j <= i; ++j) {
            std::memcpy(&r[(size_t(i) * L + j) * d_model], &(*e)[size_t(L - 1 - (i - j)) * d_model],
                        d_model * sizeof(float));
          }
        }
        std::vector<float> s(size_t(L) * L, 0.0f);
        for (int i = 0; i < L; ++i) {
          const float* qi = &(*q)[size_t(i) * d_model];
          for (int j = 0; j <= i; ++j) {
            const float* rij = &r[(size_t(i) * L + j) * d_model];
            float acc = 0;
            for (int d = 0; d < d_model; ++d) acc += qi[d] * rij[d];
            s[size_t(i) * L + j] = acc;
          }
        }
        double sum = 0;
        for (float x : s) sum += x;
        return sum;
      };
    });
    std::printf("%6d | %14.1f %9.3f | %14.1f %9.3f | %7.0fx\n", L, skew.extra_bytes / 1048576.0,
                skew.seconds, naive.extra_bytes / 1048576.0, naive.seconds,
                double(naive.extra_bytes) / std::max<int64_t>(skew.extra_bytes, 1));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace relgen::bench
