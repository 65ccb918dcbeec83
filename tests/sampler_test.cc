// Sampling against hand-derived distributions and an independent float64 reference of the
// definitions in engine/backends/sampler.h (sort-based, as the seeds and transformers state them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backends/sampler.h"
#include "kernels/philox.h"
#include "tests/sampling_reference.h"

namespace relgen {
namespace {

std::vector<float> LogitsOf(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

// Empirical frequencies over `n` draws (token index varies the random draw).
std::map<int32_t, double> Frequencies(const std::vector<float>& logits, const SamplingParams& p, int n) {
  SamplerScratch scratch;
  std::map<int32_t, double> f;
  for (int i = 0; i < n; ++i) f[Sample(logits, p, {}, i, &scratch).token] += 1.0 / n;
  return f;
}

// Sweeps the draw over a grid of u: the share of u choosing each token is its probability to
// within the grid's spacing, exactly, with no statistical slack.
void ExpectExactDistribution(const std::vector<float>& logits, const SamplingParams& p,
                             const std::vector<int32_t>& history, int index = 0) {
  const std::vector<double> ref = ReferenceProbs(logits, p, history, index);
  constexpr int kGrid = 30000;
  std::vector<double> share(logits.size(), 0.0);
  SamplerScratch scratch;
  for (int j = 0; j < kGrid; ++j) {
    share[DrawToken(logits, p, history, (j + 0.5) / kGrid, &scratch, index)] += 1.0 / kGrid;
  }
  int kept = 0;
  for (size_t t = 0; t < ref.size(); ++t) {
    if (ref[t] == 0) {
      EXPECT_EQ(share[t], 0.0) << "token " << t << " is cut but drawn";
    } else {
      ++kept;
      EXPECT_NEAR(share[t], ref[t], 2.0 / kGrid + 1e-6) << "token " << t;
    }
  }
  EXPECT_GT(kept, 0);
}

TEST(PhiloxTest, KnownAnswers) {
  // Random123's known-answer vectors for philox4x32_10.
  auto run = [](philox::U32x4 c, uint32_t k0, uint32_t k1) { return philox::Philox4x32_10(c, k0, k1); };
  philox::U32x4 r = run({{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = run({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = run({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(SamplerTest, GreedyIsArgmaxWithLowestIdOnTies) {
  SamplerScratch scratch;
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(Sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}, p, {}, 0, &scratch).token, 1);
  const std::vector<float> big = NormalLogits(250880, 3, 2.0f);
  EXPECT_EQ(Sample(big, p, {}, 0, &scratch).token, std::max_element(big.begin(), big.end()) - big.begin());
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

TEST(SamplerTest, TiesAtTheCutKeepLowerIds) {
  // Three equal best tokens (1, 2, 3); top_k 2 keeps 1 and 2, half each.
  SamplingParams p;
  p.top_k = 2;
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  ExpectExactDistribution(logits, p, {});
  SamplerScratch scratch;
  EXPECT_EQ(DrawToken(logits, p, {}, 0.25, &scratch), 1);
  EXPECT_EQ(DrawToken(logits, p, {}, 0.75, &scratch), 2);
  // top_p reaching its mass inside the tie: one of three equal thirds (w 1, 1, 1 and tiny ones)
  // reaches 0.3 of the mass, so id 1 alone stays.
  SamplingParams q;
  q.top_p = 0.3f;
  const std::vector<float> tied = {-30.0f, 0.0f, 0.0f, 0.0f, -30.0f};
  ExpectExactDistribution(tied, q, {});
  EXPECT_EQ(DrawToken(tied, q, {}, 0.99, &scratch), 1);
}

// Every control alone and combined, on random rows of a few sizes: the draw's distribution is the
// reference's exactly.
TEST(SamplerTest, ExactDistributionPerControl) {
  struct Case {
    float temperature;
    int top_k;
    float top_p;
    float penalty;
  };
  const std::vector<Case> cases = {
      {1.0f, 0, 1.0f, 1.0f},  {0.7f, 0, 1.0f, 1.0f},   {1.3f, 0, 1.0f, 1.0f},  {1.0f, 17, 1.0f, 1.0f},
      {1.0f, 0, 0.9f, 1.0f},  {1.0f, 0, 0.35f, 1.0f},  {1.0f, 0, 1.0f, 1.8f},  {0.8f, 40, 0.9f, 1.0f},
      {0.6f, 25, 0.8f, 1.3f}, {1.5f, 200, 0.95f, 0.7f}, {0.9f, 1, 1.0f, 1.0f},
  };
  const std::vector<int32_t> history = {3, 17, 17, 40, 299, 5, 3, 128};
  for (int v : {300, 1000}) {
    const std::vector<float> logits = NormalLogits(v, 11 + v, 1.5f);
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << "vocab " << v << " T " << c.temperature << " top_k " << c.top_k
                                      << " top_p " << c.top_p << " penalty " << c.penalty);
      SamplingParams p;
      p.temperature = c.temperature;
      p.top_k = c.top_k;
      p.top_p = c.top_p;
      p.repetition_penalty = c.penalty;
      ExpectExactDistribution(logits, p, history);
    }
  }
}

// The controls beside the penalty, alone and with temperature, top-k, top-p and the repetition
// penalty (tests/sampling_reference.h, ControlCases): the draw's distribution is the reference's
// exactly, and greedy takes the reference's argmax.
TEST(SamplerTest, ControlsMatchTheReference) {
  for (int v : {48, 300}) {
    const std::vector<float> logits = NormalLogits(v, 5 + v, 1.5f);
    for (const SamplingParams& p : ControlCases()) {
      SCOPED_TRACE(testing::Message() << "vocab " << v << " " << Describe(p));
      if (p.temperature > 0) {
        ExpectExactDistribution(logits, p, kControlHistory, kControlIndex);
      } else {
        const std::vector<double> ref = ReferenceProbs(logits, p, kControlHistory, kControlIndex);
        SamplerScratch scratch;
        EXPECT_EQ(ref[Sample(logits, p, kControlHistory, kControlIndex, &scratch).token], 1.0);
      }
    }
  }
}

// Beam search's candidates under every control case: the reference's tokens in its order, their
// processed log-probabilities within float rounding; banned tokens never appear.
TEST(SamplerTest, BeamCandidatesMatchTheReference) {
  for (int v : {48, 300}) {
    const std::vector<float> logits = NormalLogits(v, 7 + v, 2.0f);
    for (const SamplingParams& p : ControlCases()) {
      for (int n : {1, 4, 32}) {
        SCOPED_TRACE(testing::Message() << "vocab " << v << " n " << n << " " << Describe(p));
        const std::vector<TokenLogprob> want = ReferenceBeamCandidates(logits, p, kControlHistory, kControlIndex, n);
        SamplerScratch scratch;
        const SampleResult got = BeamCandidates(logits, p, kControlHistory, kControlIndex, n, &scratch);
        ASSERT_EQ(got.top.size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_EQ(got.top[i].token, want[i].token) << i;
          EXPECT_NEAR(got.top[i].logprob, want[i].logprob, 2e-6) << i;
        }
        EXPECT_EQ(got.token, want.empty() ? -1 : want[0].token);
      }
    }
  }
  // Fewer unbanned tokens than asked: only those; none: token -1.
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 1.0f};
  SamplingParams p;
  p.allowed_token_ids = {0, 2};
  SamplerScratch scratch;
  SampleResult r = BeamCandidates(logits, p, {}, 0, 4, &scratch);
  ASSERT_EQ(r.top.size(), 2u);
  const double log_z = std::log(std::exp(0.5) + std::exp(2.0) + std::exp(-1.0) + std::exp(1.0));
  EXPECT_EQ(r.top[0].token, 0);
  EXPECT_NEAR(r.top[0].logprob, 0.5 - log_z, 1e-6);
  EXPECT_EQ(r.top[1].token, 2);
  EXPECT_NEAR(r.top[1].logprob, -1.0 - log_z, 1e-6);
  p.bad_words = {{0}, {2}};
  r = BeamCandidates(logits, p, {}, 0, 4, &scratch);
  EXPECT_EQ(r.token, -1);
  EXPECT_TRUE(r.top.empty());
}

// Each control changes what is drawn in the way its definition says, on a row where the effect is
// known by hand.
TEST(SamplerTest, ControlsByHand) {
  SamplerScratch scratch;
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, 0.0f};
  auto greedy = [&](SamplingParams p, std::vector<int32_t> history, int index) {
    p.temperature = 0;
    return Sample(logits, p, history, index, &scratch).token;
  };
  SamplingParams p;
  EXPECT_EQ(greedy(p, {}, 0), 0);
  p.presence_penalty = 0.9f;  // 2 - 0.9 = 1.1 > 1: still 0; twice with frequency 0.1: 2 - 0.2 - 0.9 = 0.9 < 1
  EXPECT_EQ(greedy(p, {0}, 1), 0);
  p.frequency_penalty = 0.1f;
  EXPECT_EQ(greedy(p, {0, 0}, 2), 1);
  EXPECT_EQ(greedy(p, {0, 0}, 0), 0) << "the prompt's tokens are not the output's";
  p = {};
  p.logit_bias = {{3, 2.5f}};  // 0 + 2.5 > 2
  EXPECT_EQ(greedy(p, {}, 0), 3);
  p = {};
  p.allowed_token_ids = {1, 2};
  EXPECT_EQ(greedy(p, {}, 0), 1);
  p = {};
  p.bad_words = {{2, 0}};
  EXPECT_EQ(greedy(p, {1}, 1), 0);
  EXPECT_EQ(greedy(p, {2}, 1), 1);
  p = {};
  p.min_tokens = 2;
  p.min_tokens_banned = {0};
  EXPECT_EQ(greedy(p, {}, 1), 1);
  EXPECT_EQ(greedy(p, {}, 2), 0);
  // no_repeat_ngram_size: 2 bans 0 after 1 0 1 (1 0 seen); 3 bans nothing there (no 0 1 x) and 0
  // after 0 1 0 1 (0 1 0 seen); 1 bans every token seen.
  p = {};
  p.no_repeat_ngram_size = 2;
  EXPECT_EQ(greedy(p, {1, 0, 1}, 3), 1);
  EXPECT_EQ(greedy(p, {0, 1}, 2), 0);
  p.no_repeat_ngram_size = 3;
  EXPECT_EQ(greedy(p, {1, 0, 1}, 3), 0);
  EXPECT_EQ(greedy(p, {0, 1, 0, 1}, 4), 1);
  EXPECT_EQ(greedy(p, {0, 1}, 2), 0) << "no 3-gram yet";
  p.no_repeat_ngram_size = 1;
  EXPECT_EQ(greedy(p, {0, 1}, 0), 2);
  // Every token banned: nothing is drawn, greedy or sampled.
  p = {};
  p.allowed_token_ids = {2};
  p.bad_words = {{2}};
  EXPECT_EQ(greedy(p, {}, 0), -1);
  p.temperature = 0.7f;
  EXPECT_EQ(Sample(logits, p, {}, 0, &scratch).token, -1);
  // min_p 0.5 at temperature 1: w = exp(x - 2) keeps 1 (w 1) and 0.37 < 0.5 cuts token 1.
  p = {};
  p.min_p = 0.5f;
  for (double u : {0.0, 0.5, 0.999}) EXPECT_EQ(DrawToken(logits, p, {}, u, &scratch), 0);
  p.min_p = 0.3f;  // keeps 0 and 1 (w 0.368): u past 1 / 1.368 draws token 1
  EXPECT_EQ(DrawToken(logits, p, {}, 0.7, &scratch), 0);
  EXPECT_EQ(DrawToken(logits, p, {}, 0.75, &scratch), 1);
}

// A full BLOOM-sized row: draws land only on the reference's kept tokens, the kept set's first and
// last ids are the reference's, and a grid of draws picks the reference's token or, within
// rounding of a boundary, its kept neighbour.
TEST(SamplerTest, LargeVocabularyCutsMatchTheReference) {
  const int v = 250880;
  const std::vector<float> logits = NormalLogits(v, 5, 3.0f);
  for (const auto& [k, top_p] : std::vector<std::pair<int, float>>{{50, 1.0f}, {0, 0.9f}, {0, 0.5f}, {1000, 0.9f}}) {
    SCOPED_TRACE(testing::Message() << "top_k " << k << " top_p " << top_p);
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_k = k;
    p.top_p = top_p;
    const std::vector<double> ref = ReferenceProbs(logits, p, {});
    std::vector<int32_t> kept;
    std::vector<double> cum;
    double c = 0;
    for (int i = 0; i < v; ++i) {
      if (ref[i] > 0) {
        kept.push_back(i);
        cum.push_back(c += ref[i]);
      }
    }
    ASSERT_FALSE(kept.empty());
    SamplerScratch scratch;
    EXPECT_EQ(DrawToken(logits, p, {}, 0.0, &scratch), kept.front());
    EXPECT_EQ(DrawToken(logits, p, {}, std::nextafter(1.0, 0.0), &scratch), kept.back());
    int exact = 0;
    const int grid = 400;
    for (int j = 0; j < grid; ++j) {
      const double u = (j + 0.5) / grid;
      const int32_t got = DrawToken(logits, p, {}, u, &scratch);
      const size_t at = std::upper_bound(cum.begin(), cum.end(), u) - cum.begin();
      const int32_t want = kept[std::min(at, kept.size() - 1)];
      ASSERT_GT(ref[got], 0.0) << "drew cut token " << got;
      if (got == want) {
        ++exact;
      } else {
        const size_t g = std::lower_bound(kept.begin(), kept.end(), got) - kept.begin();
        EXPECT_EQ(std::abs(static_cast<long>(g) - static_cast<long>(at)), 1) << "u " << u;
      }
    }
    EXPECT_GE(exact, grid * 9 / 10);
  }
}

TEST(SamplerTest, SameSeedAndIndexSameToken) {
  const std::vector<float> logits = {0.3f, 0.1f, 0.2f, 0.25f, 0.15f};
  SamplingParams p;
  p.seed = 99;
  SamplerScratch scratch;
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(Sample(logits, p, {}, i, &scratch).token, Sample(logits, p, {}, i, &scratch).token);
  }
  EXPECT_NE(SampleUniform(99, 0), SampleUniform(100, 0));
  EXPECT_NE(SampleUniform(99, 0), SampleUniform(99, 1));
  // The draw is Philox keyed by the seed, counted by the index.
  const philox::U32x4 r = philox::Philox4x32_10({{7, 0, 0, 0}}, 99, 0);
  EXPECT_EQ(SampleUniform(99, 7), static_cast<double>((uint64_t{r.v[0]} << 32 | r.v[1]) >> 11) / 9007199254740992.0);
}

TEST(SamplerTest, RepetitionPenalty) {
  // Token 0 (logit 2) seen: 2/2 = 1 < token 1's 1.5. Token 2 (logit -1) seen: -1*2 = -2.
  SamplerScratch scratch;
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
  SamplerScratch scratch;
  const SampleResult r = Sample(LogitsOf(probs), p, std::vector<int32_t>{1}, 0, &scratch);
  EXPECT_EQ(r.token, 2);
  EXPECT_NEAR(r.logprob, std::log(0.3), 1e-6);
  ASSERT_EQ(r.top.size(), 2u);
  EXPECT_EQ(r.top[0].token, 1);
  EXPECT_NEAR(r.top[0].logprob, std::log(0.6), 1e-6);
  EXPECT_EQ(r.top[1].token, 2);
}

TEST(SamplerTest, TokenLogprobsOfALargeRow) {
  const std::vector<float> logits = NormalLogits(50432, 9, 4.0f);
  double mx = -INFINITY, z = 0;
  for (float l : logits) mx = std::max<double>(mx, l);
  for (float l : logits) z += std::exp(l - mx);
  const double log_z = mx + std::log(z);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  const SampleResult r = TokenLogprobs(logits, 1234, 20);
  EXPECT_NEAR(r.logprob, logits[1234] - log_z, 1e-5);
  ASSERT_EQ(r.top.size(), 20u);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(r.top[i].token, order[i]);
    EXPECT_NEAR(r.top[i].logprob, logits[order[i]] - log_z, 1e-5);
  }
}

// A row's answer depends on nothing beside it: alone, or in a batch answered on several threads
// in any order, with every control on, the same bits.
TEST(SamplerTest, AnswersAreTheSameAloneAndBatched) {
  const int v = 4000, rows = 16;
  std::vector<float> logits;
  for (int r = 0; r < rows; ++r) {
    const std::vector<float> row = NormalLogits(v, 100 + r, 1.0f);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  std::vector<SamplingParams> params(rows);
  const std::vector<int32_t> history = {1, 5, 9, 5, 77};
  std::vector<RowQuery> queries;
  for (int r = 0; r < rows; ++r) {
    params[r].temperature = 0.6f + 0.05f * r;
    params[r].top_k = r % 3 == 0 ? 0 : 30 + r;
    params[r].top_p = r % 2 == 0 ? 0.9f : 1.0f;
    params[r].repetition_penalty = 1.2f;
    params[r].seed = 1000 + r / 4;  // rows of one seed differ by index alone
    params[r].logprobs = r % 4;
    RowQuery q;
    q.row = r;
    q.params = &params[r];
    q.history = history;
    q.index = 3 + r % 4;
    queries.push_back(q);
    RowQuery s;  // a score row beside each draw
    s.row = r;
    s.token = 7 * r;
    s.top_n = r % 5;
    queries.push_back(s);
  }
  // Several threads, ranges in reverse order.
  const ParallelFor threads = [](int n, const std::function<void(int, int)>& fn) {
    std::vector<std::thread> t;
    for (int b = n - 3; b > -3; b -= 3) t.emplace_back([&fn, b, n] { fn(std::max(b, 0), std::min(b + 3, n)); });
    for (auto& x : t) x.join();
  };
  std::vector<SampleResult> batched;
  AnswerQueries(logits.data(), v, queries, &batched, threads);
  ASSERT_EQ(batched.size(), queries.size());
  int differ = 0;
  for (size_t q = 0; q < queries.size(); ++q) {
    std::vector<SampleResult> alone;
    AnswerQueries(logits.data(), v, absl::MakeConstSpan(&queries[q], 1), &alone);
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(alone[0].token, batched[q].token) << "query " << q;
    EXPECT_EQ(alone[0].logprob, batched[q].logprob) << "query " << q;
    ASSERT_EQ(alone[0].top.size(), batched[q].top.size());
    for (size_t i = 0; i < alone[0].top.size(); ++i) {
      EXPECT_EQ(alone[0].top[i].token, batched[q].top[i].token);
      EXPECT_EQ(alone[0].top[i].logprob, batched[q].top[i].logprob);
    }
    // The same answer straight from Sample at the query's own index.
    if (queries[q].params != nullptr) {
      SamplerScratch scratch;
      const absl::Span<const float> row(logits.data() + static_cast<size_t>(queries[q].row) * v, v);
      EXPECT_EQ(Sample(row, *queries[q].params, history, queries[q].index, &scratch).token, batched[q].token);
      SamplingParams shifted = *queries[q].params;
      differ += Sample(row, shifted, history, queries[q].index + 1, &scratch).token != batched[q].token;
    }
  }
  // The draws do depend on the index: a stream shifted by one changes most of them.
  EXPECT_GE(differ, rows / 2);
}

}  // namespace
}  // namespace relgen
