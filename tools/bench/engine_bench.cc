#include "tools/bench/engine_bench.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include "engine/backends/cpu_backend.h"
#include "engine/model/model.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/thread_pool.h"
#include "nlohmann/json.hpp"

#ifndef RELGEN_SOURCE_DIR
#define RELGEN_SOURCE_DIR "."
#endif

namespace relgen::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Read bandwidth: sum a 1 GiB buffer on every thread (decode streams weights and KV: reads).
double ReadBandwidth(cpu::ThreadPool& pool) {
  const size_t n = size_t{1} << 28;  // floats
  std::vector<float> a(n, 1.0f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> part(pool.num_threads());
    const auto t = Clock::now();
    pool.ParallelFor(pool.num_threads(), [&](int b, int e) {
      for (int w = b; w < e; ++w) {
        float acc[16] = {};
        const size_t lo = n * w / pool.num_threads(), hi = n * (w + 1) / pool.num_threads();
        for (size_t i = lo; i + 16 <= hi; i += 16) {
          for (int l = 0; l < 16; ++l) acc[l] += a[i + l];
        }
        for (float x : acc) part[w] += x;
      }
    });
    best = std::max(best, n * sizeof(float) / Since(t));
    if (part[0] < 0) std::printf("-");  // keep the sum alive
  }
  return best;
}

double CopyBandwidth() {
  const size_t n = size_t{1} << 28;
  std::vector<char> a(n, 1), b(n, 0);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    best = std::max(best, 2.0 * n / Since(t));  // bytes read + written
  }
  return best;
}

double GemmFlops(cpu::ThreadPool& pool) {
  const int m = 256, k = 2048, n = 2048;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> w(size_t(n) * k), x(size_t(m) * k), y(size_t(m) * n);
  for (float& v : w) v = nd(rng);
  for (float& v : x) v = nd(rng);
  const cpu::PackedMatrix packed(w.data(), n, k);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t = Clock::now();
    cpu::LinearPacked(x.data(), m, packed, nullptr, y.data(), &pool);
    best = std::max(best, 2.0 * m * n * k / Since(t));
  }
  return best;
}

struct Result {
  bool ok = false;
  double prefill_tps = 0, decode_tps = 0;
};

Result RunRelgen(const std::shared_ptr<const Model>& model, int batch, int context, int steps, int threads) {
  const int bs = 16;
  const int per_seq = BlocksForTokens(context + steps + 1, bs);
  auto backend = *NewCpuBackend(model, KvCacheConfig{bs, batch * per_seq}, threads);
  std::vector<std::vector<int32_t>> tables(batch);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < per_seq; ++i) tables[b].push_back(b * per_seq + i);
  }
  std::mt19937 rng(0);
  std::vector<int32_t> prompt(context);
  for (int32_t& t : prompt) t = rng() % 256;
  std::vector<float> logits;
  Result r;
  for (int b = 0; b < batch; ++b) {  // every sequence prefilled; the first one timed
    SequenceStep s{prompt, 0, tables[b], false};
    const auto t = Clock::now();
    if (!backend->Forward({&s, 1}, &logits).ok()) return r;
    if (b == 0) r.prefill_tps = context / Since(t);
  }
  std::vector<int32_t> tokens(batch, 65);
  auto step = [&](int pos) {
    std::vector<SequenceStep> st;
    for (int b = 0; b < batch; ++b) st.push_back({absl::MakeConstSpan(&tokens[b], 1), pos, tables[b], false});
    return backend->Forward(st, &logits).ok();
  };
  if (!step(context)) return r;  // warm-up
  const auto t = Clock::now();
  for (int s = 0; s < steps; ++s) {
    if (!step(context + 1 + s)) return r;
  }
  r.decode_tps = double(batch) * steps / Since(t);
  r.ok = true;
  return r;
}

json RunTorch(const EngineBenchOptions& o, int batch, int context, int threads) {
  const std::string cmd = "/usr/bin/python3 '" RELGEN_SOURCE_DIR "/tools/torch_bench.py' --model '" + o.model +
                          "' --batch " + std::to_string(batch) + " --context " + std::to_string(context) +
                          " --steps " + std::to_string(o.steps) + " --threads " + std::to_string(threads);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return nullptr;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  if (pclose(p) != 0) return nullptr;
  json j = json::parse(out, nullptr, false);
  return j.is_discarded() ? json(nullptr) : j;
}

}  // namespace

int RunEngineBench(const EngineBenchOptions& o) {
  auto model = Model::Load(o.model);
  if (!model.ok()) {
    std::fprintf(stderr, "relgen-bench: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config();
  for (int context : o.contexts) {
    if (context + o.steps + 1 > c.max_seq_len) {
      std::fprintf(stderr, "relgen-bench: context %d + %d steps exceeds the model's max_seq_len %d\n", context,
                   o.steps + 1, c.max_seq_len);
      return 2;
    }
  }
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu::ThreadPool pool(threads);
  std::printf("measuring the machine's ceilings (%d threads)...\n", threads);
  const double read_bw = ReadBandwidth(pool), copy_bw = CopyBandwidth(), flops = GemmFlops(pool);
  std::printf("read bandwidth %.1f GB/s, copy bandwidth %.1f GB/s, GEMM %.1f GFLOP/s (relgen packed, 256x2048x2048)\n\n",
              read_bw / 1e9, copy_bw / 1e9, flops / 1e9);

  // Work per decode token: every weight is read once per step (shared by the batch); each sequence
  // reads its own K/V; the dense FLOPs scale with the batch.
  const int64_t dense_params = (*model)->num_parameters() - int64_t{c.vocab_size} * c.d_model * (c.tie_embeddings ? 0 : 1);
  const double weight_bytes = double((*model)->num_parameters()) * sizeof(float);
  std::printf("model %s: %s, d_model %d, %d layers, %d heads, ffn %d, %.1fM parameters (f32 %.0f MB)\n",
              c.name.c_str(), std::string(SchemeName(c.rel.scheme)).c_str(), c.d_model, c.n_layers, c.n_heads, c.ffn_dim,
              (*model)->num_parameters() / 1e6, weight_bytes / 1e6);
  std::printf("%5s %7s | %12s %12s %7s | %12s %12s %7s | %9s\n", "batch", "context", "relgen pre/s", "torch pre/s",
              "ratio", "relgen dec/s", "torch dec/s", "ratio", "roofline");
  json rows = json::array();
  for (int context : o.contexts) {
    for (int batch : o.batches) {
      const Result r = RunRelgen(*model, batch, context, o.steps, threads);
      if (!r.ok) {
        std::fprintf(stderr, "relgen-bench: the backend failed at batch %d, context %d\n", batch, context);
        return 1;
      }
      json t = o.torch ? RunTorch(o, batch, context, threads) : json(nullptr);
      const double tp = t.is_object() ? t["prefill_tokens_per_s"].get<double>() : 0;
      const double td = t.is_object() ? t["decode_tokens_per_s"].get<double>() : 0;
      const double kv_bytes = double(batch) * context * c.n_layers * 2.0 * c.qkv_width() * sizeof(float);
      const double step_flops = 2.0 * batch * dense_params + 4.0 * batch * context * c.n_layers * c.qkv_width();
      const double roof_s = std::max((weight_bytes + kv_bytes) / read_bw, step_flops / flops);
      const double fraction = roof_s / (batch / r.decode_tps);
      std::printf("%5d %7d | %12.1f %12.1f %6.2fx | %12.1f %12.1f %6.2fx | %8.0f%%\n", batch, context, r.prefill_tps, tp,
                  tp > 0 ? r.prefill_tps / tp : 0, r.decode_tps, td, td > 0 ? r.decode_tps / td : 0, 100 * fraction);
      std::fflush(stdout);
      rows.push_back({{"batch", batch}, {"context", context}, {"relgen_prefill_tps", r.prefill_tps},
                      {"relgen_decode_tps", r.decode_tps}, {"torch_prefill_tps", tp}, {"torch_decode_tps", td},
                      {"decode_roofline_fraction", fraction}, {"roofline_bound", (weight_bytes + kv_bytes) / read_bw >= step_flops / flops ? "memory" : "compute"}});
    }
  }
  if (!o.json_out.empty()) {
    std::ofstream(o.json_out) << json({{"read_bandwidth_Bps", read_bw}, {"copy_bandwidth_Bps", copy_bw},
                                       {"gemm_flops", flops}, {"threads", threads}, {"results", rows}}).dump(2);
  }
  std::printf("\nroofline: decode step time if bound only by reading weights + this batch's K/V at the read\n"
              "bandwidth, or by the dense FLOPs at the GEMM ceiling, whichever is larger; shown as a\n"
              "fraction of the measured step time.\n");
  return 0;
}

}  // namespace relgen::bench
