// A decode step's GEMMs by row count: bloom-560m's 97 matrices (24 layers x 4 + the LM head), 2 threads, 5
// repetitions a row count, median [min-max]. Not part of the build; against a build tree:
//   g++ -O2 -std=c++20 -I. gemm-rows-probe.cc build/kernels/librelgen_kernels.a -lopenblas -lpthread -o rows
//   ./rows f32|bf16 [ROWS...]
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include <algorithm>
#include <memory>
#include <cstdlib>
#include <string>
#include "kernels/cpu/gemm.h"
#include "kernels/thread_pool.h"
using namespace relgen;
int main(int argc, char** argv) {
  cpu::WeightType t = argc > 1 && std::string(argv[1]) == "bf16" ? cpu::WeightType::kBf16 : cpu::WeightType::kF32;
  cpu::ThreadPool pool(2);
  struct S { int k, n; };
  std::vector<S> shapes;
  for (int l = 0; l < 24; ++l) { shapes.push_back({1024, 3072}); shapes.push_back({1024, 1024}); shapes.push_back({1024, 4096}); shapes.push_back({4096, 1024}); }
  shapes.push_back({1024, 250880});
  std::vector<std::unique_ptr<cpu::PackedMatrix>> ws;
  double bytes = 0, params = 0;
  for (const S& s : shapes) {
    ws.push_back(std::make_unique<cpu::PackedMatrix>(s.n, s.k, t, [&](int o, float* out) { for (int i = 0; i < s.k; ++i) out[i] = ((o * 31 + i * 7) % 199 - 99) * 1e-3f; }));
    bytes += ws.back()->bytes(); params += double(s.k) * s.n;
  }
  std::vector<float> x(size_t(64) * 4096, 0.01f), y(size_t(64) * 250880);
  std::vector<int> rowsl = {1, 2, 3, 4, 6, 8, 12, 16, 32};
  if (argc > 2) { rowsl.clear(); for (int i = 2; i < argc; ++i) rowsl.push_back(atoi(argv[i])); }
  std::vector<std::vector<double>> ts(rowsl.size());
  for (int rep = 0; rep < 5; ++rep) {
    for (size_t i = 0; i < rowsl.size(); ++i) {
      auto t0 = std::chrono::steady_clock::now();
      for (size_t m = 0; m < ws.size(); ++m) cpu::LinearPacked(x.data(), rowsl[i], *ws[m], nullptr, y.data(), &pool);
      ts[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  for (size_t i = 0; i < rowsl.size(); ++i) {
    auto v = ts[i]; std::sort(v.begin(), v.end());
    std::printf("rows %2d: %6.1f ms [%.1f-%.1f]  %5.1f GB/s  %6.1f GFLOP/s\n", rowsl[i], v[2] * 1e3, v[0] * 1e3, v[4] * 1e3, bytes / v[2] / 1e9, 2 * params * rowsl[i] / v[2] / 1e9);
  }
}
