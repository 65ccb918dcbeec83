#include "tools/bench/machine_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "kernels/cpu/gemm.h"
#include "kernels/thread_pool.h"
#include "nlohmann/json.hpp"

namespace relgen::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
typedef float V8 __attribute__((vector_size(32)));

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sums `n` floats (a multiple of 32) with four independent vector accumulators: bound by loads.
template <typename V>
__attribute__((always_inline)) inline float SumT(const float* a, size_t n) {
  constexpr size_t L = sizeof(V) / sizeof(float);
  V s0{}, s1{}, s2{}, s3{};
  for (size_t i = 0; i < n; i += 4 * L) {
    V v0, v1, v2, v3;
    std::memcpy(&v0, a + i, sizeof(V));
    std::memcpy(&v1, a + i + L, sizeof(V));
    std::memcpy(&v2, a + i + 2 * L, sizeof(V));
    std::memcpy(&v3, a + i + 3 * L, sizeof(V));
    s0 += v0;
    s1 += v1;
    s2 += v2;
    s3 += v3;
  }
  const V s = (s0 + s1) + (s2 + s3);
  float out = 0;
  for (size_t l = 0; l < L; ++l) out += s[l];
  return out;
}
__attribute__((target("avx2"))) float SumAvx2(const float* a, size_t n) { return SumT<V8>(a, n); }
float SumBase(const float* a, size_t n) {
  typedef float V4 __attribute__((vector_size(16)));
  return SumT<V4>(a, n);
}

// Twelve independent FMA chains held in registers: the arithmetic peak, no memory involved.
__attribute__((target("avx2,fma"))) double FmaChainsAvx2(int64_t iters) {
  V8 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = V8{} + (1.0f + static_cast<float>(j));
  const V8 a = V8{} + 0.999999f, b = V8{} + 1e-7f;
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = acc[j] * a + b;
  }
  double s = 0;
  for (int j = 0; j < 12; ++j) s += acc[j][0];
  return s;
}

}  // namespace

int RunMachineBench(const MachineOptions& o) {
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  cpu::ThreadPool pool(threads);
  const std::vector<size_t> sizes = {size_t{256} << 10, size_t{4} << 20, size_t{16} << 20, size_t{24} << 20,
                                     size_t{64} << 20, size_t{1} << 30};
  // One buffer per thread (first touched by that thread), as large as the largest working set's
  // slice, on the weights' kind of pages.
  const size_t slice_max = sizes.back() / threads / sizeof(float) / 32 * 32;
  std::vector<std::unique_ptr<float, decltype(&std::free)>> bufs;
  for (int t = 0; t < threads; ++t) bufs.emplace_back(nullptr, &std::free);
  pool.ParallelFor(threads, [&](int b, int e) {
    for (int t = b; t < e; ++t) {
      bufs[t].reset(reinterpret_cast<float*>(cpu::AllocateWeights(slice_max * sizeof(float))));
      std::fill(bufs[t].get(), bufs[t].get() + slice_max, 1.0f);
    }
  });
  std::printf("relgen-bench machine: %d threads, %s loads, %d repetitions of each size (interleaved)\n", threads,
              avx2 ? "AVX2" : "SSE", o.reps);
  std::vector<std::vector<double>> bw(sizes.size());
  std::vector<double> peak;
  float sink = 0;
  // The GEMM on a prefill's shape (128 rows of a 1024-wide model into its 4096-wide MLP), each weight
  // type, right after the FMA probe of the same repetition: on a shared machine the peak moves by
  // tens of percent between minutes, so the kernel's share of it is taken pair by pair.
  constexpr int kGemmRows = 128, kGemmK = 1024, kGemmN = 4096;
  const cpu::WeightType gemm_types[] = {cpu::WeightType::kF32, cpu::WeightType::kBf16};
  std::vector<cpu::PackedMatrix> gemm_w;
  std::vector<float> gemm_x(size_t{kGemmRows} * kGemmK), gemm_y(size_t{kGemmRows} * kGemmN);
  {
    std::vector<float> w(size_t{kGemmN} * kGemmK);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(int(i * 2654435761u % 2001) - 1000) * 1e-4f;
    for (size_t i = 0; i < gemm_x.size(); ++i) gemm_x[i] = static_cast<float>(int(i * 40503u % 2001) - 1000) * 1e-3f;
    for (cpu::WeightType t : gemm_types) gemm_w.emplace_back(w.data(), kGemmN, kGemmK, t);
  }
  std::vector<std::vector<double>> gemm(gemm_w.size()), gemm_share(gemm_w.size());
  for (int rep = 0; rep < o.reps; ++rep) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      const size_t slice = sizes[s] / threads / sizeof(float) / 32 * 32;
      const int passes = static_cast<int>(std::max<size_t>(2, (size_t{2} << 30) / sizes[s]));
      std::vector<float> part(threads);
      pool.ParallelFor(threads, [&](int b, int e) {  // warm the level
        for (int t = b; t < e; ++t) part[t] += avx2 ? SumAvx2(bufs[t].get(), slice) : SumBase(bufs[t].get(), slice);
      });
      const auto t0 = Clock::now();
      pool.ParallelFor(threads, [&](int b, int e) {
        for (int t = b; t < e; ++t) {
          for (int p = 0; p < passes; ++p) {
            part[t] += avx2 ? SumAvx2(bufs[t].get(), slice) : SumBase(bufs[t].get(), slice);
          }
        }
      });
      bw[s].push_back(double(slice) * sizeof(float) * threads * passes / Since(t0));
      for (float x : part) sink += x;
    }
    if (avx2) {
      const int64_t iters = 20000000;
      const auto t0 = Clock::now();
      std::vector<double> part(threads);
      pool.ParallelFor(threads, [&](int b, int e) {
        for (int t = b; t < e; ++t) part[t] = FmaChainsAvx2(iters);
      });
      peak.push_back(2.0 * 8 * 12 * double(iters) * threads / Since(t0));
      for (double x : part) sink += static_cast<float>(x);
    }
    for (size_t g = 0; g < gemm_w.size(); ++g) {
      cpu::LinearPacked(gemm_x.data(), kGemmRows, gemm_w[g], nullptr, gemm_y.data(), &pool);  // warm
      constexpr int kPasses = 8;
      const auto t0 = Clock::now();
      for (int p = 0; p < kPasses; ++p) cpu::LinearPacked(gemm_x.data(), kGemmRows, gemm_w[g], nullptr, gemm_y.data(), &pool);
      gemm[g].push_back(2.0 * kGemmRows * kGemmK * kGemmN * kPasses / Since(t0));
      if (!peak.empty()) gemm_share[g].push_back(gemm[g].back() / peak.back());
      sink += gemm_y[0];
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  json read = json::array();
  std::printf("%12s | %-34s\n", "working set", "read GB/s, median [min-max]");
  for (size_t s = 0; s < sizes.size(); ++s) {
    const auto [lo, hi] = std::minmax_element(bw[s].begin(), bw[s].end());
    std::printf("%9zu KiB | %.1f [%.1f-%.1f]\n", sizes[s] >> 10, median(bw[s]) / 1e9, *lo / 1e9, *hi / 1e9);
    read.push_back({{"bytes", sizes[s]}, {"median_Bps", median(bw[s])}, {"samples", bw[s]}});
  }
  double peak_median = 0;
  if (!peak.empty()) {
    peak_median = median(peak);
    const auto [lo, hi] = std::minmax_element(peak.begin(), peak.end());
    std::printf("FMA peak (12 register chains, 8-lane FMA): %.1f GFLOP/s [%.1f-%.1f]\n", peak_median / 1e9, *lo / 1e9,
                *hi / 1e9);
  }
  json gemm_json = json::array();
  for (size_t g = 0; g < gemm_w.size(); ++g) {
    const auto [lo, hi] = std::minmax_element(gemm[g].begin(), gemm[g].end());
    std::printf("GEMM, %s weights (%s), %d x %d -> %d: %.1f GFLOP/s [%.1f-%.1f]", cpu::WeightTypeName(gemm_types[g]),
                cpu::GemmPathName(gemm_types[g], false).c_str(), kGemmRows, kGemmK, kGemmN, median(gemm[g]) / 1e9,
                *lo / 1e9, *hi / 1e9);
    if (!gemm_share[g].empty()) {
      const auto [slo, shi] = std::minmax_element(gemm_share[g].begin(), gemm_share[g].end());
      std::printf(", %.0f%% [%.0f-%.0f%%] of the FMA peak of its repetition", 100 * median(gemm_share[g]), 100 * *slo,
                  100 * *shi);
    }
    std::printf("\n");
    gemm_json.push_back({{"weights", cpu::WeightTypeName(gemm_types[g])}, {"rows", kGemmRows}, {"k", kGemmK},
                         {"n", kGemmN}, {"flops_samples", gemm[g]}, {"share_of_peak_samples", gemm_share[g]}});
  }
  if (sink == 12345.0f) std::printf(" ");  // keeps the sums
  if (!o.json_out.empty()) {
    std::ofstream(o.json_out) << json({{"threads", threads}, {"repetitions", o.reps}, {"read", read},
                                       {"peak_flops", peak_median}, {"peak_flops_samples", peak},
                                       {"gemm", gemm_json}})
                                     .dump(2);
  }
  return 0;
}

bool LoadMachineFigures(const std::string& path, MachineFigures* out) {
  std::ifstream in(path);
  const json j = json::parse(in, nullptr, false);
  if (!in || j.is_discarded() || !j.contains("read") || !j["read"].is_array() || j["read"].empty()) {
    std::fprintf(stderr, "relgen-bench: %s is not a `relgen-bench machine --json` file\n", path.c_str());
    return false;
  }
  out->read.clear();
  for (const json& r : j["read"]) out->read.emplace_back(r.value("bytes", 0.0), r.value("median_Bps", 0.0));
  std::sort(out->read.begin(), out->read.end());
  out->peak_flops = j.value("peak_flops", 0.0);
  out->threads = j.value("threads", 0);
  return true;
}

double ReadBandwidthFor(const MachineFigures& m, double bytes) {
  for (const auto& [size, bps] : m.read) {
    if (size >= bytes) return bps;
  }
  return m.read.back().second;
}

}  // namespace relgen::bench
