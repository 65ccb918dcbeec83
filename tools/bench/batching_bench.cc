#include "tools/bench/batching_bench.h"

#include <cstdio>
#include <vector>

#include "absl/time/clock.h"
#include "engine/backends/cpu_backend.h"
#include "engine/core/engine.h"

namespace relgen::bench {
namespace {

std::vector<Request> Work(int sequences, int prompt_len, int new_tokens, int beams = 1) {
  std::vector<Request> out;
  for (int s = 0; s < sequences; ++s) {
    Request r;
    for (int i = 0; i < prompt_len; ++i) r.prompt.push_back((s * 31 + i * 7) % 256);
    r.stop.max_new_tokens = new_tokens;
    r.stop.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    r.num_beams = beams;
    out.push_back(r);
  }
  return out;
}

// Seconds to generate every token of `work`, all submitted at once or one after another.
double Run(Engine& engine, const std::vector<Request>& work, bool together, int64_t* tokens) {
  const absl::Time t0 = absl::Now();
  std::vector<std::shared_ptr<RequestHandle>> handles;
  *tokens = 0;
  auto drain = [&](RequestHandle& h) {
    Output o;
    while (h.Next(&o)) *tokens += static_cast<int64_t>(o.token_ids.size());
  };
  for (const Request& r : work) {
    auto h = engine.Submit(r);
    if (!h.ok()) {
      std::fprintf(stderr, "submit: %s\n", std::string(h.status().message()).c_str());
      return -1;
    }
    if (together) {
      handles.push_back(*h);
    } else {
      drain(**h);
    }
  }
  for (auto& h : handles) drain(*h);
  return absl::ToDoubleSeconds(absl::Now() - t0);
}

}  // namespace

int RunBatchingBench(const std::string& model_dir, int sequences, int prompt_len, int new_tokens, int threads,
                     bool sequential, int beams) {
  auto model = Model::Load(model_dir);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config();
  const int blocks = beams > 1 ? sequences * (BlocksForTokens(prompt_len, 16) + beams * (BlocksForTokens(new_tokens, 16) + 1))
                               : sequences * BlocksForTokens(prompt_len + new_tokens, 16);
  auto backend = NewCpuBackend(*model, KvCacheConfig{16, blocks}, threads);
  EngineConfig config;
  config.scheduler.max_num_seqs = sequences * beams;
  config.scheduler.max_batch_tokens = std::max(512, sequences * beams);
  auto engine = Engine::Create(*model, *std::move(backend), NewByteTokenizer(), config);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  std::printf("model %s: d_model %d, %d layers, %d heads, ffn %d, %s; %d sequences x (%d prompt + %d new tokens), %d threads, %d beams\n",
              c.name.c_str(), c.d_model, c.n_layers, c.n_heads, c.ffn_dim,
              std::string(SchemeName(c.rel.scheme)).c_str(), sequences, prompt_len, new_tokens, threads, beams);
  const std::vector<Request> work = Work(sequences, prompt_len, new_tokens, beams);
  int64_t tokens_seq = 0, tokens_batch = 0;
  Run(**engine, Work(1, prompt_len, 8), false, &tokens_seq);  // warm up
  const double seq = sequential ? Run(**engine, work, false, &tokens_seq) : 0.0;
  const int64_t steps_before = (*engine)->Stats().steps;
  const double batch = Run(**engine, work, true, &tokens_batch);
  const int64_t steps = (*engine)->Stats().steps - steps_before;
  if (sequential) {
    std::printf("one at a time: %6lld tokens in %7.2f s = %8.1f tokens/s\n", static_cast<long long>(tokens_seq), seq, tokens_seq / seq);
  }
  std::printf("%2d concurrent: %6lld tokens in %7.2f s = %8.1f tokens/s\n", sequences, static_cast<long long>(tokens_batch), batch, tokens_batch / batch);
  if (!sequential) return 0;
  std::printf("speedup: %.2fx (concurrent run: %lld steps, %.1f tokens per step)\n",
              (tokens_batch / batch) / (tokens_seq / seq), static_cast<long long>(steps),
              double(sequences) * (prompt_len + new_tokens) / std::max<int64_t>(steps, 1));
  return 0;
}

}  // namespace relgen::bench
