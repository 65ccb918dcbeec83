#include "tools/bench/sample_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/backends/sampler.h"
#include "kernels/thread_pool.h"

namespace relgen::bench {

int RunSampleBench(const SampleBenchOptions& o) {
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu::ThreadPool pool(threads);
  // Logits as a trained model's are spread: N(0, 3), so top_p 0.9 keeps a few percent of the vocabulary.
  std::vector<float> logits(static_cast<size_t>(o.vocab) * o.rows);
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (float& x : logits) x = d(rng);
  std::vector<int32_t> history;
  for (int i = 0; i < 256; ++i) history.push_back(static_cast<int32_t>(rng() % o.vocab));

  struct Control {
    std::string name;
    SamplingParams p;
  };
  std::vector<Control> controls(6);
  controls[0].name = "greedy";
  controls[0].p.temperature = 0;
  controls[1].name = "temperature 0.8";
  controls[1].p.temperature = 0.8f;
  controls[2].name = "top_p 0.9, T 0.8";
  controls[2].p.temperature = 0.8f;
  controls[2].p.top_p = 0.9f;
  controls[3].name = "top_k 50, T 0.8";
  controls[3].p.temperature = 0.8f;
  controls[3].p.top_k = 50;
  controls[4].name = "top_k 50, top_p 0.9, penalty 1.2";
  controls[4].p.temperature = 0.8f;
  controls[4].p.top_k = 50;
  controls[4].p.top_p = 0.9f;
  controls[4].p.repetition_penalty = 1.2f;
  controls[5].name = "greedy, logprobs 5";
  controls[5].p.temperature = 0;
  controls[5].p.logprobs = 5;
  // The controls beside the penalty, on a history whose last 128 tokens are the output.
  auto add = [&](const std::string& name, auto set) {
    Control c{name, {}};
    c.p.temperature = 0.8f;
    set(c.p);
    controls.push_back(c);
  };
  add("T 0.8, presence+frequency 0.5", [](SamplingParams& p) { p.presence_penalty = p.frequency_penalty = 0.5f; });
  add("T 0.8, logit_bias 100, 8 bad words", [&](SamplingParams& p) {
    for (int i = 0; i < 100; ++i) p.logit_bias.emplace_back(i * (o.vocab / 100), 1.5f);
    for (int i = 0; i < 8; ++i) p.bad_words.push_back({history[i], history[i + 1]});
  });
  add("T 0.8, min_p 0.05", [](SamplingParams& p) { p.min_p = 0.05f; });
  add("T 0.8, allowed_token_ids 4096", [&](SamplingParams& p) {
    for (int i = 0; i < 4096; ++i) p.allowed_token_ids.push_back(i * (o.vocab / 4096));
  });

  const ParallelFor on_pool = [&](int n, const std::function<void(int, int)>& fn) { pool.ParallelFor(n, fn); };
  std::vector<std::vector<double>> ms(controls.size());
  std::vector<SampleResult> results;
  for (int rep = 0; rep < o.reps; ++rep) {  // interleaved: every control once per repetition
    for (size_t c = 0; c < controls.size(); ++c) {
      std::vector<RowQuery> queries(o.rows);
      for (int r = 0; r < o.rows; ++r) {
        queries[r].row = r;
        queries[r].params = &controls[c].p;
        queries[r].history = history;
        queries[r].index = 128 + rep;
      }
      const auto t0 = std::chrono::steady_clock::now();
      AnswerQueries(logits.data(), o.vocab, queries, &results, on_pool);
      ms[c].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::printf("sampler: %d rows of vocabulary %d on %d threads, %d interleaved repetitions\n", o.rows, o.vocab,
              threads, o.reps);
  std::printf("%-36s %12s %20s %14s\n", "control", "ms per step", "range", "ms per row");
  for (size_t c = 0; c < controls.size(); ++c) {
    std::vector<double>& v = ms[c];
    std::sort(v.begin(), v.end());
    const double med = v[v.size() / 2];
    std::printf("%-36s %12.3f %9.3f..%-9.3f %14.3f\n", controls[c].name.c_str(), med, v.front(), v.back(),
                med * threads / o.rows);
  }
  return 0;
}

}  // namespace relgen::bench
