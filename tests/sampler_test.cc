// Sampling against hand-derived distributions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "engine/core/sampler.h"

namespace relgen {
namespace {

std::vector<float> LogitsOf(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

// Empirical frequencies over `n` draws (token index varies the random draw).
std::map<int32_t, double> Frequencies(const std::vector<float>& logits, const SamplingParams& p, int n) {
  std::vector<float> scratch;
  std::map<int32_t, double> f;
  for (int i = 0; i < n; ++i) f[Sample(logits, p, {}, i, &scratch).token] += 1.0 / n;
  return f;
}

TEST(SamplerTest, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> scratch;
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(Sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}, p, {}, 0, &scratch).token, 1);
}

TEST(SamplerTest, TemperatureOneFollowsTheSoftmax) {
  const std::vector<double> probs = {0.5, 0.3, 0.15, 0.05};
  SamplingParams p;
  p.seed = 7;
  const auto f = Frequencies(LogitsOf(probs), p, 40000);
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(f.count(t) ? f.at(t) : 0.0, probs[t], 0.01) << t;
}

TEST(SamplerTest, TemperatureSharpens) {
  // T = 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 normalised.
  const std::vector<double> probs = {0.5, 0.3, 0.15, 0.05};
  SamplingParams p;
  p.temperature = 0.5f;
  const auto f = Frequencies(LogitsOf(probs), p, 40000);
  const double z = 0.25 + 0.09 + 0.0225 + 0.0025;
  EXPECT_NEAR(f.at(0), 0.25 / z, 0.01);
  EXPECT_NEAR(f.at(1), 0.09 / z, 0.01);
}

TEST(SamplerTest, TopKAndTopPCut) {
  const std::vector<double> probs = {0.1, 0.5, 0.3, 0.1};
  SamplingParams k;
  k.top_k = 2;  // tokens 1 and 2, renormalised 5:3
  auto f = Frequencies(LogitsOf(probs), k, 20000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[1], 0.625, 0.015);
  SamplingParams tp;
  tp.top_p = 0.6f;  // 0.5 < 0.6 <= 0.8: tokens 1 and 2
  f = Frequencies(LogitsOf(probs), tp, 20000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[2], 0.375, 0.015);
  tp.top_p = 0.5f;  // exactly reached by token 1 alone
  f = Frequencies(LogitsOf(probs), tp, 2000);
  EXPECT_EQ(f.size(), 1u);
  EXPECT_EQ(f.begin()->first, 1);
}

TEST(SamplerTest, SameSeedAndIndexSameToken) {
  const std::vector<float> logits = {0.3f, 0.1f, 0.2f, 0.25f, 0.15f};
  SamplingParams p;
  p.seed = 99;
  std::vector<float> scratch;
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(Sample(logits, p, {}, i, &scratch).token, Sample(logits, p, {}, i, &scratch).token);
  }
  EXPECT_NE(SampleUniform(99, 0), SampleUniform(100, 0));
  EXPECT_NE(SampleUniform(99, 0), SampleUniform(99, 1));
}

TEST(SamplerTest, RepetitionPenalty) {
  // Token 0 (logit 2) seen: 2/2 = 1 < token 1's 1.5. Token 2 (logit -1) seen: -1*2 = -2.
  std::vector<float> scratch;
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  const std::vector<float> logits = {2.0f, 1.5f, -1.0f};
  const std::vector<int32_t> history = {0, 0, 2};
  EXPECT_EQ(Sample(logits, p, history, 0, &scratch).token, 1);
  p.repetition_penalty = 1.0f;
  EXPECT_EQ(Sample(logits, p, history, 0, &scratch).token, 0);
}

TEST(SamplerTest, LogprobsOfTheRawDistribution) {
  const std::vector<double> probs = {0.1, 0.6, 0.3};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 3.0f;  // changes the choice, not the reported log-probabilities
  p.logprobs = 2;
  std::vector<float> scratch;
  const SampleResult r = Sample(LogitsOf(probs), p, std::vector<int32_t>{1}, 0, &scratch);
  EXPECT_EQ(r.token, 2);
  EXPECT_NEAR(r.logprob, std::log(0.3), 1e-6);
  ASSERT_EQ(r.top.size(), 2u);
  EXPECT_EQ(r.top[0].token, 1);
  EXPECT_NEAR(r.top[0].logprob, std::log(0.6), 1e-6);
  EXPECT_EQ(r.top[1].token, 2);
}

}  // namespace
}  // namespace relgen
