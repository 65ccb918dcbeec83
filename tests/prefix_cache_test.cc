// Shared KV blocks: the allocator's reference counts and prefix cache, and what the engine builds on
// them (prefix caching, n samples per request, prompt log-probabilities, scoring). Outputs with
// shared blocks are compared bitwise against the same requests computed without sharing, and the
// log-probabilities against the PyTorch reference's logits (tools/relgen_ref.py via the goldens).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/backends/cpu_backend.h"
#include "engine/core/engine.h"
#include "engine/core/kv_cache.h"
#include "engine/model/safetensors.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

constexpr int kBs = 16;

std::vector<int32_t> Iota(int n, int from) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

// ---------------------------------------------------------------- the allocator alone

TEST(BlockAllocatorTest, SharedBlocksFreeOnTheirLastRelease) {
  BlockAllocator a(8, kBs);
  std::vector<int32_t> x, y;
  ASSERT_TRUE(a.Allocate(3, &x));
  a.Share(absl::MakeConstSpan(x).first(2), &y);
  EXPECT_EQ(a.ref_count(x[0]), 2);
  EXPECT_EQ(a.ref_count(x[2]), 1);
  EXPECT_EQ(a.num_used(), 3);
  a.Free(&x);
  EXPECT_EQ(a.num_used(), 2);  // y still holds two
  EXPECT_EQ(a.num_free(), 6);
  a.Free(&y);
  EXPECT_EQ(a.num_free(), 8);
  a.CheckConsistency();
  EXPECT_FALSE(a.Allocate(9, &x));
  EXPECT_TRUE(x.empty());
}

TEST(BlockAllocatorDeathTest, ReleasingAnUnreferencedBlockAborts) {
  BlockAllocator a(4, kBs);
  std::vector<int32_t> x;
  ASSERT_TRUE(a.Allocate(1, &x));
  std::vector<int32_t> copy = x;
  a.Free(&x);
  EXPECT_DEATH(a.Free(&copy), "freed twice");
}

TEST(BlockAllocatorTest, RegisteredBlocksAreFoundByContentsAndChain) {
  BlockAllocator a(8, kBs);
  const std::vector<int32_t> t0 = Iota(kBs, 10), t1 = Iota(kBs, 40);
  std::vector<int32_t> seq;
  ASSERT_TRUE(a.Allocate(2, &seq));
  const PrefixCursor root = BlockAllocator::Root({});
  const PrefixCursor c0 = a.Register(root, seq[0], t0, {});
  const PrefixCursor c1 = a.Register(c0, seq[1], t1, {});
  EXPECT_EQ(a.Lookup(root, t0, {}), seq[0]);
  EXPECT_EQ(a.Lookup(c0, t1, {}), seq[1]);
  EXPECT_EQ(a.Lookup(root, t1, {}), -1);  // the same block after a different prefix
  std::vector<int32_t> other = t1;
  other[kBs - 1] += 1;
  EXPECT_EQ(a.Lookup(c0, other, {}), -1);
  const std::vector<int32_t> input = {5, 6, 7};
  EXPECT_EQ(a.Lookup(BlockAllocator::Root(input), t0, input), -1);  // another root (encoder input)

  // Released, the blocks stay findable (cached) and count as free.
  a.Free(&seq);
  EXPECT_EQ(a.num_cached(), 2);
  EXPECT_EQ(a.num_free(), 8);
  EXPECT_EQ(a.Lookup(c0, t1, {}), c1.block);
  // A second registration of the same contents keeps the first block canonical.
  std::vector<int32_t> dup;
  ASSERT_TRUE(a.Allocate(1, &dup));
  const PrefixCursor again = a.Register(root, dup[0], t0, {});
  EXPECT_EQ(again.block, c0.block);
  a.Free(&dup);
  EXPECT_EQ(a.num_cached(), 2);
  a.CheckConsistency();
}

TEST(BlockAllocatorTest, EvictsNeverCachedFirstThenLeastRecentlyReleasedDeepestFirst) {
  BlockAllocator a(4, kBs);
  const PrefixCursor root = BlockAllocator::Root({});
  std::vector<int32_t> s1, s2;
  ASSERT_TRUE(a.Allocate(2, &s1));
  const PrefixCursor a0 = a.Register(root, s1[0], Iota(kBs, 0), {});
  a.Register(a0, s1[1], Iota(kBs, 100), {});
  ASSERT_TRUE(a.Allocate(1, &s2));
  a.Register(root, s2[0], Iota(kBs, 200), {});
  a.Free(&s1);  // releases s1[1] then s1[0]
  a.Free(&s2);
  EXPECT_EQ(a.num_cached(), 3);
  std::vector<int32_t> t;
  ASSERT_TRUE(a.Allocate(1, &t));  // the one never-cached block
  EXPECT_EQ(a.num_evicted(), 0);
  EXPECT_EQ(a.num_cached(), 3);
  ASSERT_TRUE(a.Allocate(1, &t));  // evicts s1's deepest block, released first
  EXPECT_EQ(a.num_evicted(), 1);
  EXPECT_EQ(a.Lookup(a0, Iota(kBs, 100), {}), -1);
  EXPECT_EQ(a.Lookup(root, Iota(kBs, 0), {}), a0.block);
  EXPECT_NE(a.Lookup(root, Iota(kBs, 200), {}), -1);
  a.Free(&t);
  a.CheckConsistency();
}

TEST(BlockAllocatorTest, AChainThroughAnEvictedBlockNeverMatchesItsReuse) {
  BlockAllocator a(2, kBs);
  const PrefixCursor root = BlockAllocator::Root({});
  std::vector<int32_t> s;
  ASSERT_TRUE(a.Allocate(2, &s));
  const PrefixCursor p = a.Register(root, s[0], Iota(kBs, 0), {});
  a.Register(p, s[1], Iota(kBs, 50), {});
  const int32_t parent = s[0], child = s[1];
  // Keep the child referenced; the parent is released, evicted and reused for other contents.
  std::vector<int32_t> keep;
  a.Share({child}, &keep);
  a.Free(&s);
  std::vector<int32_t> t;
  ASSERT_TRUE(a.Allocate(1, &t));
  ASSERT_EQ(t[0], parent);
  const PrefixCursor q = a.Register(root, t[0], Iota(kBs, 900), {});
  EXPECT_EQ(q.block, parent);
  EXPECT_EQ(a.Lookup(q, Iota(kBs, 50), {}), -1);  // same id, new generation
  a.Free(&t);
  a.Free(&keep);
  a.CheckConsistency();
}

// ---------------------------------------------------------------- engine helpers

struct EngineSetup {
  std::string model = "long";
  int num_blocks = 1024;
  int max_batch_tokens = 256;
  int max_num_seqs = 8;
  bool prefix_caching = true;
};

std::unique_ptr<Engine> MakeEngine(const EngineSetup& s, const std::string& dir = "") {
  auto model = Model::Load(dir.empty() ? testing::GoldenDir() + "/engine/" + s.model : dir);
  EXPECT_TRUE(model.ok()) << model.status();
  auto backend = NewCpuBackend(*model, KvCacheConfig{kBs, s.num_blocks}, 2);
  EXPECT_TRUE(backend.ok()) << backend.status();
  EngineConfig config;
  config.scheduler.max_batch_tokens = s.max_batch_tokens;
  config.scheduler.max_num_seqs = s.max_num_seqs;
  config.background_thread = false;
  config.prefix_caching = s.prefix_caching;
  config.check_invariants = true;
  auto engine = Engine::Create(*model, *std::move(backend), NewByteTokenizer(), config);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

// Everything a request returned, floats as bits so equality is bitwise.
struct Result {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason reason = FinishReason::kNone;
  std::vector<SampleResult> logprobs, prompt_logprobs;
  int generated = 0;
};

bool SameBits(const std::vector<SampleResult>& a, const std::vector<SampleResult>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].token != b[i].token || std::memcmp(&a[i].logprob, &b[i].logprob, sizeof(float)) != 0) return false;
    if (a[i].top.size() != b[i].top.size()) return false;
    for (size_t k = 0; k < a[i].top.size(); ++k) {
      if (a[i].top[k].token != b[i].top[k].token ||
          std::memcmp(&a[i].top[k].logprob, &b[i].top[k].logprob, sizeof(float)) != 0) {
        return false;
      }
    }
  }
  return true;
}

void ExpectSame(const Result& got, const Result& want, const std::string& what) {
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(got.text, want.text) << what;
  EXPECT_EQ(got.reason, want.reason) << what;
  EXPECT_TRUE(SameBits(got.logprobs, want.logprobs)) << what << ": logprobs differ";
  EXPECT_TRUE(SameBits(got.prompt_logprobs, want.prompt_logprobs)) << what << ": prompt logprobs differ";
}

// Reads what is readable now; true once the final output was read.
bool Collect(RequestHandle& h, Result* r) {
  Output o;
  while (h.Next(&o, absl::ZeroDuration())) {
    r->tokens.insert(r->tokens.end(), o.token_ids.begin(), o.token_ids.end());
    r->text += o.text;
    r->logprobs.insert(r->logprobs.end(), o.logprobs.begin(), o.logprobs.end());
    r->prompt_logprobs.insert(r->prompt_logprobs.end(), o.prompt_logprobs.begin(), o.prompt_logprobs.end());
    if (o.finished) {
      r->reason = o.finish_reason;
      r->generated = o.generated_tokens;
      return true;
    }
  }
  return false;
}

// Steps the engine until every handle finished; `each_step` sees the stats after every step.
std::vector<Result> RunToEnd(Engine& e, const std::vector<std::shared_ptr<RequestHandle>>& hs,
                             const std::function<void(const EngineStats&)>& each_step = nullptr) {
  std::vector<Result> out(hs.size());
  std::vector<bool> done(hs.size(), false);
  for (int step = 0; step < 100000; ++step) {
    bool all = true;
    for (size_t i = 0; i < hs.size(); ++i) {
      if (!done[i]) done[i] = Collect(*hs[i], &out[i]);
      all = all && done[i];
    }
    if (all) return out;
    e.RunOnce();
    if (each_step) each_step(e.Stats());
  }
  ADD_FAILURE() << "the engine did not finish";
  return out;
}

std::vector<Result> RunAlone(const EngineSetup& setup, const std::vector<Request>& work) {
  auto e = MakeEngine(setup);
  std::vector<Result> out;
  for (const Request& r : work) {
    auto h = e->Submit(r);
    EXPECT_TRUE(h.ok()) << h.status();
    out.push_back(RunToEnd(*e, {*h})[0]);
  }
  return out;
}

// ---------------------------------------------------------------- prefix caching

// 200 requests over 5 shared prefixes of 100..700 tokens with random suffixes, arriving a few per
// step into a pool that cannot hold them all: every output (tokens, logprobs, text) must be
// bitwise the same with the cache on and off, the cache must have hit, evicted and preempted, and
// every block must come back.
TEST(PrefixCacheTest, OutputsAreBitwiseTheSameWithAndWithoutTheCache) {
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> prefixes;
  for (int len : {100, 250, 400, 550, 700}) {
    std::vector<int32_t> p(len);
    for (int32_t& t : p) t = static_cast<int32_t>(rng() % 256);
    prefixes.push_back(p);
  }
  std::vector<Request> work;
  for (int i = 0; i < 200; ++i) {
    Request r;
    r.id = "r" + std::to_string(i);
    r.prompt = prefixes[rng() % prefixes.size()];
    const int suffix = 1 + static_cast<int>(rng() % 40);
    for (int k = 0; k < suffix; ++k) r.prompt.push_back(static_cast<int32_t>(rng() % 256));
    r.stop.max_new_tokens = 1 + static_cast<int>(rng() % 12);
    r.stop.ignore_eos = i % 3 != 0;
    if (i % 2 == 0) {
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = 40;
      r.sampling.seed = 100 + i;
      r.sampling.logprobs = 3;
    } else {
      r.sampling.temperature = 0.0f;
      r.sampling.logprobs = i % 4 == 1 ? 0 : -1;
    }
    work.push_back(std::move(r));
  }
  auto run = [&](bool caching, EngineStats* stats) {
    EngineSetup setup;
    setup.prefix_caching = caching;
    setup.num_blocks = 120;  // 1920 tokens: the five prefixes alone take 125 blocks
    setup.max_num_seqs = 6;
    auto e = MakeEngine(setup);
    std::vector<std::shared_ptr<RequestHandle>> hs;
    std::vector<Result> out(work.size());
    std::vector<bool> done(work.size(), false);
    size_t next = 0;
    for (int step = 0; step < 100000; ++step) {
      for (int k = 0; k < 2 && next < work.size(); ++k, ++next) {  // two arrivals per step
        auto h = e->Submit(work[next]);
        EXPECT_TRUE(h.ok()) << h.status();
        hs.push_back(*h);
      }
      bool all = next == work.size();
      for (size_t i = 0; i < hs.size(); ++i) {
        if (!done[i]) done[i] = Collect(*hs[i], &out[i]);
        all = all && done[i];
      }
      if (all) break;
      e->RunOnce();
    }
    *stats = e->Stats();
    return out;
  };
  EngineStats on, off;
  const std::vector<Result> with_cache = run(true, &on);
  const std::vector<Result> without = run(false, &off);
  ASSERT_EQ(with_cache.size(), work.size());
  for (size_t i = 0; i < work.size(); ++i) {
    EXPECT_FALSE(with_cache[i].tokens.empty()) << i;
    ExpectSame(with_cache[i], without[i], "request " + std::to_string(i));
  }
  // The cache did its work (the figures come from the run, the bounds from the workload: 200
  // prompts of which at most 5 x 700 tokens are new prefixes).
  EXPECT_GT(on.prefix_cache_hits, on.prefix_cache_queries / 2);
  EXPECT_LT(on.prompt_tokens, off.prompt_tokens / 2);
  EXPECT_GT(on.kv_blocks_evicted, 0);
  std::printf("cache on: %lld of %lld tokens hit, %lld blocks evicted, %lld preemptions, %lld prompt tokens computed; "
              "off: %lld preemptions, %lld prompt tokens computed\n",
              static_cast<long long>(on.prefix_cache_hits), static_cast<long long>(on.prefix_cache_queries),
              static_cast<long long>(on.kv_blocks_evicted), static_cast<long long>(on.preemptions),
              static_cast<long long>(on.prompt_tokens), static_cast<long long>(off.preemptions),
              static_cast<long long>(off.prompt_tokens));
  EXPECT_GT(on.preemptions, 0);
  EXPECT_GT(off.preemptions, 0);
  EXPECT_EQ(off.prefix_cache_queries, 0);
  EXPECT_EQ(off.kv_blocks_cached, 0);
  // Nothing leaked: no block referenced once everything finished; cached + free = the pool.
  for (const EngineStats* s : {&on, &off}) {
    EXPECT_EQ(s->kv_blocks_used, 0);
    EXPECT_EQ(s->num_running + s->num_waiting, 0);
  }
  EXPECT_GT(on.kv_blocks_cached, 0);
  EXPECT_LE(on.kv_blocks_cached, on.kv_blocks_total);
}

// Every scheme: a request whose prompt extends a cached one (by a partial block, by exactly one
// block) equals the same request on an engine that never saw the first.
class PrefixCacheSchemeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefixCacheSchemeTest, CachedPrefixesGiveTheSameOutputs) {
  std::mt19937 rng(3);
  std::vector<int32_t> base(150);
  for (int32_t& t : base) t = static_cast<int32_t>(rng() % 256);
  std::vector<Request> work;
  for (int extra : {0, 5, kBs, 40}) {
    Request r;
    r.prompt = base;
    for (int k = 0; k < extra; ++k) r.prompt.push_back(static_cast<int32_t>(rng() % 256));
    r.sampling.temperature = 0.7f;
    r.sampling.seed = 11 + extra;
    r.sampling.logprobs = 2;
    r.stop.max_new_tokens = 24;
    r.stop.ignore_eos = true;
    work.push_back(r);
  }
  // The same blocks in another order: block contents alone must not hit; a block stands for its prefix.
  Request swapped = work[0];
  std::rotate(swapped.prompt.begin(), swapped.prompt.begin() + kBs, swapped.prompt.begin() + 2 * kBs);
  work.push_back(swapped);
  EngineSetup cached;
  cached.model = GetParam();
  EngineSetup plain = cached;
  plain.prefix_caching = false;
  const std::vector<Result> want = RunAlone(plain, work);
  auto e = MakeEngine(cached);
  for (size_t i = 0; i < work.size(); ++i) {
    auto h = e->Submit(work[i]);
    ASSERT_TRUE(h.ok()) << h.status();
    ExpectSame(RunToEnd(*e, {*h})[0], want[i], "extension " + std::to_string(i));
  }
  const EngineStats s = e->Stats();
  // Requests 2..4 hit the first's 9 full blocks of its prompt; the first request's own
  // generated-token blocks count too once full (request 0 has 150 + 24 tokens: 10 full blocks).
  EXPECT_GE(s.prefix_cache_hits, 3 * 9 * kBs);
  EXPECT_EQ(s.kv_blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Schemes, PrefixCacheSchemeTest,
                         ::testing::Values("skew", "skew_local", "shaw", "t5", "alibi", "none"));

// ---------------------------------------------------------------- n samples

TEST(SamplesTest, EachSampleEqualsARequestWithItsSeedAndThePromptIsShared) {
  std::mt19937 rng(5);
  Request r;
  r.id = "group";
  for (int k = 0; k < 37; ++k) r.prompt.push_back(static_cast<int32_t>(rng() % 256));
  r.sampling.temperature = 1.0f;
  r.sampling.seed = 9000;
  r.sampling.logprobs = 1;
  r.stop.max_new_tokens = 20;
  r.stop.ignore_eos = true;
  std::vector<Request> alone;
  for (int i = 0; i < 8; ++i) {
    Request a = r;
    a.sampling.seed = r.sampling.seed + i;
    alone.push_back(a);
  }
  EngineSetup setup;
  setup.prefix_caching = false;  // the samples share through the group, not the cache
  setup.max_num_seqs = 16;
  const std::vector<Result> want = RunAlone(setup, alone);

  auto e = MakeEngine(setup);
  r.n = 8;
  auto hs = e->SubmitGroup(r);
  ASSERT_TRUE(hs.ok()) << hs.status();
  ASSERT_EQ(hs->size(), 8u);
  int peak = 0;
  const std::vector<Result> got = RunToEnd(*e, *hs, [&](const EngineStats& s) { peak = std::max(peak, s.kv_blocks_used); });
  for (int i = 0; i < 8; ++i) ExpectSame(got[i], want[i], "sample " + std::to_string(i));
  std::set<std::vector<int32_t>> distinct;
  for (const Result& g : got) distinct.insert(g.tokens);
  EXPECT_GT(distinct.size(), 1u);  // the seeds differ, so do the samples
  // Prompt blocks (3) + 8 x the blocks output positions touch (tokens 37..56: blocks 2 and 3), and
  // well under 8 separate requests' 8 x 4.
  const int prompt_blocks = BlocksForTokens(37, kBs);
  const int output_blocks = BlocksForTokens(37 + 20, kBs) - 37 / kBs;
  EXPECT_LE(peak, prompt_blocks + 8 * output_blocks);
  EXPECT_LT(peak, 8 * BlocksForTokens(37 + 20, kBs));
  // The prompt was computed once; each later sample recomputed only the tokens after its last
  // whole shared block before the prompt's last token (32 shared, so 5 each).
  const EngineStats s = e->Stats();
  EXPECT_EQ(s.prompt_tokens, 37 + 7 * (37 - 32));
  EXPECT_EQ(s.kv_blocks_used, 0);
}

TEST(SamplesTest, CancellingTheFirstSampleBeforeItRanLeavesTheOthersWhole) {
  Request r;
  for (int k = 0; k < 50; ++k) r.prompt.push_back(static_cast<int32_t>((k * 37) % 256));
  r.sampling.temperature = 0.9f;
  r.sampling.seed = 77;
  r.stop.max_new_tokens = 6;
  r.stop.ignore_eos = true;
  EngineSetup setup;
  std::vector<Request> alone;
  for (int i = 1; i < 3; ++i) {
    Request a = r;
    a.sampling.seed = 77 + i;
    alone.push_back(a);
  }
  const std::vector<Result> want = RunAlone(setup, alone);
  auto e = MakeEngine(setup);
  r.n = 3;
  auto hs = e->SubmitGroup(r);
  ASSERT_TRUE(hs.ok()) << hs.status();
  (*hs)[0]->Cancel();
  const std::vector<Result> got = RunToEnd(*e, *hs);
  EXPECT_EQ(got[0].reason, FinishReason::kCancelled);
  ExpectSame(got[1], want[0], "sample 1");
  ExpectSame(got[2], want[1], "sample 2");
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);

  // Cancelling every sample mid-way returns every block.
  auto all = e->SubmitGroup(r);
  ASSERT_TRUE(all.ok());
  e->RunOnce();
  e->RunOnce();
  for (auto& h : *all) h->Cancel();
  for (const Result& g : RunToEnd(*e, *all)) EXPECT_EQ(g.reason, FinishReason::kCancelled);
  e->RunOnce();  // the engine reaps cancelled requests at its next step
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
}

TEST(SamplesTest, InvalidGroupsNameTheField) {
  auto e = MakeEngine(EngineSetup{});
  Request r;
  r.prompt = {1, 2, 3};
  r.n = 0;
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("n: 0 samples; allowed 1..16"));
  r.n = 17;
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("n: 17 samples; allowed 1..16"));
  r.n = 2;
  EXPECT_THAT(e->Submit(r).status().message(), HasSubstr("SubmitGroup"));
  r.n = 1;
  r.prompt_logprobs = 21;
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("prompt_logprobs: 21; allowed 0..20"));
  r.prompt_logprobs = -1;
  r.continuations = {{4, 5}, {}};
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("continuations: continuations[1] is empty"));
  r.continuations = {std::vector<int32_t>(1022, 4)};
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("allowed at most 1021"));
  r.continuations = std::vector<std::vector<int32_t>>(65, {4});
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("65 continuations; allowed 1..64"));
  r.continuations = {{4, 999}};
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("continuations: continuations[0]: ids[1] = 999; allowed 0.."));
  r.continuations = {{4}};
  r.n = 2;
  EXPECT_THAT(e->SubmitGroup(r).status().message(), HasSubstr("n: 2; allowed 1 when scoring"));
}

// ---------------------------------------------------------------- against the reference

double LogSoftmax(const double* row, int vocab, int token) {
  double mx = -INFINITY;
  for (int v = 0; v < vocab; ++v) mx = std::max(mx, row[v]);
  double z = 0;
  for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
  return row[token] - mx - std::log(z);
}

// The reference's log-probability of tokens[j] after tokens[..j), and the k most likely at j.
void ExpectMatchesReference(const SampleResult& got, const double* logits, int vocab, int top, const std::string& what) {
  const double want = LogSoftmax(logits, vocab, got.token);
  EXPECT_NEAR(got.logprob, want, 1e-4 * std::max(1.0, std::fabs(want))) << what;
  ASSERT_EQ(static_cast<int>(got.top.size()), top) << what;
  std::vector<double> ref(vocab);
  for (int v = 0; v < vocab; ++v) ref[v] = LogSoftmax(logits, vocab, v);
  std::vector<double> sorted = ref;
  std::sort(sorted.rbegin(), sorted.rend());
  for (int k = 0; k < top; ++k) {
    EXPECT_NEAR(got.top[k].logprob, sorted[k], 1e-4 * std::max(1.0, std::fabs(sorted[k]))) << what << " top " << k;
    EXPECT_NEAR(ref[got.top[k].token], sorted[k], 2e-4 * std::max(1.0, std::fabs(sorted[k]))) << what << " top " << k;
  }
}

class LogprobsReferenceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = testing::GoldenDir() + "/" + GetParam();
    auto golden = SafetensorsFile::Open(dir + "/golden.safetensors");
    ASSERT_TRUE(golden.ok()) << golden.status();
    const TensorInfo* t = (*golden)->Find("tokens_129");
    tokens_.assign(reinterpret_cast<const int32_t*>(t->data), reinterpret_cast<const int32_t*>(t->data) + 129);
    const TensorInfo* l = (*golden)->Find("logits_129");
    logits_.resize(l->numel());
    std::memcpy(logits_.data(), l->data, l->nbytes);
    vocab_ = static_cast<int>(logits_.size() / 129);
    EngineSetup setup;
    setup.num_blocks = 64;
    engine_ = MakeEngine(setup, dir);
  }
  const double* Row(int pos) const { return logits_.data() + static_cast<size_t>(pos) * vocab_; }

  std::vector<int32_t> tokens_;
  std::vector<double> logits_;
  int vocab_ = 0;
  std::unique_ptr<Engine> engine_;
};

TEST_P(LogprobsReferenceTest, PromptLogprobsMatchTheReference) {
  Request r;
  r.prompt = tokens_;
  r.prompt_logprobs = 5;
  r.stop.max_new_tokens = 2;
  r.sampling.temperature = 0;
  auto h = engine_->Submit(r);
  ASSERT_TRUE(h.ok()) << h.status();
  const Result got = RunToEnd(*engine_, {*h})[0];
  ASSERT_EQ(got.prompt_logprobs.size(), 128u);
  for (int j = 1; j < 129; ++j) {
    EXPECT_EQ(got.prompt_logprobs[j - 1].token, tokens_[j]);
    ExpectMatchesReference(got.prompt_logprobs[j - 1], Row(j - 1), vocab_, 5, "prompt token " + std::to_string(j));
  }
}

// max_new_tokens 0 (OpenAI's max_tokens 0 with echo): the prompt's log-probabilities and no token.
TEST_P(LogprobsReferenceTest, ThePromptAloneMatchesTheReference) {
  Request r;
  r.prompt = tokens_;
  r.prompt_logprobs = 5;
  r.stop.max_new_tokens = 0;
  r.n = 3;  // the other samples end with nothing, as a sample after the first has no prompt log-probabilities
  auto hs = engine_->SubmitGroup(r);
  ASSERT_TRUE(hs.ok()) << hs.status();
  const std::vector<Result> got = RunToEnd(*engine_, *hs);
  ASSERT_EQ(got[0].prompt_logprobs.size(), 128u);
  for (int j = 1; j < 129; ++j) {
    EXPECT_EQ(got[0].prompt_logprobs[j - 1].token, tokens_[j]);
    ExpectMatchesReference(got[0].prompt_logprobs[j - 1], Row(j - 1), vocab_, 5, "prompt token " + std::to_string(j));
  }
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(got[i].tokens.empty()) << "sample " << i;
    EXPECT_EQ(got[i].text, "") << "sample " << i;
    EXPECT_TRUE(got[i].logprobs.empty()) << "sample " << i;
    EXPECT_EQ(got[i].reason, FinishReason::kLength) << "sample " << i;
    EXPECT_EQ(got[i].generated, 0) << "sample " << i;
    if (i > 0) EXPECT_TRUE(got[i].prompt_logprobs.empty()) << "sample " << i;
  }
  // The same bits as the prompt log-probabilities of a request that goes on to generate.
  r.n = 1;
  r.stop.max_new_tokens = 1;
  auto h = engine_->Submit(r);
  ASSERT_TRUE(h.ok()) << h.status();
  const Result generating = RunToEnd(*engine_, {*h})[0];
  EXPECT_EQ(generating.tokens.size(), 1u);
  EXPECT_TRUE(SameBits(got[0].prompt_logprobs, generating.prompt_logprobs));
  // Without prompt_logprobs there is nothing to return but the end; the prompt still enters the
  // prefix cache.
  r.prompt_logprobs = -1;
  r.stop.max_new_tokens = 0;
  const int64_t hits_before = engine_->Stats().prefix_cache_hits;
  for (int round = 0; round < 2; ++round) {
    h = engine_->Submit(r);
    ASSERT_TRUE(h.ok()) << h.status();
    const Result bare = RunToEnd(*engine_, {*h})[0];
    EXPECT_TRUE(bare.tokens.empty());
    EXPECT_TRUE(bare.prompt_logprobs.empty());
    EXPECT_EQ(bare.reason, FinishReason::kLength);
  }
  EXPECT_GT(engine_->Stats().prefix_cache_hits, hits_before);
}

TEST_P(LogprobsReferenceTest, ScoresMatchTheReferenceAndDoNotDependOnTheCache) {
  // Contexts ending inside a block and on a block boundary; continuations of 1, 7 and the rest.
  for (int context : {33, 32}) {
    Request r;
    r.prompt.assign(tokens_.begin(), tokens_.begin() + context);
    for (int len : {129 - context, 7, 1}) {
      r.continuations.emplace_back(tokens_.begin() + context, tokens_.begin() + context + len);
    }
    r.sampling.logprobs = 2;
    std::vector<Result> first;
    for (int round = 0; round < 2; ++round) {  // the second finds the context's blocks cached
      auto hs = engine_->SubmitGroup(r);
      ASSERT_TRUE(hs.ok()) << hs.status();
      const std::vector<Result> got = RunToEnd(*engine_, *hs);
      for (size_t c = 0; c < got.size(); ++c) {
        const std::string what = "context " + std::to_string(context) + " continuation " + std::to_string(c);
        EXPECT_EQ(got[c].reason, FinishReason::kLength) << what;
        EXPECT_TRUE(got[c].tokens.empty()) << what;
        ASSERT_EQ(got[c].logprobs.size(), r.continuations[c].size()) << what;
        for (size_t k = 0; k < got[c].logprobs.size(); ++k) {
          const int pos = context + static_cast<int>(k);
          EXPECT_EQ(got[c].logprobs[k].token, tokens_[pos]);
          ExpectMatchesReference(got[c].logprobs[k], Row(pos - 1), vocab_, 2, what + " token " + std::to_string(k));
        }
        if (round == 1) ExpectSame(got[c], first[c], what + ": cached run");
      }
      if (round == 0) first = got;
    }
  }
  const EngineStats s = engine_->Stats();
  EXPECT_GT(s.prefix_cache_hits, 0);
  EXPECT_EQ(s.kv_blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, LogprobsReferenceTest, ::testing::ValuesIn(testing::GoldenCases()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(LogprobsReferenceTest);

}  // namespace
}  // namespace relgen
