// The sampling definitions of engine/backends/sampler.h in float64, written the plain way (a sort),
// as the independent reference for the host and device samplers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backends/sampler.h"

namespace relgen {

// The processed logits in float64: penalty; OpenAI's presence and frequency penalties over the
// output (the history's last `index` tokens); the bias; -inf outside the allowed ids, for a bad
// word's last token when the history ends with the rest of it, and for the min_tokens bans.
inline std::vector<double> ReferenceLogits(const std::vector<float>& logits, const SamplingParams& p,
                                           const std::vector<int32_t>& history, int index) {
  const int v = static_cast<int>(logits.size());
  std::vector<double> x(logits.begin(), logits.end());
  std::vector<bool> seen(v, false);
  for (int32_t t : history) {
    if (seen[t] || p.repetition_penalty == 1.0f) continue;
    seen[t] = true;
    x[t] = x[t] > 0 ? x[t] / p.repetition_penalty : x[t] * p.repetition_penalty;
  }
  std::vector<int> count(v, 0);
  for (size_t j = history.size() - std::min<size_t>(history.size(), index); j < history.size(); ++j) ++count[history[j]];
  for (int t = 0; t < v; ++t) {
    x[t] -= count[t] * static_cast<double>(p.frequency_penalty) + (count[t] > 0 ? p.presence_penalty : 0.0);
  }
  for (const auto& [t, b] : p.logit_bias) x[t] += b;
  if (!p.allowed_token_ids.empty()) {
    for (int t = 0; t < v; ++t) {
      if (std::find(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), t) == p.allowed_token_ids.end()) {
        x[t] = -INFINITY;
      }
    }
  }
  for (const std::vector<int32_t>& w : p.bad_words) {
    const size_t k = w.size() - 1;
    if (k <= history.size() && std::vector<int32_t>(w.begin(), w.end() - 1) ==
                                   std::vector<int32_t>(history.end() - k, history.end())) {
      x[w.back()] = -INFINITY;
    }
  }
  if (index < p.min_tokens) {
    for (int32_t t : p.min_tokens_banned) x[t] = -INFINITY;
  }
  // transformers' NoRepeatNGramLogitsProcessor: the n-grams by their first n - 1 tokens.
  const size_t n = p.no_repeat_ngram_size;
  if (n > 0 && history.size() + 1 >= n) {
    std::map<std::vector<int32_t>, std::vector<int32_t>> ngrams;
    for (size_t i = 0; i + n <= history.size(); ++i) {
      ngrams[std::vector<int32_t>(history.begin() + i, history.begin() + i + n - 1)].push_back(history[i + n - 1]);
    }
    const std::vector<int32_t> last(history.end() - (n - 1), history.end());
    for (int32_t t : ngrams[last]) x[t] = -INFINITY;
  }
  return x;
}

// The reference: the processed logits, then softmax at temperature in float64, candidates sorted
// (w descending, lower id first), top-k, the shortest prefix reaching top_p of the kept mass, then
// those with w >= min_p (of the largest, 1). All zero when every token is banned.
inline std::vector<double> ReferenceProbs(const std::vector<float>& logits, const SamplingParams& p,
                                          const std::vector<int32_t>& history, int index = 0) {
  const int v = static_cast<int>(logits.size());
  const std::vector<double> x = ReferenceLogits(logits, p, history, index);
  std::vector<double> probs(v, 0.0);
  if (*std::max_element(x.begin(), x.end()) == -INFINITY) return probs;
  if (p.temperature == 0) {
    probs[std::max_element(x.begin(), x.end()) - x.begin()] = 1;
    return probs;
  }
  const double mx = *std::max_element(x.begin(), x.end());
  std::vector<double> w(v);
  for (int i = 0; i < v; ++i) w[i] = std::exp((x[i] - mx) / p.temperature);
  std::vector<int> order(v);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return w[a] > w[b]; });
  int keep = p.top_k > 0 ? std::min(p.top_k, v) : v;
  double total = 0;
  for (int i = 0; i < keep; ++i) total += w[order[i]];
  if (p.top_p < 1.0f) {
    double cum = 0;
    int n = 0;
    while (n < keep && cum < p.top_p * total) cum += w[order[n++]];
    keep = n;
    total = cum;
  }
  if (p.min_p > 0) {
    while (keep > 1 && w[order[keep - 1]] < p.min_p) --keep;
    total = 0;
    for (int i = 0; i < keep; ++i) total += w[order[i]];
  }
  for (int i = 0; i < keep; ++i) probs[order[i]] = w[order[i]] / total;
  return probs;
}

// The controls beside the penalty (presence and frequency penalties, logit bias, allowed ids, bad
// words, min_tokens, min_p), alone and with temperature, top-k, top-p and the repetition penalty:
// the draw's distribution is the reference's exactly, and greedy takes the reference's argmax.
// The history is a prompt of 5 tokens and an output of 7 (index 7).
inline std::vector<SamplingParams> ControlCases() {
  std::vector<SamplingParams> cases;
  auto add = [&](float t, int k, float top_p, auto set) {
    SamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = top_p;
    set(p);
    cases.push_back(p);
  };
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.presence_penalty = 1.5f; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.frequency_penalty = 0.9f; });
  add(0.8f, 0, 1.0f, [](SamplingParams& p) { p.presence_penalty = -0.7f, p.frequency_penalty = -1.2f; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.logit_bias = {{2, 3.5f}, {11, -100.0f}, {40, 1.25f}}; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.allowed_token_ids = {1, 4, 9, 17, 33, 40}; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.bad_words = {{6}, {3, 17, 21}, {17, 8}, {9, 9, 12}}; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.min_tokens = 8, p.min_tokens_banned = {0, 5, 30}; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.min_tokens = 7, p.min_tokens_banned = {0, 5, 30}; });
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.min_p = 0.1f; });
  add(0.5f, 0, 1.0f, [](SamplingParams& p) { p.min_p = 0.02f; });
  add(1.4f, 12, 0.9f, [](SamplingParams& p) { p.min_p = 0.05f, p.presence_penalty = 0.5f, p.logit_bias = {{7, 2.0f}}; });
  add(0.7f, 0, 0.8f, [](SamplingParams& p) {
    p.repetition_penalty = 1.3f, p.frequency_penalty = 0.4f, p.bad_words = {{17, 21}}, p.allowed_token_ids = {};
  });
  add(1.2f, 20, 1.0f, [](SamplingParams& p) {
    p.allowed_token_ids = {0, 2, 3, 5, 7, 11, 13, 17, 19, 21, 23, 29, 31, 37, 41, 43, 47};
    p.logit_bias = {{3, -2.0f}, {29, 4.0f}};
    p.min_tokens = 10, p.min_tokens_banned = {2};
    p.bad_words = {{41}, {21, 13}};
    p.min_p = 0.01f;
    p.repetition_penalty = 0.8f;
  });
  add(0.0f, 0, 1.0f, [](SamplingParams& p) { p.presence_penalty = 2.0f, p.frequency_penalty = 2.0f; });
  add(0.0f, 0, 1.0f, [](SamplingParams& p) { p.logit_bias = {{1, 5.0f}}, p.bad_words = {{21, 1}}; });
  add(0.0f, 0, 1.0f, [](SamplingParams& p) { p.allowed_token_ids = {8, 30, 44}, p.min_tokens = 9, p.min_tokens_banned = {44}; });
  // The history ends 3 17 21 and holds 3 17 twice and 17 9 / 17 40 / 17 21 once each.
  add(1.0f, 0, 1.0f, [](SamplingParams& p) { p.no_repeat_ngram_size = 1; });
  add(0.9f, 0, 1.0f, [](SamplingParams& p) { p.no_repeat_ngram_size = 2; });
  add(0.0f, 0, 1.0f, [](SamplingParams& p) { p.no_repeat_ngram_size = 1, p.logit_bias = {{40, 10.0f}}; });
  return cases;
}

// Beam search's candidates (sampler.h, BeamCandidates): log_softmax of the raw logits with the
// processing applied, the n best unbanned (larger first, lower id first), in float64.
inline std::vector<TokenLogprob> ReferenceBeamCandidates(const std::vector<float>& logits, const SamplingParams& p,
                                                         const std::vector<int32_t>& history, int index, int n) {
  const std::vector<double> x = ReferenceLogits(logits, p, history, index);
  const double mx = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (float l : logits) z += std::exp(l - mx);
  const double log_z = mx + std::log(z);
  std::vector<int> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return x[a] > x[b]; });
  std::vector<TokenLogprob> out;
  for (int i : order) {
    if (static_cast<int>(out.size()) == n || x[i] == -INFINITY) break;
    out.push_back({i, static_cast<float>(x[i] - log_z)});
  }
  return out;
}

inline std::string Describe(const SamplingParams& p) {
  std::string s = absl::StrCat("T ", p.temperature, " top_k ", p.top_k, " top_p ", p.top_p, " rep ", p.repetition_penalty,
                               " presence ", p.presence_penalty, " frequency ", p.frequency_penalty, " min_p ", p.min_p,
                               " min_tokens ", p.min_tokens, " bias ", p.logit_bias.size(), " allowed ",
                               p.allowed_token_ids.size(), " bad words ", p.bad_words.size(), " no_repeat_ngram_size ",
                               p.no_repeat_ngram_size);
  return s;
}

inline const std::vector<int32_t> kControlHistory = {4, 9, 17, 3, 12, /*output:*/ 17, 9, 17, 40, 3, 17, 21};
inline constexpr int kControlIndex = 7;

// `n` logits drawn from N(0, scale), reproducible by `seed`.
inline std::vector<float> NormalLogits(int n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> l(n);
  for (float& x : l) x = d(rng);
  return l;
}

}  // namespace relgen
