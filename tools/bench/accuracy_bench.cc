#include "tools/bench/accuracy_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include "nlohmann/json.hpp"

#include "engine/backends/cpu_backend.h"
#include "engine/backends/step_sync.h"
#include "engine/model/model.h"

namespace relgen::bench {
namespace {

using json = nlohmann::json;

// tools/train.py's held-out split: every data file of the fortunes directory in name order, split
// on "\n%\n", stripped, fortunes under 16 bytes dropped, every 20th kept as BOS + bytes + EOS.
std::vector<int32_t> HeldOutFortunes(const std::string& dir, int32_t bos, int32_t eos) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_symlink() || e.is_directory() || name.ends_with(".dat") || name.ends_with(".u8")) continue;
    files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<int32_t> held;
  int n = 0;
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t begin = 0;
    while (begin <= text.size()) {
      size_t end = text.find("\n%\n", begin);
      if (end == std::string::npos) end = text.size();
      std::string item = text.substr(begin, end - begin);
      const char* ws = " \t\n\r\v\f";
      const size_t a = item.find_first_not_of(ws);
      item = a == std::string::npos ? "" : item.substr(a, item.find_last_not_of(ws) - a + 1);
      if (item.size() >= 16) {
        if (n % 20 == 0) {
          held.push_back(bos);
          for (unsigned char c : item) held.push_back(c);
          held.push_back(eos);
        }
        ++n;
      }
      begin = end + 3;
    }
  }
  return held;
}

struct Run {
  std::unique_ptr<Backend> backend;
  std::vector<int32_t> table;
};

struct Precision {
  AccuracyWeights weights;
  cpu::KvType kv;
  std::string WeightsName() const {
    if (weights.inputs == ProjectionInputs::kBf16) return "mma";
    if (weights.inputs == ProjectionInputs::kBf16Dot) return "bf16-dot";
    return cpu::WeightTypeName(weights.type);
  }
  std::string Name() const { return WeightsName() + " / " + cpu::KvTypeName(kv); }
};

Run Make(const std::shared_ptr<const Model>& model, Precision p, int tokens, int threads) {
  const int bs = 16, blocks = (tokens + bs - 1) / bs;
  Run r{*NewCpuBackend(model, KvCacheConfig{bs, blocks}, threads, p.weights.type, p.kv, p.weights.inputs), {}};
  for (int i = 0; i < blocks; ++i) r.table.push_back(i);
  return r;
}

// Logits of every position of `tokens` [tokens.size(), vocab] in one prefill from position 0.
std::vector<float> AllLogits(Run& r, const std::vector<int32_t>& tokens) {
  std::vector<float> logits;
  SequenceStep s{tokens, 0, r.table, true};
  if (!ForwardLogits(*r.backend, {&s, 1}, &logits).ok()) logits.clear();
  return logits;
}

int Argmax(const float* x, int n) { return static_cast<int>(std::max_element(x, x + n) - x); }

// Greedy continuation of `prompt`, one decode step per token.
std::vector<int32_t> Greedy(Run& r, std::vector<int32_t> seq, int n, int vocab) {
  std::vector<float> logits;
  SequenceStep s{seq, 0, r.table, false};
  if (!ForwardLogits(*r.backend, {&s, 1}, &logits).ok()) return {};
  for (int i = 0; i < n; ++i) {
    seq.push_back(Argmax(logits.data(), vocab));
    if (i + 1 == n) break;
    SequenceStep d{absl::MakeConstSpan(&seq.back(), 1), static_cast<int>(seq.size()) - 1, r.table, false};
    if (!ForwardLogits(*r.backend, {&d, 1}, &logits).ok()) return {};
  }
  return seq;
}

double LogSoftmaxAt(const float* x, int n, int target) {
  const float m = *std::max_element(x, x + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(double(x[i]) - m);
  return double(x[target]) - m - std::log(sum);
}

}  // namespace

bool ParseAccuracyWeights(const std::string& name, AccuracyWeights* w) {
  if (name == "mma" || name == "bf16-dot") {
    *w = {cpu::WeightType::kBf16, name == "mma" ? ProjectionInputs::kBf16 : ProjectionInputs::kBf16Dot};
    return true;
  }
  *w = {};
  return cpu::ParseWeightType(name, &w->type);
}

int RunAccuracyBench(const AccuracyOptions& o) {
  auto loaded = Model::Load(o.model);
  if (!loaded.ok()) {
    std::fprintf(stderr, "relgen-bench: %s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  std::shared_ptr<const Model> model = *loaded;
  const ModelConfig& c = model->config();
  if (c.encoder_decoder) {
    std::fprintf(stderr, "relgen-bench accuracy: decoder-only models (%s is encoder-decoder)\n", o.model.c_str());
    return 2;
  }
  if (o.window + 1 > c.max_seq_len || o.greedy_tokens + 1 > c.max_seq_len) {
    std::fprintf(stderr, "relgen-bench accuracy: --window %d / --greedy_tokens %d exceed max_seq_len %d\n", o.window,
                 o.greedy_tokens, c.max_seq_len);
    return 2;
  }
  const std::vector<int32_t> held = HeldOutFortunes(o.fortunes, c.bos_token_id, c.eos_token_id);
  int windows = static_cast<int>((held.size() - std::min<size_t>(held.size(), 1)) / o.window);
  if (o.max_windows > 0) windows = std::min(windows, o.max_windows);
  if (windows == 0) {
    std::fprintf(stderr, "relgen-bench accuracy: no held-out text under %s (apt-get install fortunes)\n",
                 o.fortunes.c_str());
    return 2;
  }
  const int vocab = c.vocab_size;
  const int span = std::max(o.window, o.greedy_tokens + 1);
  std::printf("model %s; held-out fortunes: %zu tokens, %d windows of %d scored\n", o.model.c_str(), held.size(),
              windows, o.window);

  std::vector<Precision> kinds = {{{cpu::WeightType::kF32}, cpu::KvType::kF32}};
  for (const AccuracyWeights& w : o.weights) {
    for (cpu::KvType kv : o.kv_types) {
      if (w.type != cpu::WeightType::kF32 || kv != cpu::KvType::kF32) kinds.push_back({w, kv});
    }
  }
  std::vector<Run> runs;
  for (const Precision& p : kinds) runs.push_back(Make(model, p, span, o.threads));

  // Held-out windows: bits per byte of each precision, and each one's logits against f32's.
  const size_t k = kinds.size();
  std::vector<double> nll(k, 0), max_err(k, 0), max_rel(k, 0), top1(k, 0);
  for (int win = 0; win < windows; ++win) {
    const std::vector<int32_t> x(held.begin() + int64_t{win} * o.window, held.begin() + int64_t{win + 1} * o.window + 1);
    const std::vector<int32_t> input(x.begin(), x.end() - 1);
    std::vector<std::vector<float>> logits(k);
    for (size_t i = 0; i < k; ++i) {
      logits[i] = AllLogits(runs[i], input);
      if (logits[i].size() != size_t(o.window) * vocab) {
        std::fprintf(stderr, "relgen-bench accuracy: the backend failed\n");
        return 1;
      }
    }
    for (int p = 0; p < o.window; ++p) {
      const float* ref = logits[0].data() + int64_t{p} * vocab;
      const float ref_span = *std::max_element(ref, ref + vocab) - *std::min_element(ref, ref + vocab);
      for (size_t i = 0; i < k; ++i) {
        const float* l = logits[i].data() + int64_t{p} * vocab;
        nll[i] -= LogSoftmaxAt(l, vocab, x[p + 1]);
        double e = 0;
        for (int v = 0; v < vocab; ++v) e = std::max(e, std::fabs(double(l[v]) - ref[v]));
        max_err[i] = std::max(max_err[i], e);
        max_rel[i] = std::max(max_rel[i], e / ref_span);
        top1[i] += Argmax(l, vocab) == Argmax(ref, vocab);
      }
    }
    if ((win + 1) % 100 == 0 || win + 1 == windows) {
      std::printf("  scored %d of %d windows\n", win + 1, windows);
      std::fflush(stdout);
    }
  }

  // Greedy from BOS: free-running agreement with f32 (first divergence), and each precision's
  // argmax along f32's own greedy text (teacher-forced agreement).
  std::vector<int32_t> f32_text = Greedy(runs[0], {c.bos_token_id}, o.greedy_tokens, vocab);
  if (f32_text.empty()) return 1;
  const std::vector<int32_t> f32_input(f32_text.begin(), f32_text.end() - 1);
  json rows = json::array();
  const double scored = double(windows) * o.window;
  std::printf("\n%-12s | %-9s | %-30s | %-22s | %-24s | %-20s\n", "weights / KV", "bits/byte", "max |logit - f32|",
              "held-out top-1 = f32", "greedy: first divergence", "greedy, teacher-forced");
  for (size_t i = 0; i < k; ++i) {
    const std::vector<int32_t> text = i == 0 ? f32_text : Greedy(runs[i], {c.bos_token_id}, o.greedy_tokens, vocab);
    int first = o.greedy_tokens;
    for (int t = 1; t < static_cast<int>(text.size()); ++t) {
      if (text[t] != f32_text[t]) {
        first = t - 1;
        break;
      }
    }
    const std::vector<float> lf = AllLogits(runs[i], f32_input);
    int agree = 0;
    for (int t = 0; t < o.greedy_tokens; ++t) agree += Argmax(lf.data() + int64_t{t} * vocab, vocab) == f32_text[t + 1];
    const double bpb = nll[i] / scored / std::log(2.0);
    char err[64];
    std::snprintf(err, sizeof err, "%.2e (%.2e of range)", max_err[i], max_rel[i]);
    std::printf("%-12s | %-9.5f | %-30s | %-22s | %-24s | %d of %d\n", kinds[i].Name().c_str(), bpb, err,
                (std::to_string(int64_t(top1[i])) + " of " + std::to_string(int64_t(scored))).c_str(),
                first == o.greedy_tokens ? "none" : ("token " + std::to_string(first)).c_str(), agree,
                o.greedy_tokens);
    rows.push_back({{"weights", kinds[i].WeightsName()}, {"kv_cache", cpu::KvTypeName(kinds[i].kv)}, {"bits_per_byte", bpb}, {"max_abs_logit_error", max_err[i]},
                    {"max_logit_error_of_range", max_rel[i]}, {"held_out_top1_agreement", top1[i] / scored},
                    {"greedy_first_divergence", first == o.greedy_tokens ? json(nullptr) : json(first)},
                    {"greedy_teacher_forced_agreement", agree}, {"greedy_tokens", o.greedy_tokens}});
  }
  std::printf("\nbits/byte: mean -log2 p of each held-out byte (%d windows of %d, as tools/train.py); max |logit - f32|\n"
              "over every held-out position and vocabulary entry (and as a fraction of f32's logit range there);\n"
              "greedy: %d tokens from BOS, the first token that differs from f32's, and how many of f32's greedy\n"
              "tokens each precision also picks when fed f32's text.\n",
              windows, o.window, o.greedy_tokens);
  if (!o.json_out.empty()) {
    std::ofstream(o.json_out) << json({{"model", o.model}, {"windows", windows}, {"window", o.window},
                                       {"held_out_tokens", held.size()}, {"results", rows}}).dump(2);
  }
  return 0;
}

}  // namespace relgen::bench
