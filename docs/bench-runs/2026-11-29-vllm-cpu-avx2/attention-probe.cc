// Decode attention of B sequences x 16 heads x head size 64 (bloom-560m), paged (block 16 unless BS=, blocks in
// random order), 24 layers, 2 threads, ALiBi; a 256 MB sweep before each repetition. HUGE=1: the pools on 2 MiB
// pages; SUM=1: a plain sum over the same rows in the same order instead of the attention (the access pattern's
// own bound). Built against build/kernels/librelgen_kernels.a: g++ -O2 -mavx2 -mfma -std=c++20 -I. -Ibuild
// attention-probe.cc librelgen_kernels.a -lopenblas -lpthread
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include "kernels/cpu/attention.h"
using namespace relgen;
int main(int argc, char** argv) {
  const int B = argc > 1 ? atoi(argv[1]) : 32, reps = argc > 2 ? atoi(argv[2]) : 9;
  const int H = 16, hd = 64, L = 24; const int bs = getenv("BS") ? atoi(getenv("BS")) : 16;
  std::mt19937 rng(1);
  std::vector<int> len(B);
  for (int& l : len) l = 100 + rng() % 92;
  int blocks = 0;
  for (int l : len) blocks += (l + bs - 1) / bs;
  std::vector<int32_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> tables(B);
  int at = 0;
  for (int b = 0; b < B; ++b) for (int i = 0; i < (len[b] + bs - 1) / bs; ++i) tables[b].push_back(perm[at++]);
  const size_t per = size_t(blocks) * H * bs * hd;
  struct Buf { float* p; size_t n; float* data() { return p; } float* begin() { return p; } float* end() { return p + n; }
    void resize(size_t m) { n = m; size_t bytes = (m * 4 + (2u << 20) - 1) / (2u << 20) * (2u << 20); p = static_cast<float*>(aligned_alloc(2u << 20, bytes)); if (getenv("HUGE")) madvise(p, bytes, MADV_HUGEPAGE); } };
  std::vector<Buf> K(L), V(L);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int l = 0; l < L; ++l) { K[l].resize(per); V[l].resize(per); for (auto& x : K[l]) x = u(rng); for (auto& x : V[l]) x = u(rng); }
  std::vector<float> q(size_t(B) * H * hd), out(q.size());
  for (auto& x : q) x = u(rng);
  std::vector<float> slopes(H);
  for (int h = 0; h < H; ++h) slopes[h] = std::pow(2.0f, -0.5f * (h + 1));
  cpu::RelativeParams rel; rel.scheme = relpos::Scheme::kAlibi; rel.alibi_slopes = slopes.data(); rel.scale_with_qk = false;
  cpu::AttentionDims dims; dims.n_heads = H; dims.head_dim = hd; dims.scale = 0.125f;
  std::vector<double> ms;
  std::vector<char> flush(256 << 20, 1);
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < flush.size(); i += 64) flush[i]++;
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) {
      auto work = [&](int begin, int end) {
        for (int item = begin; item < end; ++item) {
          const int b = item / H, h = item % H;
          cpu::KvView kv; kv.k = K[l].data(); kv.v = V[l].data(); kv.block_table = tables[b].data(); kv.block_size = bs;
          kv.n_heads = H; kv.head_dim = hd;
          if (getenv("SUM")) {
            typedef float V8 __attribute__((vector_size(32), aligned(4)));
            V8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
            for (float* pool : {K[l].data(), V[l].data()})
              for (int p = 0; p < len[b]; ++p) {
                const float* row = pool + kv.RowOffset(h, p);
                for (int d = 0; d < hd; d += 32) { a0 += *(const V8*)(row + d); a1 += *(const V8*)(row + d + 8); a2 += *(const V8*)(row + d + 16); a3 += *(const V8*)(row + d + 24); }
              }
            out[b * H * hd + h] = (a0 + a1 + a2 + a3)[0];
          } else
          cpu::AttentionDecode(dims, rel, kv, q.data() + b * H * hd, len[b] - 1, out.data() + b * H * hd, h, h + 1);
        }
      };
      std::thread t([&] { work(0, B * H / 2); });
      work(B * H / 2, B * H);
      t.join();
    }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  double bytes = 0; for (int l : len) bytes += 2.0 * l * H * hd * 4 * L;
  printf("B %d: median %.1f ms [%.1f-%.1f], %.2f GB => %.1f GB/s; out[7]=%g\n", B, ms[ms.size()/2], ms[0], ms.back(), bytes/1e9, bytes/1e9/(ms[ms.size()/2]/1e3), out[7]);
}
