#include "engine/core/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace relgen {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

double SampleUniform(uint64_t seed, int index) {
  const uint64_t bits = SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(index));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

SampleResult TokenLogprobs(absl::Span<const float> logits, int32_t token, int top_n, double log_z) {
  const int v = static_cast<int>(logits.size());
  if (std::isnan(log_z)) {
    float mx = -INFINITY;
    for (float l : logits) mx = std::max(mx, l);
    double z = 0;
    for (float l : logits) z += std::exp(static_cast<double>(l) - mx);
    log_z = mx + std::log(z);
  }
  SampleResult out;
  out.token = token;
  out.logprob = static_cast<float>(logits[token] - log_z);
  const int n = std::min(top_n, v);
  if (n > 0) {
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int i = 0; i < n; ++i) out.top.push_back({order[i], static_cast<float>(logits[order[i]] - log_z)});
  }
  return out;
}

SampleResult Sample(absl::Span<const float> logits, const SamplingParams& p,
                    absl::Span<const int32_t> history, int index, std::vector<float>* scratch) {
  const int v = static_cast<int>(logits.size());
  SampleResult out;

  // Log-probabilities of the model's own distribution.
  float mx = -INFINITY;
  for (float l : logits) mx = std::max(mx, l);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l) - mx);
  const double log_z = mx + std::log(z);

  std::vector<float>& x = *scratch;
  x.assign(logits.begin(), logits.end());
  if (p.repetition_penalty != 1.0f) {
    // Once per distinct token: divide positive logits, multiply negative ones.
    std::vector<bool> seen(v, false);
    for (int32_t t : history) {
      if (t < 0 || t >= v || seen[t]) continue;
      seen[t] = true;
      x[t] = x[t] > 0 ? x[t] / p.repetition_penalty : x[t] * p.repetition_penalty;
    }
  }

  if (p.temperature == 0.0f) {
    out.token = static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
  } else {
    // Candidates: every id in id order, or, when top-k or top-p cut them, the most likely first
    // (ties: lower id first) and only the first `keep`.
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
    int keep = v;
    if (p.top_k > 0 && p.top_k < v) keep = p.top_k;
    if (keep < v || p.top_p < 1.0f) std::partial_sort(order.begin(), order.begin() + keep, order.end(), better);
    const double top = *std::max_element(x.begin(), x.end());
    const double inv_t = 1.0 / p.temperature;
    std::vector<double> w(keep);
    double total = 0;
    for (int i = 0; i < keep; ++i) total += (w[i] = std::exp((x[order[i]] - top) * inv_t));
    if (p.top_p < 1.0f) {  // smallest most-likely prefix whose mass reaches top_p
      double cum = 0;
      int n = 0;
      while (n < keep && cum < p.top_p * total) cum += w[n++];
      keep = n;
      total = cum;
    }
    const double target = SampleUniform(p.seed, index) * total;
    double cum = 0;
    out.token = order[keep - 1];
    for (int i = 0; i < keep; ++i) {
      cum += w[i];
      if (target < cum) {
        out.token = order[i];
        break;
      }
    }
  }

  if (p.logprobs >= 0) {
    const int32_t token = out.token;
    out = TokenLogprobs(logits, token, p.logprobs, log_z);
  }
  return out;
}

}  // namespace relgen
