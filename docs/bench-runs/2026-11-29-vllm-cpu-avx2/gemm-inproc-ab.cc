// In-process A/B of two builds of kernels/cpu/gemm.cc's kernels over bloom-560m's 97 decode matrices, 2 threads:
// passes alternate A B B A ..., one ratio B/A per pair. Not part of the build; from the repository root:
//   python3 gemm-inproc-extract.py A.cc A ka.cc && python3 gemm-inproc-extract.py B.cc B kb.cc
//   g++ -I. -O3 -ffp-contract=fast -std=gnu++20 -c ka.cc && g++ -I. -O3 -ffp-contract=fast -std=gnu++20 -c kb.cc
//   g++ -O2 -std=c++20 -I. gemm-inproc-ab.cc ka.o kb.o build/kernels/librelgen_kernels.a -lopenblas -lpthread -o ab
//   ./ab f32|bf16 PAIRS ROWS...
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>
#include <algorithm>
#include "kernels/cpu/gemm.h"
#include "kernels/thread_pool.h"
namespace relgen::cpu {
void Linear_A(const float*, int, const PackedMatrix&, const float*, float*, ThreadPool*);
void Linear_B(const float*, int, const PackedMatrix&, const float*, float*, ThreadPool*);
}
using namespace relgen;
int main(int argc, char** argv) {
  cpu::WeightType t = std::string(argv[1]) == "bf16" ? cpu::WeightType::kBf16 : cpu::WeightType::kF32;
  int reps = atoi(argv[2]);
  std::vector<int> rowsl; for (int i = 3; i < argc; ++i) rowsl.push_back(atoi(argv[i]));
  cpu::ThreadPool pool(2);
  struct S { int k, n; };
  std::vector<S> shapes;
  for (int l = 0; l < 24; ++l) { shapes.push_back({1024, 3072}); shapes.push_back({1024, 1024}); shapes.push_back({1024, 4096}); shapes.push_back({4096, 1024}); }
  shapes.push_back({1024, 250880});
  std::vector<std::unique_ptr<cpu::PackedMatrix>> ws;
  for (const S& s : shapes) ws.push_back(std::make_unique<cpu::PackedMatrix>(s.n, s.k, t, [&](int o, float* out) { for (int i = 0; i < s.k; ++i) out[i] = ((o * 31 + i * 7) % 199 - 99) * 1e-3f; }));
  std::vector<float> x(size_t(160) * 4096), y(size_t(160) * 250880);
  std::mt19937 g(7); std::uniform_real_distribution<float> u(-1, 1); for (auto& v : x) v = u(g);
  for (int rows : rowsl) {
    std::vector<double> ta, tb, ratio;
    for (int rep = 0; rep < reps; ++rep) {
      for (int which = 0; which < 2; ++which) {
        const bool a = (rep % 2 == 0) == (which == 0);  // ABBA order
        auto t0 = std::chrono::steady_clock::now();
        for (auto& w : ws) (a ? cpu::Linear_A : cpu::Linear_B)(x.data(), rows, *w, nullptr, y.data(), &pool);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
        (a ? ta : tb).push_back(dt);
      }
      ratio.push_back(tb.back() / ta.back());
    }
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    auto q = [](std::vector<double> v, double f) { std::sort(v.begin(), v.end()); return v[size_t(f * (v.size() - 1))]; };
    int faster = 0; for (double r : ratio) faster += r < 1;
    std::printf("rows %3d: A %6.1f ms  B %6.1f ms  B/A median %.3f [q25 %.3f q75 %.3f]  B faster %d/%d\n", rows, med(ta), med(tb), med(ratio), q(ratio, .25), q(ratio, .75), faster, reps);
    std::fflush(stdout);
  }
}
