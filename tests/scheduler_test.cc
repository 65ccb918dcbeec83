// The scheduling decision, hand-derived cases (block size 4 throughout).
#include <gtest/gtest.h>

#include "engine/core/scheduler.h"

namespace relgen {
namespace {

SchedulerConfig Config(int budget = 100, int max_seqs = 8) {
  SchedulerConfig c;
  c.block_size = 4;
  c.max_batch_tokens = budget;
  c.max_num_seqs = max_seqs;
  return c;
}

SchedSeq Waiting(int64_t id, int tokens) { return {id, tokens, 0, 0}; }
// Decoding: all but the newest token are cached.
SchedSeq Decoding(int64_t id, int tokens) { return {id, tokens, tokens - 1, (tokens - 1 + 3) / 4}; }

TEST(SchedulerTest, AdmitsFirstComeFirstServed) {
  const SchedSeq w[] = {Waiting(1, 10), Waiting(2, 5), Waiting(3, 7)};
  const Schedule s = ComputeSchedule({}, w, 100, Config());
  ASSERT_EQ(s.chunks.size(), 3u);
  EXPECT_EQ(s.chunks[0].id, 1);
  EXPECT_EQ(s.chunks[0].num_tokens, 10);
  EXPECT_EQ(s.chunks[0].new_blocks, 3);
  EXPECT_TRUE(s.chunks[0].admitted);
  EXPECT_EQ(s.chunks[1].id, 2);
  EXPECT_EQ(s.chunks[2].id, 3);
  EXPECT_TRUE(s.preempted.empty());
}

TEST(SchedulerTest, HeadOfQueueIsNeverOvertaken) {
  // The head needs 3 blocks, only 2 are free: the small request behind it waits too.
  const SchedSeq w[] = {Waiting(1, 10), Waiting(2, 2)};
  const Schedule s = ComputeSchedule({}, w, 2, Config());
  EXPECT_TRUE(s.chunks.empty());
}

// max_loras 2: adapters 1 and 2 run; a waiting sequence of adapter 3 is not admitted (nor anyone
// behind it), one of a running adapter or of the base is.
TEST(SchedulerTest, AdmitsNoMoreAdaptersThanMaxLoras) {
  SchedulerConfig c = Config();
  c.max_loras = 2;
  SchedSeq r[] = {Decoding(1, 5), Decoding(2, 5)};
  r[0].adapter = 1;
  r[1].adapter = 2;
  SchedSeq w[] = {Waiting(3, 4), Waiting(4, 4), Waiting(5, 4)};
  w[0].adapter = 2;
  w[1].adapter = 0;
  w[2].adapter = 3;
  Schedule s = ComputeSchedule(r, w, 100, c);
  ASSERT_EQ(s.chunks.size(), 4u);  // both running, then 3 and 4; 5 waits
  EXPECT_EQ(s.chunks[2].id, 3);
  EXPECT_EQ(s.chunks[3].id, 4);
  // Adapter 3 at the head: it waits, and the base's sequence behind it too (first come, first served).
  std::swap(w[0], w[2]);
  s = ComputeSchedule(r, w, 100, c);
  EXPECT_EQ(s.chunks.size(), 2u);
  // Once adapter 2's sequence has left, adapter 3 takes its place; a fourth adapter behind it waits.
  SchedSeq w2[] = {Waiting(5, 4), Waiting(6, 4)};
  w2[0].adapter = 3;
  w2[1].adapter = 4;
  s = ComputeSchedule({r, 1}, w2, 100, c);
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks[1].id, 5);
}

TEST(SchedulerTest, TokenBudgetChunksPrompts) {
  const SchedSeq r[] = {Decoding(1, 9)};
  const SchedSeq w[] = {Waiting(2, 300), Waiting(3, 4)};
  const Schedule s = ComputeSchedule(r, w, 1000, Config(64));
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks[0].id, 1);
  EXPECT_EQ(s.chunks[0].num_tokens, 1);  // decode first
  EXPECT_EQ(s.chunks[0].new_blocks, 1);  // position 8 opens block 3
  EXPECT_EQ(s.chunks[1].id, 2);
  EXPECT_EQ(s.chunks[1].num_tokens, 63);  // the rest of the budget
  EXPECT_EQ(s.chunks[1].new_blocks, 16);
  // Next step: the partial prompt continues before anyone new is admitted.
  const SchedSeq r2[] = {Decoding(1, 10), {2, 300, 63, 16}};
  const Schedule s2 = ComputeSchedule(r2, {w + 1, 1}, 1000, Config(64));
  ASSERT_EQ(s2.chunks.size(), 2u);
  EXPECT_EQ(s2.chunks[1].id, 2);
  EXPECT_EQ(s2.chunks[1].num_tokens, 63);
}

TEST(SchedulerTest, RunningSequenceLimit) {
  const SchedSeq r[] = {Decoding(1, 5), Decoding(2, 5)};
  const SchedSeq w[] = {Waiting(3, 4)};
  const Schedule s = ComputeSchedule(r, w, 100, Config(100, 2));
  ASSERT_EQ(s.chunks.size(), 2u);
  for (const auto& c : s.chunks) EXPECT_FALSE(c.admitted);
}

TEST(SchedulerTest, PreemptsTheMostRecentlyAdmitted) {
  // Each needs one new block (position 8); none are free. The newest (3) gives its 2 blocks,
  // enough for 1 and 2. Nobody is admitted in a step that preempted.
  const SchedSeq r[] = {Decoding(1, 9), Decoding(2, 9), Decoding(3, 9)};
  const SchedSeq w[] = {Waiting(4, 1)};
  const Schedule s = ComputeSchedule(r, w, 0, Config());
  ASSERT_EQ(s.preempted, std::vector<int64_t>{3});
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks[0].id, 1);
  EXPECT_EQ(s.chunks[1].id, 2);
}

TEST(SchedulerTest, PreemptsSeveralAndFinallyItself) {
  // 1 needs 2 new blocks (prompt chunk); 2 and 3 hold one block each.
  const SchedSeq r[] = {{1, 16, 8, 2}, {2, 4, 3, 1}, {3, 4, 3, 1}};
  Schedule s = ComputeSchedule(r, {}, 0, Config());
  EXPECT_EQ(s.preempted, (std::vector<int64_t>{3, 2}));
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].new_blocks, 2);
  // Alone and still short of blocks: it yields its own.
  const SchedSeq alone[] = {{1, 16, 8, 2}};
  s = ComputeSchedule(alone, {}, 1, Config());
  EXPECT_EQ(s.preempted, std::vector<int64_t>{1});
  EXPECT_TRUE(s.chunks.empty());
}

TEST(SchedulerTest, RequestLargerThanTheWholeCacheIsNeverAdmitted) {
  // 65 tokens need 17 blocks; the pool has 16. (The engine refuses it at submit.)
  const SchedSeq w[] = {Waiting(1, 65)};
  EXPECT_TRUE(ComputeSchedule({}, w, 16, Config(1000)).chunks.empty());
}

// Encoder-decoder: an admitted sequence's input (encoded whole) is charged to the encoder budget,
// its first decoder token to the token budget, and it gets blocks for its cross-attention K/V.
TEST(SchedulerTest, EncoderInputIsChargedToItsOwnBudgetAndGetsItsOwnBlocks) {
  SchedSeq a = Waiting(1, 1), b = Waiting(2, 1), c = Waiting(3, 1);
  a.encoder_tokens = 30;  // 8 blocks of 4
  b.encoder_tokens = 20;  // 5 blocks
  c.encoder_tokens = 10;
  const SchedSeq w[] = {a, b, c};
  SchedulerConfig config = Config(60);
  config.max_encoder_tokens = 55;
  const Schedule s = ComputeSchedule({}, w, 100, config);
  // 30, then 20 = 50 of 55 encoder tokens; the third's 10 does not fit. 2 of the 60 tokens used.
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks[0].num_tokens, 1);
  EXPECT_EQ(s.chunks[0].new_blocks, 1);
  EXPECT_EQ(s.chunks[0].encoder_blocks, 8);
  EXPECT_EQ(s.chunks[1].encoder_blocks, 5);
  // Blocks: 1 + 8 fit 9 free, and then nothing more.
  const Schedule tight = ComputeSchedule({}, w, 9, config);
  ASSERT_EQ(tight.chunks.size(), 1u);
  EXPECT_EQ(tight.chunks[0].id, 1);
  // The token budget never pays for inputs: with 2 tokens, two inputs (one decoder token each).
  config.max_batch_tokens = 2;
  EXPECT_EQ(ComputeSchedule({}, w, 100, config).chunks.size(), 2u);
}

// Decodes keep running beside an admitted input: 3 decoding sequences and a 500-token input in a
// budget of 4 tokens all run (3 decode tokens + the input's first decoder token).
TEST(SchedulerTest, AdmittingAnInputLeavesTheDecodesTheirTokens) {
  SchedSeq a = Waiting(9, 1);
  a.encoder_tokens = 500;
  const SchedSeq r[] = {Decoding(1, 9), Decoding(2, 9), Decoding(3, 9)};
  SchedulerConfig config = Config(4);
  config.max_encoder_tokens = 512;
  const Schedule s = ComputeSchedule(r, {&a, 1}, 1000, config);
  ASSERT_EQ(s.chunks.size(), 4u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.chunks[i].num_tokens, 1);
  EXPECT_EQ(s.chunks[3].id, 9);
  EXPECT_EQ(s.chunks[3].encoder_blocks, 125);
}

TEST(SchedulerTest, InputLongerThanTheEncoderBudgetEncodesAlone) {
  SchedSeq a = Waiting(1, 1), b = Waiting(2, 1);
  a.encoder_tokens = 500;
  b.encoder_tokens = 8;
  SchedulerConfig config = Config(64);
  config.max_encoder_tokens = 100;
  const SchedSeq w[] = {a, b};
  const Schedule s = ComputeSchedule({}, w, 1000, config);
  ASSERT_EQ(s.chunks.size(), 1u);  // the whole encoder budget and more: nothing else is encoded
  EXPECT_EQ(s.chunks[0].encoder_blocks, 125);
  // Behind another input in the same step it waits for the next.
  const SchedSeq w2[] = {b, a};
  const Schedule s2 = ComputeSchedule({}, w2, 1000, config);
  ASSERT_EQ(s2.chunks.size(), 1u);
  EXPECT_EQ(s2.chunks[0].id, 2);
}

TEST(SchedulerTest, PreemptionFreesCrossBlocksToo) {
  // `old` recomputes 32 decoder tokens (8 new blocks); nothing is free. Preempting `young` frees its
  // decoder block and its input's 10 blocks: 11, enough, so `old` runs.
  SchedSeq old = {1, 40, 8, 2, 12, 3};
  SchedSeq young = Decoding(2, 5);
  young.encoder_tokens = 40;
  young.encoder_blocks = 10;
  const SchedSeq r[] = {old, young};
  const Schedule s = ComputeSchedule(r, {}, 0, Config());
  ASSERT_EQ(s.preempted.size(), 1u);
  EXPECT_EQ(s.preempted[0], 2);
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].id, 1);
  EXPECT_EQ(s.chunks[0].num_tokens, 32);
  EXPECT_EQ(s.chunks[0].new_blocks, 8);
}

TEST(SchedulerTest, CachedPrefixBlocksCountAgainstTheFreePoolAndNotTheBudget) {
  // 20 tokens, 12 of them cached in 3 blocks of which 2 sit unreferenced in the cache: admitting it
  // computes 8 tokens, allocates 2 blocks and takes the 2 cached ones out of the free count.
  SchedSeq w = {1, 20, 12, 3};
  w.cached_blocks = 2;
  const SchedSeq ws[] = {w};
  const Schedule fits = ComputeSchedule({}, ws, 4, Config(8));
  ASSERT_EQ(fits.chunks.size(), 1u);
  EXPECT_EQ(fits.chunks[0].num_tokens, 8);
  EXPECT_EQ(fits.chunks[0].new_blocks, 2);
  EXPECT_TRUE(ComputeSchedule({}, ws, 3, Config(8)).chunks.empty());  // 2 new + 2 cached > 3
}

TEST(SchedulerTest, PreemptingFreesOnlyBlocksNobodyElseHolds) {
  // The newest running sequence holds 4 blocks, 3 of them shared with the oldest: preempting it
  // frees 1, just what the oldest's next token needs.
  SchedSeq old_seq = Decoding(1, 17);  // 16 cached in 4 full blocks: its next token needs a fifth
  SchedSeq young = Decoding(2, 14);
  young.shared_blocks = 3;
  old_seq.shared_blocks = 3;
  const SchedSeq run[] = {old_seq, young};
  const Schedule s = ComputeSchedule(run, {}, 0, Config());
  ASSERT_EQ(s.preempted.size(), 1u);
  EXPECT_EQ(s.preempted[0], 2);
  ASSERT_EQ(s.chunks.size(), 1u);  // the one freed block is enough
  EXPECT_EQ(s.chunks[0].id, 1);

  young.shared_blocks = 4;  // everything it holds is shared: preempting it frees nothing
  old_seq.shared_blocks = 4;
  const SchedSeq run2[] = {old_seq, young};
  const Schedule t = ComputeSchedule(run2, {}, 0, Config());
  EXPECT_EQ(t.preempted.size(), 2u);
  EXPECT_TRUE(t.chunks.empty());
}

// Idle: a beam waiting for its siblings (nothing to compute, its blocks held).
SchedSeq Idle(int64_t id, int tokens) { return {id, tokens, tokens, (tokens + 3) / 4}; }

TEST(SchedulerTest, IdleSequencesTakeNoChunk) {
  const SchedSeq run[] = {Idle(1, 8), Decoding(2, 9), Idle(3, 5)};
  const Schedule s = ComputeSchedule(run, {}, 10, Config());
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].id, 2);
  EXPECT_EQ(s.chunks[0].num_tokens, 1);
  EXPECT_TRUE(s.preempted.empty());
}

TEST(SchedulerTest, AnIdleOlderSequenceYieldsToOneThatMustGrow) {
  // 2 decodes into a new block (9 tokens, 2 blocks held) with none free: the newer 3 goes first
  // (1 block), which is enough; with 3 holding nothing, the idle older 1 goes (2 blocks).
  SchedSeq grow = Decoding(2, 9);
  const SchedSeq run[] = {Idle(1, 8), grow, Idle(3, 4)};
  const Schedule s = ComputeSchedule(run, {}, 0, Config());
  EXPECT_EQ(s.preempted, std::vector<int64_t>{3});
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].id, 2);
  SchedSeq empty = Idle(3, 0);
  const SchedSeq run2[] = {Idle(1, 8), grow, empty};
  const Schedule t = ComputeSchedule(run2, {}, 0, Config());
  EXPECT_EQ(t.preempted, (std::vector<int64_t>{3, 1}));
  ASSERT_EQ(t.chunks.size(), 1u);
  EXPECT_EQ(t.chunks[0].id, 2);
}

TEST(SchedulerTest, IdleSequencesMakeRoomForAStarvedHead) {
  // Nothing computes and the head needs 3 blocks, 1 free: the idle newest (2 blocks) goes, and the
  // head is admitted the next step; nobody is admitted in this one.
  const SchedSeq run[] = {Idle(1, 8), Idle(2, 8)};
  const SchedSeq w[] = {Waiting(3, 10)};
  const Schedule s = ComputeSchedule(run, w, 1, Config());
  EXPECT_EQ(s.preempted, std::vector<int64_t>{2});
  EXPECT_TRUE(s.chunks.empty());
  // The running-sequence limit likewise.
  const Schedule t = ComputeSchedule(run, w, 100, Config(100, 2));
  EXPECT_EQ(t.preempted, std::vector<int64_t>{2});
  // When preempting every idle one would not make room, none is preempted.
  const Schedule u = ComputeSchedule(run, {Waiting(3, 40)}, 1, Config());
  EXPECT_TRUE(u.preempted.empty());
  EXPECT_TRUE(u.chunks.empty());
  // When the head fits, it is admitted beside the idle ones.
  const Schedule v = ComputeSchedule(run, w, 3, Config());
  EXPECT_TRUE(v.preempted.empty());
  ASSERT_EQ(v.chunks.size(), 1u);
  EXPECT_EQ(v.chunks[0].id, 3);
}

}  // namespace
}  // namespace relgen
