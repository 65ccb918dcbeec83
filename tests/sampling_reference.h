// The sampling definitions of engine/backends/sampler.h in float64, written the plain way (a sort),
// as the independent reference for the host and device samplers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "engine/backends/sampler.h"

namespace relgen {

// The reference: penalty, then softmax at temperature in float64, candidates sorted (w descending,
// lower id first), top-k, then the shortest prefix reaching top_p of the kept mass.
inline std::vector<double> ReferenceProbs(const std::vector<float>& logits, const SamplingParams& p,
                                   const std::vector<int32_t>& history) {
  const int v = static_cast<int>(logits.size());
  std::vector<double> x(logits.begin(), logits.end());
  std::vector<bool> seen(v, false);
  for (int32_t t : history) {
    if (seen[t] || p.repetition_penalty == 1.0f) continue;
    seen[t] = true;
    x[t] = x[t] > 0 ? x[t] / p.repetition_penalty : x[t] * p.repetition_penalty;
  }
  std::vector<double> probs(v, 0.0);
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
  for (int i = 0; i < keep; ++i) probs[order[i]] = w[order[i]] / total;
  return probs;
}

// `n` logits drawn from N(0, scale), reproducible by `seed`.
inline std::vector<float> NormalLogits(int n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> l(n);
  for (float& x : l) x = d(rng);
  return l;
}

}  // namespace relgen
