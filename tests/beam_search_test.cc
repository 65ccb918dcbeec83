// BeamSearch's bookkeeping on steps worked out by hand from transformers' BeamSearchScorer and
// BeamHypotheses (the values are exact in float, so every comparison is too).
#include "engine/core/beam_search.h"

#include <gtest/gtest.h>

namespace relgen {
namespace {

using Cands = std::vector<std::vector<TokenLogprob>>;
constexpr int32_t kEnd = 0;

// Two beams over three steps: an end token in the first k of step 1 and 2 ends a hypothesis, one
// at rank k in step 3 is skipped, equal scores keep the lower beam first, and at max_new_tokens
// the running beams compete with the hypotheses for the k places.
Cands Step1() { return {{{5, -0.5f}, {kEnd, -0.75f}, {3, -1.0f}, {4, -2.0f}}}; }
Cands Step2() { return {{{kEnd, -0.25f}, {7, -0.5f}}, {{9, -0.125f}, {kEnd, -0.25f}}}; }
Cands Step3() { return {{{2, -0.5f}, {kEnd, -0.625f}}, {{4, -0.375f}, {kEnd, -4.0f}}}; }

BeamConfig Config(EarlyStopping e) {
  BeamConfig c;
  c.num_beams = 2;
  c.num_return = 2;
  c.max_new_tokens = 3;
  c.end_token = kEnd;
  c.early_stopping = e;
  return c;
}

TEST(BeamSearchTest, StepsByHand) {
  for (EarlyStopping e : {EarlyStopping::kFalse, EarlyStopping::kNever}) {
    BeamSearch s(Config(e));
    EXPECT_EQ(s.Step(Step1()), (std::vector<int>{0, 0}));  // hypothesis [] at -0.75 / 1
    EXPECT_EQ(s.tokens(0), (std::vector<int32_t>{5}));
    EXPECT_EQ(s.tokens(1), (std::vector<int32_t>{3}));
    EXPECT_FALSE(s.finished());
    // Hypothesis [5] at -0.75 / 2; the best candidate (-0.75 / 2, or / 3 for "never") beats the worst.
    EXPECT_EQ(s.Step(Step2()), (std::vector<int>{0, 1}));
    EXPECT_EQ(s.score(0), -1.0f);
    EXPECT_EQ(s.score(1), -1.125f);
    EXPECT_FALSE(s.finished());
    // Both at -1.5 (beam 0 first); the end token at rank 2 is skipped. At the limit [5 7 2]
    // (-1.5 / 3 = -0.5) displaces [] (-0.75); [3 9 4] (-0.5) does not beat the new worst (-0.5).
    EXPECT_EQ(s.Step(Step3()), (std::vector<int>{0, 1}));
    EXPECT_EQ(s.tokens(0), (std::vector<int32_t>{5, 7, 2}));
    EXPECT_EQ(s.tokens(1), (std::vector<int32_t>{3, 9, 4}));
    EXPECT_TRUE(s.finished());
    const std::vector<BeamHypothesis> r = s.Result();
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{5, kEnd}));
    EXPECT_EQ(r[0].score, -0.375);
    EXPECT_TRUE(r[0].ended);
    EXPECT_EQ(r[1].tokens, (std::vector<int32_t>{5, 7, 2}));
    EXPECT_EQ(r[1].score, -0.5);
    EXPECT_FALSE(r[1].ended);
  }
}

TEST(BeamSearchTest, EarlyStoppingTrueEndsWithKHypotheses) {
  BeamSearch s(Config(EarlyStopping::kTrue));
  s.Step(Step1());
  s.Step(Step2());
  EXPECT_TRUE(s.finished());
  const std::vector<BeamHypothesis> r = s.Result();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{5, kEnd}));
  EXPECT_EQ(r[0].score, -0.375);
  EXPECT_EQ(r[1].tokens, (std::vector<int32_t>{kEnd}));
  EXPECT_EQ(r[1].score, -0.75);
}

TEST(BeamSearchTest, TheHeuristicStopsWhenNoCandidateCanWin) {
  // early_stopping false: done once worst >= best candidate / generated^length_penalty.
  BeamConfig c = Config(EarlyStopping::kFalse);
  c.max_new_tokens = 10;
  BeamSearch s(c);
  s.Step({{{kEnd, -0.25f}, {5, -0.5f}, {3, -1.0f}, {4, -2.0f}}});  // [] at -0.25 / 1
  EXPECT_FALSE(s.finished());
  // [5] ends at -0.5 - 0.125 = -0.625 / 2 = -0.3125 (worst -0.3125); the best candidate is that one:
  // -0.625 / 2 = -0.3125 <= worst: done.
  s.Step({{{kEnd, -0.125f}, {6, -4.0f}}, {{7, -4.0f}, {8, -4.0f}}});
  EXPECT_TRUE(s.finished());
  const std::vector<BeamHypothesis> r = s.Result();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].score, -0.25);
  EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{kEnd}));
  EXPECT_EQ(r[1].score, -0.3125);
  EXPECT_EQ(r[1].tokens, (std::vector<int32_t>{5, kEnd}));
  // "never" with length_penalty 1 bounds by max_new_tokens: -0.625 / 10 = -0.0625 > worst: not done.
  c.early_stopping = EarlyStopping::kNever;
  BeamSearch never(c);
  never.Step({{{kEnd, -0.25f}, {5, -0.5f}, {3, -1.0f}, {4, -2.0f}}});
  never.Step({{{kEnd, -0.125f}, {6, -4.0f}}, {{7, -4.0f}, {8, -4.0f}}});
  EXPECT_FALSE(never.finished());
}

// length_penalty divides by generated^lp: 2 favours the longer of two equal sums, 0 ignores length.
TEST(BeamSearchTest, LengthPenaltyWeighsLength) {
  for (float lp : {0.0f, 2.0f}) {
    BeamConfig c = Config(EarlyStopping::kTrue);
    c.length_penalty = lp;
    c.num_return = 2;
    BeamSearch s(c);
    s.Step({{{kEnd, -1.0f}, {5, -0.5f}, {3, -4.0f}, {4, -4.0f}}});  // [] at -1 / 1
    s.Step({{{kEnd, -0.5f}, {6, -8.0f}}, {{7, -8.0f}, {8, -8.0f}}});  // [5] at -1 / 2^lp
    ASSERT_TRUE(s.finished());
    const std::vector<BeamHypothesis> r = s.Result();
    ASSERT_EQ(r.size(), 2u);
    if (lp == 0.0f) {
      // Equal scores: the later added comes first.
      EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{5, kEnd}));
      EXPECT_EQ(r[0].score, -1.0);
      EXPECT_EQ(r[1].tokens, (std::vector<int32_t>{kEnd}));
    } else {
      EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{5, kEnd}));
      EXPECT_EQ(r[0].score, -0.25);
      EXPECT_EQ(r[1].score, -1.0);
    }
  }
}

}  // namespace
}  // namespace relgen
