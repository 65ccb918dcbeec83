// The engine against itself run one request at a time: continuous batching, chunked prefill,
// preemption with recompute and cancellation must not change any request's output, and must
// return every KV block.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/backends/cpu_backend.h"
#include "engine/backends/device.h"
#include "engine/backends/step_sync.h"
#include "engine/core/engine.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

struct EngineSetup {
  int num_blocks = 1024;
  int max_batch_tokens = 96;
  int max_num_seqs = 16;
  bool background = true;
  cpu::WeightType weights = cpu::WeightType::kF32;
  cpu::KvType kv_type = cpu::KvType::kF32;
};

std::unique_ptr<Engine> MakeEngine(const std::string& scheme, const EngineSetup& s) {
  auto model = Model::Load(testing::GoldenDir() + "/engine/" + scheme);
  EXPECT_TRUE(model.ok()) << model.status();
  auto backend = NewCpuBackend(*model, KvCacheConfig{16, s.num_blocks}, 2, s.weights, s.kv_type);
  EXPECT_TRUE(backend.ok()) << backend.status();
  EngineConfig config;
  config.scheduler.max_batch_tokens = s.max_batch_tokens;
  config.scheduler.max_num_seqs = s.max_num_seqs;
  config.background_thread = s.background;
  auto engine = Engine::Create(*model, *std::move(backend), NewByteTokenizer(), config);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

// 32 requests: prompts of 1..300 tokens, 1..40 new tokens, half greedy and half sampled.
std::vector<Request> Workload() {
  std::vector<Request> out;
  for (int i = 0; i < 32; ++i) {
    Request r;
    r.id = "r" + std::to_string(i);
    const int len = i == 0 ? 1 : i == 31 ? 300 : 1 + (i * 137) % 300;
    std::mt19937 rng(i);
    for (int t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>(rng() % 256));
    r.stop.max_new_tokens = 1 + (i * 7) % 40;
    if (i % 2 == 1) {
      r.sampling.temperature = 0.9f;
      r.sampling.seed = 1000 + i;
      r.sampling.top_k = i % 3 == 0 ? 20 : 0;
      r.sampling.top_p = i % 4 == 1 ? 0.9f : 1.0f;
      r.sampling.repetition_penalty = i % 5 == 2 ? 1.3f : 1.0f;
    } else {
      r.sampling.temperature = 0.0f;
    }
    if (i % 8 == 3) r.sampling.logprobs = 2;
    // The other controls on a share of each kind (batch invariance holds with them on).
    if (i % 4 == 1) {
      r.sampling.presence_penalty = 0.5f;
      r.sampling.frequency_penalty = 0.3f;
      r.sampling.min_p = 0.05f;
    }
    if (i % 6 == 2) {
      r.sampling.logit_bias = {{32, 3.0f}, {101, -1.0f}};
      r.sampling.bad_words = {{101, 101}, {120}};
    }
    if (i % 7 == 3) r.sampling.min_tokens = r.stop.max_new_tokens / 2;
    if (i % 5 == 4) r.sampling.no_repeat_ngram_size = 1 + i % 3;
    if (i % 9 == 4) {
      for (int32_t t = 32; t < 128; ++t) r.sampling.allowed_token_ids.push_back(t);
    }
    out.push_back(std::move(r));
  }
  return out;
}

struct Result {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason reason = FinishReason::kNone;
  std::vector<float> logprobs;
};

Result Drain(RequestHandle& h) {
  Result r;
  Output o;
  while (h.Next(&o)) {
    r.tokens.insert(r.tokens.end(), o.token_ids.begin(), o.token_ids.end());
    r.text += o.text;
    for (const auto& lp : o.logprobs) r.logprobs.push_back(lp.logprob);
    if (o.finished) r.reason = o.finish_reason;
  }
  return r;
}

std::vector<Result> RunAlone(const std::string& scheme, const std::vector<Request>& work,
                             cpu::WeightType weights = cpu::WeightType::kF32,
                             cpu::KvType kv_type = cpu::KvType::kF32) {
  EngineSetup setup;
  setup.weights = weights;
  setup.kv_type = kv_type;
  auto engine = MakeEngine(scheme, setup);
  std::vector<Result> out;
  for (const Request& r : work) {
    auto h = engine->Submit(r);
    EXPECT_TRUE(h.ok()) << h.status();
    out.push_back(Drain(**h));
  }
  return out;
}

// Submits the first `at_once` requests while the engine is paused (they meet in its first step
// however fast it runs: the load a preemption test needs), then the rest with small random gaps
// while it runs, then reads everything.
std::vector<Result> RunTogether(Engine& engine, const std::vector<Request>& work, size_t at_once = 0) {
  std::mt19937 rng(42);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  if (at_once > 0) engine.Pause();
  for (size_t i = 0; i < work.size(); ++i) {
    auto h = engine.Submit(work[i]);
    EXPECT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
    if (i + 1 == at_once) engine.Resume();
    if (i + 1 > at_once) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
  }
  std::vector<Result> out;
  for (auto& h : handles) out.push_back(Drain(*h));
  return out;
}

void ExpectSame(const std::vector<Result>& got, const std::vector<Result>& alone) {
  ASSERT_EQ(got.size(), alone.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, alone[i].tokens) << "request " << i;
    EXPECT_EQ(got[i].text, alone[i].text) << "request " << i;
    EXPECT_EQ(got[i].reason, alone[i].reason) << "request " << i;
    EXPECT_EQ(got[i].logprobs, alone[i].logprobs) << "request " << i;
  }
}

class EngineSchemeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineSchemeTest, BatchedOutputsEqualAloneOutputs) {
  const std::vector<Request> work = Workload();
  const std::vector<Result> alone = RunAlone(GetParam(), work);
  const int64_t alone_steps = [&] {
    int64_t steps = 0;
    for (const Result& r : alone) steps += static_cast<int64_t>(r.tokens.size());
    return steps;
  }();
  auto engine = MakeEngine(GetParam(), EngineSetup{});
  const std::vector<Result> together = RunTogether(*engine, work, 8);
  ExpectSame(together, alone);
  const EngineStats st = engine->Stats();
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.finished, 32);
  EXPECT_LT(st.steps, alone_steps) << "no batching happened";
  int greedy_tokens = 0;
  for (size_t i = 0; i < alone.size(); i += 2) greedy_tokens += static_cast<int>(alone[i].tokens.size());
  EXPECT_GT(greedy_tokens, 100);
}

TEST_P(EngineSchemeTest, PreemptionKeepsOutputsAndReturnsEveryBlock) {
  const std::vector<Request> work = Workload();
  const std::vector<Result> alone = RunAlone(GetParam(), work);
  // 40 blocks = 640 tokens for a load of ~5000: the longest request alone needs 22 blocks.
  EngineSetup small;
  small.num_blocks = 40;
  auto engine = MakeEngine(GetParam(), small);
  const std::vector<Result> together = RunTogether(*engine, work, 16);
  ExpectSame(together, alone);
  const EngineStats st = engine->Stats();
  EXPECT_GT(st.preemptions, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.kv_blocks_total, 40);
}

INSTANTIATE_TEST_SUITE_P(Schemes, EngineSchemeTest,
                         ::testing::Values("skew", "skew_local", "shaw", "t5", "alibi", "none"));

// Batch invariance holds within each precision of the weights and of the K/V cache, through
// batching and preemption.
class EngineWeightsTest : public ::testing::TestWithParam<std::tuple<std::string, cpu::WeightType, cpu::KvType>> {};

TEST_P(EngineWeightsTest, BatchedAndPreemptedOutputsEqualAloneOutputs) {
  const auto& [scheme, weights, kv_type] = GetParam();
  const std::vector<Request> work = Workload();
  const std::vector<Result> alone = RunAlone(scheme, work, weights, kv_type);
  EngineSetup small;
  small.num_blocks = 40;
  small.weights = weights;
  small.kv_type = kv_type;
  auto engine = MakeEngine(scheme, small);
  ExpectSame(RunTogether(*engine, work, 16), alone);
  const EngineStats st = engine->Stats();
  EXPECT_GT(st.preemptions, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
  // The precision is in effect: greedy outputs differ from the f32 engine's somewhere.
  const std::vector<Result> f32 = RunAlone(scheme, work);
  bool differs = false;
  for (size_t i = 0; i < work.size(); ++i) differs = differs || f32[i].logprobs != alone[i].logprobs;
  EXPECT_TRUE(differs);
}

INSTANTIATE_TEST_SUITE_P(
    Weights, EngineWeightsTest,
    ::testing::Values(std::tuple{std::string("t5"), cpu::WeightType::kInt8, cpu::KvType::kF32},
                      std::tuple{std::string("skew_local"), cpu::WeightType::kBf16, cpu::KvType::kF32},
                      std::tuple{std::string("shaw"), cpu::WeightType::kInt8, cpu::KvType::kF32},
                      std::tuple{std::string("alibi"), cpu::WeightType::kBf16, cpu::KvType::kF32},
                      std::tuple{std::string("t5"), cpu::WeightType::kF32, cpu::KvType::kBf16},
                      std::tuple{std::string("skew"), cpu::WeightType::kInt8, cpu::KvType::kBf16}),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + cpu::WeightTypeName(std::get<1>(info.param)) + "_kv_" +
             cpu::KvTypeName(std::get<2>(info.param));
    });

// ---- cancellation, with the loop driven step by step

Request Prompt(int len, int max_new) {
  Request r;
  for (int i = 0; i < len; ++i) r.prompt.push_back(i % 200 + 32);
  r.stop.max_new_tokens = max_new;
  r.sampling.temperature = 0.0f;
  r.stop.ignore_eos = true;
  return r;
}

class CancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineSetup s;
    s.background = false;
    s.max_batch_tokens = 16;
    s.max_num_seqs = 1;
    engine_ = MakeEngine("skew", s);
  }
  std::unique_ptr<Engine> engine_;
};

TEST_F(CancelTest, BeforeAdmission) {
  auto a = *engine_->Submit(Prompt(10, 30));
  auto b = *engine_->Submit(Prompt(10, 30));
  engine_->RunOnce();  // a admitted; b waits (one running sequence at most)
  EXPECT_EQ(engine_->Stats().num_waiting, 1);
  b->Cancel();
  engine_->RunOnce();
  EXPECT_EQ(engine_->Stats().num_waiting, 0);
  EXPECT_EQ(engine_->Stats().kv_blocks_used, 1);  // a's 11 tokens
  Output o;
  ASSERT_TRUE(b->Next(&o, absl::ZeroDuration()));
  EXPECT_TRUE(o.finished);
  EXPECT_EQ(o.finish_reason, FinishReason::kCancelled);
  EXPECT_TRUE(o.token_ids.empty());
  EXPECT_FALSE(b->Next(&o, absl::ZeroDuration()));
}

TEST_F(CancelTest, DuringPrefill) {
  auto a = *engine_->Submit(Prompt(300, 10));
  for (int i = 0; i < 3; ++i) engine_->RunOnce();  // 48 of 300 prompt tokens
  EXPECT_EQ(engine_->Stats().kv_blocks_used, 3);
  a->Cancel();
  engine_->RunOnce();
  EXPECT_EQ(engine_->Stats().kv_blocks_used, 0);
  EXPECT_EQ(engine_->Stats().num_running, 0);
  Output o;
  ASSERT_TRUE(a->Next(&o, absl::ZeroDuration()));
  EXPECT_EQ(o.finish_reason, FinishReason::kCancelled);
  EXPECT_TRUE(o.token_ids.empty());
}

TEST_F(CancelTest, MidDecodeDropsUnreadOutput) {
  auto a = *engine_->Submit(Prompt(5, 50));
  for (int i = 0; i < 6; ++i) engine_->RunOnce();  // prefill, then 6 tokens generated
  Output o;
  ASSERT_TRUE(a->Next(&o, absl::ZeroDuration()));
  EXPECT_EQ(o.token_ids.size(), 6u);
  engine_->RunOnce();  // a 7th token, not read yet
  a->Cancel();
  engine_->RunOnce();
  EXPECT_EQ(engine_->Stats().kv_blocks_used, 0);
  ASSERT_TRUE(a->Next(&o, absl::ZeroDuration()));
  EXPECT_EQ(o.finish_reason, FinishReason::kCancelled);
  EXPECT_TRUE(o.token_ids.empty()) << "output after cancel";
  EXPECT_FALSE(a->Next(&o, absl::ZeroDuration()));
}

TEST(EngineCancelTest, RandomMomentsWhileRunning) {
  auto engine = MakeEngine("t5", EngineSetup{});
  std::mt19937 rng(3);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 24; ++i) handles.push_back(*engine->Submit(Prompt(1 + rng() % 250, 1 + rng() % 60)));
  int cancelled = 0;
  for (auto& h : handles) {
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 4000));
    if (rng() % 3 != 0) {
      h->Cancel();
      ++cancelled;
      Output o;
      // After Cancel, at most the final output arrives, and it carries no tokens unless the
      // request had already finished on its own.
      while (h->Next(&o)) {
        if (o.finish_reason == FinishReason::kCancelled) EXPECT_TRUE(o.token_ids.empty());
      }
    } else {
      Drain(*h);
    }
  }
  for (int i = 0; i < 24000 && engine->Stats().finished < 24; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(engine->Stats().finished, 24);
  EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
  EXPECT_GT(cancelled, 0);
}

// ---- overlapped steps

// The CPU backend presented as asynchronous, so the engine launches each step before landing the
// one before it (the CPU backend's Launch takes the fed tokens from the draws it holds). The
// test can hold a Collect until it lets it go.
// A backend that hands everything to another; tests override what they watch.
class WrappedBackend : public Backend {
 public:
  explicit WrappedBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  BackendInfo Describe() const override { return inner_->Describe(); }
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override {
    return inner_->Launch(steps, queries);
  }
  absl::Status Collect(std::vector<SampleResult>* results) override { return inner_->Collect(results); }

 protected:
  std::unique_ptr<Backend> inner_;
};

class AheadBackend : public WrappedBackend {
 public:
  using WrappedBackend::WrappedBackend;
  bool asynchronous() const override { return true; }
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override {
    int fed = 0;
    for (const SequenceStep& s : steps) fed += s.fed_query >= 0 ? 1 : 0;
    for (const RowQuery& q : queries) fed += q.fed_query >= 0 ? 1 : 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++launches_;
      if (launches_ - collects_ >= 2) ++ahead_;
      fed_ += fed;
      cv_.notify_all();
    }
    return inner_->Launch(steps, queries);
  }
  absl::Status Collect(std::vector<SampleResult>* results) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (collects_ + 1 == hold_) {
        held_ = true;
        cv_.notify_all();
        cv_.wait(lock, [this] { return hold_ == 0; });
        held_ = false;
      }
    }
    absl::Status st = inner_->Collect(results);
    std::unique_lock<std::mutex> lock(mu_);
    ++collects_;
    return st;
  }

  // The k-th Collect (from 1) waits for Release.
  void HoldCollect(int k) {
    std::unique_lock<std::mutex> lock(mu_);
    hold_ = k;
  }
  // Waits until the held Collect is waiting and `launches` launches have been made; false if that
  // does not happen in a generous bound (the engine did not launch ahead).
  bool WaitWhileHeld(int launches) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(120), [&] { return held_ && launches_ >= launches; });
  }
  void Release() {
    std::unique_lock<std::mutex> lock(mu_);
    hold_ = 0;
    cv_.notify_all();
  }
  int launches() {
    std::unique_lock<std::mutex> lock(mu_);
    return launches_;
  }
  int ahead() {  // launches made while another was outstanding
    std::unique_lock<std::mutex> lock(mu_);
    return ahead_;
  }
  int fed() {  // tokens fed from a launch not yet collected
    std::unique_lock<std::mutex> lock(mu_);
    return fed_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int launches_ = 0, collects_ = 0, ahead_ = 0, fed_ = 0, hold_ = 0;
  bool held_ = false;
};

std::unique_ptr<Engine> MakeAheadEngine(const std::string& scheme, const EngineSetup& s, AheadBackend** ahead,
                                        std::shared_ptr<EngineObserver> observer = nullptr) {
  auto model = Model::Load(testing::GoldenDir() + "/engine/" + scheme);
  EXPECT_TRUE(model.ok()) << model.status();
  auto inner = NewCpuBackend(*model, KvCacheConfig{16, s.num_blocks}, 2, s.weights, s.kv_type);
  EXPECT_TRUE(inner.ok()) << inner.status();
  auto backend = std::make_unique<AheadBackend>(*std::move(inner));
  *ahead = backend.get();
  EngineConfig config;
  config.scheduler.max_batch_tokens = s.max_batch_tokens;
  config.scheduler.max_num_seqs = s.max_num_seqs;
  config.check_invariants = true;
  config.observer = std::move(observer);
  auto engine = Engine::Create(*model, std::move(backend), NewByteTokenizer(), config);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

// Controls that leave no token (only 'A' allowed, and 'A' 'A' a bad word): the sequence ends after
// its one possible token, reason stop, its blocks freed; with steps launched ahead too, where the
// next step was already fed the draw that never came.
TEST(ControlsTest, BanningEveryTokenEndsTheSequence) {
  Request r = Prompt(5, 10);
  r.sampling.temperature = 0.7f;
  r.sampling.seed = 3;
  r.sampling.allowed_token_ids = {'A'};
  r.sampling.bad_words = {{'A', 'A'}};
  r.stop.ignore_eos = true;
  r.stop.stop_strings = {"zz"};  // a held tail is delivered too
  r.prompt.back() = 'B';
  for (bool ahead : {false, true}) {
    SCOPED_TRACE(ahead ? "launched ahead" : "one step at a time");
    AheadBackend* backend = nullptr;
    auto engine = ahead ? MakeAheadEngine("skew", EngineSetup{}, &backend) : MakeEngine("skew", EngineSetup{});
    const Result got = Drain(**engine->Submit(r));
    EXPECT_EQ(got.tokens, std::vector<int32_t>{'A'});
    EXPECT_EQ(got.text, "A");
    EXPECT_EQ(got.reason, FinishReason::kStop);
    EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
    EXPECT_EQ(engine->Stats().finished, 1);
    if (ahead) {
      // A request beside it, in the steps launched ahead of the banned draw, is not harmed.
      Request other = Prompt(7, 12);
      other.sampling.temperature = 0;
      other.stop.ignore_eos = true;
      auto a = *engine->Submit(r);
      auto b = *engine->Submit(other);
      EXPECT_EQ(Drain(*a).tokens, std::vector<int32_t>{'A'});
      const Result second = Drain(*b);
      EXPECT_EQ(second.reason, FinishReason::kLength);
      EXPECT_EQ(second.tokens, Drain(**MakeEngine("skew", EngineSetup{})->Submit(other)).tokens);
      EXPECT_GT(backend->fed(), 0);
    }
  }
}

// Step N + 1 is planned, built and launched while step N is held on the device: its decode token
// is fed from step N's draw, which the host has not seen.
TEST(OverlapTest, TheNextStepIsLaunchedWhileAStepIsHeld) {
  AheadBackend* ahead = nullptr;
  auto engine = MakeAheadEngine("skew", EngineSetup{}, &ahead);
  Request r = Prompt(5, 8);
  r.sampling.temperature = 0.8f;
  r.sampling.seed = 11;
  r.sampling.repetition_penalty = 1.4f;
  ahead->HoldCollect(1);  // the prefill's answers
  auto h = *engine->Submit(r);
  ASSERT_TRUE(ahead->WaitWhileHeld(2)) << "step 2 was not launched while step 1 was held";
  EXPECT_EQ(ahead->ahead(), 1);
  EXPECT_EQ(ahead->fed(), 2);  // its token and its repetition penalty's history
  Output o;
  EXPECT_FALSE(h->Next(&o, absl::ZeroDuration())) << "a token before step 1 landed";
  ahead->Release();
  const Result got = Drain(*h);
  EXPECT_EQ(got.tokens.size(), 8u);
  // The same as one step at a time.
  auto sync = MakeEngine("skew", EngineSetup{});
  EXPECT_EQ(got.tokens, Drain(**sync->Submit(r)).tokens);
  EXPECT_GE(ahead->ahead(), 7);
}

// Batching, chunked prefill, stops (a sequence ends while its next step is in flight), sampling
// with every control, log-probabilities and preemption (which lands the step in flight first):
// the outputs are each request's alone, one step at a time.
class OverlapSchemeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OverlapSchemeTest, OutputsEqualAloneOneStepAtATime) {
  std::vector<Request> work = Workload();
  const std::vector<Result> free_run = RunAlone(GetParam(), work);
  int stops = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    const Result& f = free_run[i];
    if (f.tokens.size() < 6) continue;
    if (i % 3 == 0) work[i].stop.stop_token_ids = {f.tokens[f.tokens.size() / 2]};
    if (i % 3 == 1) work[i].stop.stop_strings = {f.text.substr(f.text.size() / 2, 2)};
    stops += i % 3 != 2 ? 1 : 0;
  }
  ASSERT_GT(stops, 5);
  const std::vector<Result> alone = RunAlone(GetParam(), work);
  int stopped = 0;
  for (const Result& a : alone) stopped += a.reason == FinishReason::kStop ? 1 : 0;
  EXPECT_GE(stopped, 5);
  // The pool ample, then small (24 blocks for the free run's ~5000 tokens, 22 for the longest alone).
  for (int num_blocks : {1024, 24}) {
    SCOPED_TRACE(num_blocks);
    EngineSetup setup;
    setup.num_blocks = num_blocks;
    AheadBackend* ahead = nullptr;
    auto engine = MakeAheadEngine(GetParam(), setup, &ahead);
    if (num_blocks == 1024) {
      ExpectSame(RunTogether(*engine, work, 16), alone);
    } else {
      ExpectSame(RunTogether(*engine, Workload(), 16), free_run);
    }
    const EngineStats st = engine->Stats();
    EXPECT_EQ(st.kv_blocks_used, 0);
    EXPECT_EQ(st.finished, 32);
    EXPECT_GT(ahead->ahead(), 0);
    EXPECT_GT(ahead->fed(), 0);
    if (num_blocks == 24) EXPECT_GT(st.preemptions, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Schemes, OverlapSchemeTest, ::testing::Values("skew", "t5", "alibi"));

// A request cancelled while its step is in flight (and the next launched) ends cancelled with
// nothing after the cancel, every block comes back, and the engine serves on.
TEST(OverlapTest, CancelWhileInFlight) {
  AheadBackend* ahead = nullptr;
  auto engine = MakeAheadEngine("skew", EngineSetup{}, &ahead);
  ahead->HoldCollect(4);
  auto a = *engine->Submit(Prompt(20, 50));
  ASSERT_TRUE(ahead->WaitWhileHeld(5));
  a->Cancel();
  ahead->Release();
  Output o;
  FinishReason reason = FinishReason::kNone;
  while (a->Next(&o)) {
    if (o.finished) reason = o.finish_reason;
  }
  EXPECT_EQ(reason, FinishReason::kCancelled);
  const Request b = Prompt(7, 12);
  const Result got = Drain(**engine->Submit(b));
  auto sync = MakeEngine("skew", EngineSetup{});
  EXPECT_EQ(got.tokens, Drain(**sync->Submit(b)).tokens);
  for (int i = 0; i < 24000 && engine->Stats().num_running > 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
  EXPECT_EQ(engine->Stats().finished, 2);
}

// Pause lands the step in flight: once it returns, nothing runs and every delivered token is there.
TEST(OverlapTest, PauseLandsTheStepInFlight) {
  AheadBackend* ahead = nullptr;
  auto engine = MakeAheadEngine("skew", EngineSetup{}, &ahead);
  ahead->HoldCollect(3);
  auto a = *engine->Submit(Prompt(5, 40));
  ASSERT_TRUE(ahead->WaitWhileHeld(4));
  std::thread pauser([&] { engine->Pause(); });
  // Released only once the pause is requested: the request (40 tokens) cannot finish before it.
  while (!engine->PauseRequested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ahead->Release();
  pauser.join();
  const int launches = ahead->launches();
  Output o;
  ASSERT_TRUE(a->Next(&o, absl::ZeroDuration()));
  const int delivered = static_cast<int>(o.token_ids.size());
  EXPECT_GE(delivered, 3);
  EXPECT_EQ(engine->Stats().num_running, 1);
  // Paused: no launch, no token.
  EXPECT_EQ(ahead->launches(), launches);
  EXPECT_FALSE(a->Next(&o, absl::ZeroDuration()));
  engine->Resume();
  const Result rest = Drain(*a);
  EXPECT_EQ(delivered + static_cast<int>(rest.tokens.size()), 40);
}

// Advance lets paused engines run exactly the steps asked for, a step in flight landing with its
// own: one step's output is seen alone, then two more tokens, then the rest equals an engine never
// paused. Synchronous and overlapped engines alike.
TEST(PauseTest, AdvanceRunsTheStepsAskedFor) {
  for (const bool overlapped : {false, true}) {
    SCOPED_TRACE(overlapped ? "overlapped" : "synchronous");
    AheadBackend* ahead = nullptr;
    auto engine = overlapped ? MakeAheadEngine("skew", EngineSetup{}, &ahead) : MakeEngine("skew", EngineSetup{});
    engine->Pause();
    engine->Advance(1);
    auto a = *engine->Submit(Prompt(5, 40));
    std::vector<int32_t> tokens;
    Output o;
    ASSERT_TRUE(a->Next(&o));
    tokens = o.token_ids;
    EXPECT_EQ(tokens.size(), 1u) << "the prompt's one step yields one token";
    EXPECT_FALSE(o.finished);
    engine->Pause();  // returns once the granted step (and its landing) is done
    EXPECT_FALSE(a->Next(&o, absl::ZeroDuration())) << "a second step ran";
    engine->Advance(2);
    while (tokens.size() < 3 && a->Next(&o)) tokens.insert(tokens.end(), o.token_ids.begin(), o.token_ids.end());
    engine->Pause();
    EXPECT_EQ(tokens.size(), 3u);
    EXPECT_FALSE(a->Next(&o, absl::ZeroDuration())) << "a fourth step ran";
    EXPECT_EQ(engine->Stats().num_running, 1);
    engine->Resume();
    const Result rest = Drain(*a);
    tokens.insert(tokens.end(), rest.tokens.begin(), rest.tokens.end());
    auto plain = MakeEngine("skew", EngineSetup{});
    EXPECT_EQ(tokens, Drain(**plain->Submit(Prompt(5, 40))).tokens);
  }
}

// The output of a sequence's last token carries its end: a reader that takes every output the
// moment it is delivered (here the handle's listener, on the engine's thread) never gets the end
// alone after it, so a stream's last chunk carries the last token. Ends by length, by a stop token
// and by a stop string. (A draw that finds every token banned ends with no token of its own: its
// end comes after the last token's output, which went out a step before.)
TEST(OutputTest, TheLastTokenCarriesTheEnd) {
  auto engine = MakeEngine("skew", EngineSetup{});
  struct Case {
    const char* what;
    Request r;
    FinishReason reason;
  };
  std::vector<Case> cases;
  cases.push_back({"length", Prompt(5, 3), FinishReason::kLength});
  Request stop_token = Prompt(5, 10);
  stop_token.sampling.allowed_token_ids = {'q'};
  stop_token.stop.stop_token_ids = {'q'};
  cases.push_back({"stop token", stop_token, FinishReason::kStop});
  Request stop_string = Prompt(5, 10);
  stop_string.sampling.allowed_token_ids = {'q'};
  stop_string.stop.stop_strings = {"qq"};
  cases.push_back({"stop string", stop_string, FinishReason::kStop});
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::shared_ptr<RequestHandle> h = *engine->Submit(c.r);
    std::mutex mu;
    std::vector<Output> outs;
    bool ended = false;
    std::condition_variable cv;
    h->SetListener([&] {
      std::lock_guard<std::mutex> lock(mu);
      Output o;
      while (h->Next(&o, absl::ZeroDuration())) {
        ended |= o.finished;
        outs.push_back(std::move(o));
      }
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return ended; });
    ASSERT_FALSE(outs.empty());
    for (size_t i = 0; i < outs.size(); ++i) {
      EXPECT_FALSE(outs[i].token_ids.empty()) << "output " << i << " of " << outs.size() << " carries no token";
      EXPECT_EQ(outs[i].finished, i + 1 == outs.size()) << "output " << i;
    }
    EXPECT_EQ(outs.back().finish_reason, c.reason);
  }
}

// ---- host time per step

using SteadyClock = std::chrono::steady_clock;

absl::Duration Since(SteadyClock::time_point t) { return absl::FromChrono(SteadyClock::now() - t); }

// Returns once the engine's monotonic clock has advanced by at least `d` since the call: a lower
// bound on the time the caller spent here, whatever the machine's load.
void HoldFor(absl::Duration d) {
  const SteadyClock::time_point until = SteadyClock::now() + absl::ToChronoNanoseconds(d);
  while (SteadyClock::now() < until) std::this_thread::sleep_until(until);
}

// Records each step's host times; optionally holds every token's delivery (part of the landing).
class HostTimesObserver : public EngineObserver {
 public:
  explicit HostTimesObserver(absl::Duration token_hold = absl::ZeroDuration()) : token_hold_(token_hold) {}
  void OnStepHostTimes(const StepHostTimes& t) override {
    std::unique_lock<std::mutex> lock(mu_);
    times_.push_back(t);
  }
  void OnToken(absl::Duration) override { HoldFor(token_hold_); }
  std::vector<StepHostTimes> times() {
    std::unique_lock<std::mutex> lock(mu_);
    return times_;
  }

 private:
  const absl::Duration token_hold_;
  std::mutex mu_;
  std::vector<StepHostTimes> times_;
};

// Holds each Launch and each Collect for at least a given time before answering.
class SlowBackend : public WrappedBackend {
 public:
  SlowBackend(std::unique_ptr<Backend> inner, absl::Duration launch, absl::Duration collect)
      : WrappedBackend(std::move(inner)), launch_(launch), collect_(collect) {}
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override {
    HoldFor(launch_);
    return inner_->Launch(steps, queries);
  }
  absl::Status Collect(std::vector<SampleResult>* results) override {
    HoldFor(collect_);
    return inner_->Collect(results);
  }

 private:
  const absl::Duration launch_, collect_;
};

void ExpectPartsMakeTheStep(const std::vector<StepHostTimes>& times, const EngineStats& st) {
  StepHostTimes sum;
  for (const StepHostTimes& t : times) {
    EXPECT_GE(t.plan, absl::ZeroDuration());
    EXPECT_GE(t.wait, absl::ZeroDuration());
    EXPECT_GE(t.land, absl::ZeroDuration());
    EXPECT_EQ(t.plan + t.wait + t.land, t.step);
    sum.plan += t.plan;
    sum.wait += t.wait;
    sum.land += t.land;
    sum.step += t.step;
  }
  // The engine's running totals are the observed steps' (durations add exactly).
  EXPECT_EQ(st.host_timed_steps, static_cast<int64_t>(times.size()));
  EXPECT_EQ(st.host_times.plan, sum.plan);
  EXPECT_EQ(st.host_times.wait, sum.wait);
  EXPECT_EQ(st.host_times.land, sum.land);
  EXPECT_EQ(st.host_times.step, sum.step);
}

// One step at a time, the backend's Launch counts as planning, its Collect as waiting and the
// token deliveries as landing: each step's parts are at least what the test held each of them for.
TEST(HostTimeTest, EachPhaseIsCountedWhereItRuns) {
  const absl::Duration launch = absl::Milliseconds(3), collect = absl::Milliseconds(2), deliver = absl::Milliseconds(1);
  auto model = Model::Load(testing::GoldenDir() + "/engine/skew");
  ASSERT_TRUE(model.ok()) << model.status();
  auto inner = NewCpuBackend(*model, KvCacheConfig{16, 64}, 2, cpu::WeightType::kF32, cpu::KvType::kF32);
  ASSERT_TRUE(inner.ok()) << inner.status();
  auto observer = std::make_shared<HostTimesObserver>(deliver);
  EngineConfig config;
  config.background_thread = false;
  config.observer = observer;
  auto engine = *Engine::Create(*model, std::make_unique<SlowBackend>(*std::move(inner), launch, collect),
                                NewByteTokenizer(), config);
  // Both prompts fit the first step: 6 steps, each delivering a token of each request.
  auto a = *engine->Submit(Prompt(5, 6));
  auto b = *engine->Submit(Prompt(9, 6));
  for (int i = 0; i < 6; ++i) engine->RunOnce();
  EXPECT_EQ(Drain(*a).tokens.size(), 6u);
  EXPECT_EQ(Drain(*b).tokens.size(), 6u);
  engine->RunOnce();  // nothing to run: no step to time
  const EngineStats st = engine->Stats();
  const std::vector<StepHostTimes> times = observer->times();
  EXPECT_EQ(st.steps, 6);
  ASSERT_EQ(times.size(), 6u);
  for (const StepHostTimes& t : times) {
    EXPECT_GE(t.plan, launch);
    EXPECT_GE(t.wait, collect);
    EXPECT_GE(t.land, 2 * deliver);
  }
  ExpectPartsMakeTheStep(times, st);
}

// With steps launched ahead, the step whose answers the test holds on the device is waited for
// at least as long as the test provably held it, and counted in the iteration that lands it.
TEST(HostTimeTest, WaitingForAHeldStepIsCounted) {
  auto observer = std::make_shared<HostTimesObserver>();
  AheadBackend* ahead = nullptr;
  auto engine = MakeAheadEngine("skew", EngineSetup{}, &ahead, observer);
  ahead->HoldCollect(3);
  auto h = *engine->Submit(Prompt(5, 8));
  ASSERT_TRUE(ahead->WaitWhileHeld(4));
  // From here until Release the engine thread is inside the third Collect.
  const SteadyClock::time_point held = SteadyClock::now();
  HoldFor(absl::Milliseconds(20));
  const absl::Duration at_least = Since(held);
  ahead->Release();
  EXPECT_EQ(Drain(*h).tokens.size(), 8u);
  engine->Pause();  // the iteration that delivered the last token has ended, and been counted
  const EngineStats st = engine->Stats();
  const std::vector<StepHostTimes> times = observer->times();
  // Every launch is timed where it is made, every landing where it lands; the last landing
  // launches nothing.
  EXPECT_EQ(st.steps, 8);
  ASSERT_EQ(times.size(), 9u);
  EXPECT_EQ(times.front().wait, absl::ZeroDuration()) << "the first iteration lands nothing";
  // The third Collect lands step 3, in the fourth iteration (which launched step 4 first).
  EXPECT_GE(times[3].wait, at_least);
  ExpectPartsMakeTheStep(times, st);
  engine->Resume();
}

// ---- submission checks

TEST(EngineSubmitTest, RefusesWhatCanNeverRun) {
  EngineSetup s;
  s.num_blocks = 8;  // 128 tokens
  auto engine = MakeEngine("none", s);
  Request big = Prompt(100, 40);
  // 100 + 40 > 128: max_new_tokens may be at most 128 - 100; a 128-token prompt leaves no room at all.
  EXPECT_EQ(engine->Submit(big).status().message(),
            "max_new_tokens: prompt (100 tokens) + max_new_tokens (40) = 140 tokens can never fit the KV cache of 128 tokens; set "
            "max_new_tokens to at most 28 or shorten the prompt, or start the server with a larger --kv_cache_tokens");
  EXPECT_EQ(engine->Submit(big).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(engine->Submit(Prompt(128, 1)).status().message(),
              HasSubstr("= 129 tokens can never fit the KV cache of 128 tokens; shorten the prompt to under 128 tokens"));
  EXPECT_THAT(engine->Submit(Prompt(0, 4)).status().message(), HasSubstr("prompt: empty; allowed 1 or more tokens"));
  Request bad = Prompt(4, 4);
  bad.prompt[2] = 259;
  EXPECT_THAT(engine->Submit(bad).status().message(), HasSubstr("prompt: ids[2] = 259; allowed 0..258"));
  EXPECT_THAT(engine->Submit(Prompt(500, 20)).status().message(), HasSubstr("max_new_tokens: 20 after a prompt of 500 tokens exceeds the model's context of 512 tokens; allowed 0..12"));
  EXPECT_TRUE(engine->Submit(Prompt(100, 28)).ok());
}

TEST(EngineSubmitTest, QueueFullAndShutdown) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/none");
  EngineConfig config;
  config.max_waiting = 2;
  config.background_thread = false;
  auto engine = *Engine::Create(model, *NewCpuBackend(model, KvCacheConfig{16, 64}, 1), NewByteTokenizer(), config);
  auto a = *engine->Submit(Prompt(4, 4));
  ASSERT_TRUE(engine->Submit(Prompt(4, 4)).ok());
  EXPECT_EQ(engine->Submit(Prompt(4, 4)).status().code(), absl::StatusCode::kResourceExhausted);
  engine->Shutdown();
  EXPECT_EQ(engine->Submit(Prompt(4, 4)).status().code(), absl::StatusCode::kUnavailable);
  Output o;
  ASSERT_TRUE(a->Next(&o, absl::ZeroDuration()));
  EXPECT_EQ(o.finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kUnavailable);
}

TEST(KvSizingTest, TokensOrMemoryFraction) {
  const ModelConfig c = (*Model::Load(testing::GoldenDir() + "/engine/skew"))->config();
  // 2 layers x 4 heads x 16 dims x K and V x 4 bytes = 1024 bytes per token.
  EXPECT_EQ(CpuKvBytesPerToken(c), 1024);
  EXPECT_EQ(*CpuKvBlocks(c, 1000, 0, 16), 63);
  EXPECT_THAT(CpuKvBlocks(c, 100, 0, 16).status().message(),
              HasSubstr("cannot hold one sequence of max_seq_len 512"));
  const auto by_memory = CpuKvBlocks(c, 0, 0.01, 16);
  ASSERT_TRUE(by_memory.ok()) << by_memory.status();
  EXPECT_GT(*by_memory, 32);
  EXPECT_THAT(CpuKvBlocks(c, 0, 1.5, 16).status().message(), HasSubstr("allowed (0, 1]"));
}

// --kv_cache_dtype through NewBackend: bf16 halves the pool's bytes, so the same memory holds
// twice the tokens.
TEST(DeviceKvTypeTest, Bf16HalvesTheCache) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const ModelConfig& c = model->config();
  EXPECT_EQ(CpuKvBytesPerToken(c, cpu::KvType::kBf16), 512);  // 1024 in f32 (KvSizingTest)
  std::map<std::string, int64_t> bytes;
  for (const char* t : {"f32", "bf16"}) {
    DeviceOptions o;
    o.device = "cpu";
    o.kv_cache_tokens = 1024;
    o.kv_cache_dtype = t;
    auto backend = NewBackend(model, o);
    ASSERT_TRUE(backend.ok()) << t << ": " << backend.status();
    EXPECT_EQ((*backend)->Describe().kv_cache.num_blocks, 64) << t;
    bytes[t] = (*backend)->Describe().memory.kv_cache;
  }
  EXPECT_EQ(bytes["f32"], 1024 * 1024);
  EXPECT_EQ(bytes["bf16"], 512 * 1024);
}

// --weights_dtype through NewBackend: the CPU stores what was asked.
TEST(DeviceWeightsTest, CpuStoresTheAskedType) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  std::map<std::string, int64_t> weights;
  for (const char* t : {"f32", "bf16", "int8"}) {
    DeviceOptions o;
    o.device = "cpu";
    o.kv_cache_tokens = 1024;
    o.weights_dtype = t;
    auto backend = NewBackend(model, o);
    ASSERT_TRUE(backend.ok()) << t << ": " << backend.status();
    weights[t] = (*backend)->Describe().memory.weights;
  }
  // The packed copies shrink by 2x and 4x (the small tensors and the stored embedding, counted in
  // each, stay); int8 adds 8 bytes per output (scale and offset), 3% of this model's 64-wide rows.
  const int64_t original = model->small_bytes() + model->embed().bytes();
  EXPECT_NEAR(double(weights["bf16"] - original) / (weights["f32"] - original), 0.5, 0.01);
  EXPECT_NEAR(double(weights["int8"] - original) / (weights["f32"] - original), 0.28, 0.02);
}

// auto: a bf16 checkpoint computes from bf16 weights with bf16 K/V; a float32 one in float32; an
// explicit type wins. (Which goldens are stored in bf16: tools/make_goldens.py.)
TEST(DeviceWeightsTest, AutoFollowsTheCheckpointsType) {
  for (const auto& [name, stored, expected] :
       {std::tuple{"shaw_values_long_range", DType::kBF16, "bf16"}, std::tuple{"skew_local_long_range", DType::kBF16, "bf16"},
        std::tuple{"skew_short_range", DType::kF32, "f32"}}) {
    auto model = *Model::Load(testing::GoldenDir() + "/" + name);
    ASSERT_EQ(model->file_dtype(), stored) << name;
    DeviceOptions o;
    o.device = "cpu";
    o.kv_cache_tokens = 1024;
    auto backend = NewBackend(model, o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->Describe().weights_dtype, expected) << name;
    EXPECT_EQ((*backend)->Describe().kv_cache_dtype, expected) << name;
    o.weights_dtype = "f32";
    o.kv_cache_dtype = "f32";
    EXPECT_EQ((*NewBackend(model, o))->Describe().weights_dtype, "f32") << name;
  }
}

// --activations_dtype bf16 (CPU): every projection's input rounded to bf16 (with bf16 weights,
// AMX-BF16 or AVX-512 BF16 dot products where the CPU has them): the logits move from the float32-input ones,
// a sequence's logits are the same bits alone and beside another, prefill in one step or in two.
// A GPU refuses it, naming its own way.
TEST(DeviceWeightsTest, Bf16ActivationsTakeEffectAndStayBatchInvariant) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const int vocab = model->config().vocab_size;
  auto make = [&](const std::string& activations) {
    DeviceOptions o;
    o.device = "cpu";
    o.kv_cache_tokens = 1024;
    o.kv_block_size = 16;
    o.weights_dtype = "bf16";
    o.activations_dtype = activations;
    auto b = NewBackend(model, o);
    EXPECT_TRUE(b.ok()) << b.status();
    return std::move(*b);
  };
  std::vector<int32_t> a(37), b(21);
  for (size_t i = 0; i < a.size(); ++i) a[i] = int32_t((i * 7 + 3) % 200 + 20);
  for (size_t i = 0; i < b.size(); ++i) b[i] = int32_t((i * 11 + 5) % 200 + 20);
  const std::vector<int32_t> table_a = {0, 1, 2}, table_b = {3, 4};
  auto logits = [&](Backend& be, std::vector<SequenceStep> steps) {
    std::vector<float> out;
    EXPECT_TRUE(ForwardLogits(be, steps, &out).ok());
    return out;
  };
  auto rounded = make("bf16");
  auto plain = make("f32");
  const std::vector<float> alone = logits(*rounded, {SequenceStep{a, 0, table_a, true}});
  const std::vector<float> together =
      logits(*rounded, {SequenceStep{b, 0, table_b, true}, SequenceStep{a, 0, table_a, true}});
  ASSERT_EQ(alone.size(), a.size() * vocab);
  ASSERT_EQ(together.size(), (a.size() + b.size()) * vocab);
  EXPECT_EQ(std::memcmp(alone.data(), together.data() + b.size() * vocab, alone.size() * sizeof(float)), 0);
  // The same sequence prefilled in two chunks: the second chunk's logits are the same bits.
  const std::vector<int32_t> head(a.begin(), a.begin() + 20), tail(a.begin() + 20, a.end());
  logits(*rounded, {SequenceStep{head, 0, table_a, true}});
  const std::vector<float> second = logits(*rounded, {SequenceStep{tail, 20, table_a, true}});
  EXPECT_EQ(std::memcmp(second.data(), alone.data() + 20 * vocab, second.size() * sizeof(float)), 0);
  const std::vector<float> unrounded = logits(*plain, {SequenceStep{a, 0, table_a, true}});
  double moved = 0;
  for (size_t i = 0; i < alone.size(); ++i) moved = std::max(moved, double(std::fabs(alone[i] - unrounded[i])));
  EXPECT_GT(moved, 0) << "the rounding in effect";
  EXPECT_LT(moved, 0.5) << "bf16 inputs stay near float32 inputs";

  DeviceOptions gpu;
  gpu.device = "cuda";
  gpu.activations_dtype = "bf16";
  const auto refused = ResolveDeviceOptions(*model, gpu);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("--cuda_gemm mma"));
}

// Storage type (and CUDA projection) names NewBackend does not know are refused with the allowed ones.
TEST(DeviceOptionsTest, UnknownStorageTypesAreRefusedWithTheAllowedOnes) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  for (const auto& [field, name, message] :
       {std::tuple{&DeviceOptions::weights_dtype, "fp16", "--weights_dtype fp16: allowed auto, f32, bf16, int8"},
        std::tuple{&DeviceOptions::kv_cache_dtype, "fp8", "--kv_cache_dtype fp8: allowed auto, f32, bf16"},
        std::tuple{&DeviceOptions::activations_dtype, "fp16", "--activations_dtype fp16: allowed auto, f32, bf16"},
        std::tuple{&DeviceOptions::cuda_gemm, "fast", "--cuda_gemm fast: allowed auto, invariant, cublas, mma"},
        std::tuple{&DeviceOptions::cuda_attention, "flash", "--cuda_attention flash: allowed simt, mma"}}) {
    DeviceOptions o;
    o.device = "cpu";
    o.kv_cache_tokens = 1024;
    o.*field = name;
    const auto refused = NewBackend(model, o);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(refused.status().message(), HasSubstr(message));
  }
}

// What `auto` picks per device and checkpoint (the device named, so no GPU is needed to ask).
TEST(DeviceOptionsTest, AutoPicksPerDeviceAndCheckpoint) {
  auto f32_model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  ASSERT_EQ(f32_model->file_dtype(), DType::kF32);
  struct Case {
    std::string device, weights, kv, gemm;        // asked
    std::string want_weights, want_kv, want_gemm;  // chosen
  };
  for (const Case& k : std::vector<Case>{
           {"cuda", "auto", "auto", "auto", "bf16", "bf16", "invariant"},
           {"cuda:0", "auto", "auto", "auto", "bf16", "bf16", "invariant"},
           {"cuda", "f32", "auto", "auto", "f32", "bf16", "invariant"},
           {"cuda", "auto", "f32", "invariant", "bf16", "f32", "invariant"},
           {"cuda", "auto", "auto", "cublas", "bf16", "bf16", "cublas"},
           {"cuda", "f32", "auto", "cublas", "f32", "bf16", "cublas"},
           {"cuda", "auto", "auto", "mma", "bf16", "bf16", "mma"},
           {"cpu", "auto", "auto", "auto", "f32", "f32", "invariant"},
           {"cpu", "bf16", "auto", "auto", "bf16", "f32", "invariant"},
       }) {
    DeviceOptions o;
    o.device = k.device;
    o.weights_dtype = k.weights;
    o.kv_cache_dtype = k.kv;
    o.cuda_gemm = k.gemm;
    const std::string what = k.device + " " + k.weights + " " + k.kv + " " + k.gemm;
    auto got = ResolveDeviceOptions(*f32_model, o);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status();
    EXPECT_EQ(got->device, k.device.substr(0, 4) == "cuda" ? "cuda" : k.device) << what;
    EXPECT_EQ(got->weights_dtype, k.want_weights) << what;
    EXPECT_EQ(got->kv_cache_dtype, k.want_kv) << what;
    EXPECT_EQ(got->cuda_gemm, k.want_gemm) << what;
    // Inputs: bf16 only for bf16 weights on a CPU that multiplies bf16 pairs.
    const bool bf16_inputs = k.device == "cpu" && k.want_weights == "bf16" && cpu::Bf16DotSupported();
    EXPECT_EQ(got->activations_dtype, bf16_inputs ? "bf16" : "f32") << what;
  }
  // Asked for, the inputs are what was asked (a GPU refuses bf16: Bf16ActivationsTakeEffect...).
  for (const std::string weights : {"f32", "bf16"}) {
    for (const std::string inputs : {"f32", "bf16"}) {
      DeviceOptions o;
      o.device = "cpu";
      o.weights_dtype = weights;
      o.activations_dtype = inputs;
      auto got = ResolveDeviceOptions(*f32_model, o);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->activations_dtype, inputs) << weights;
    }
  }
  // A bf16 checkpoint: bf16 on both devices, whichever kernel multiplies.
  auto bf16_model = *Model::Load(testing::GoldenDir() + "/shaw_values_long_range");
  ASSERT_EQ(bf16_model->file_dtype(), DType::kBF16);
  for (const auto& [device, gemm, weights, kv] :
       {std::tuple{"cpu", "auto", "bf16", "bf16"}, std::tuple{"cuda", "auto", "bf16", "bf16"},
        std::tuple{"cuda", "mma", "bf16", "bf16"}, std::tuple{"cuda", "cublas", "bf16", "bf16"}}) {
    DeviceOptions o;
    o.device = device;
    o.cuda_gemm = gemm;
    auto got = ResolveDeviceOptions(*bf16_model, o);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->weights_dtype, weights) << device << " " << gemm;
    EXPECT_EQ(got->kv_cache_dtype, kv) << device << " " << gemm;
    EXPECT_EQ(got->activations_dtype, std::string(device) == "cpu" && cpu::Bf16DotSupported() ? "bf16" : "f32")
        << device << " " << gemm;
  }
}

// ---- stops

TEST(EngineStopTest, StopStringIsNotLeakedAndStopTokenEnds) {
  auto engine = MakeEngine("skew", EngineSetup{});
  Request r = Prompt(30, 60);
  const Result free_run = Drain(**engine->Submit(r));
  ASSERT_GE(free_run.text.size(), 20u);
  // A stop string taken from the middle of the free run's text.
  const std::string stop = free_run.text.substr(10, 3);
  r.stop.stop_strings = {"\xff\xfe never", stop};
  const Result stopped = Drain(**engine->Submit(r));
  EXPECT_EQ(stopped.reason, FinishReason::kStop);
  EXPECT_EQ(stopped.text, free_run.text.substr(0, free_run.text.find(stop)));
  // A stop token: generation ends right after its first occurrence.
  Request t = Prompt(30, 60);
  t.stop.stop_token_ids = {free_run.tokens[7]};
  const Result tok = Drain(**engine->Submit(t));
  const size_t first = std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[7]) - free_run.tokens.begin();
  EXPECT_EQ(tok.reason, FinishReason::kStop);
  EXPECT_EQ(tok.tokens, std::vector<int32_t>(free_run.tokens.begin(), free_run.tokens.begin() + first + 1));
}

// ---- beam search ----------------------------------------------------------------------------

struct Beams {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<double> scores;
  std::vector<FinishReason> reasons;
  bool operator==(const Beams& o) const { return tokens == o.tokens && scores == o.scores && reasons == o.reasons; }
};

Beams DrainBeams(const std::vector<std::shared_ptr<RequestHandle>>& handles) {
  Beams b;
  for (const auto& h : handles) {
    Output o, all;
    while (h->Next(&o)) {
      all.token_ids.insert(all.token_ids.end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) all = Output{all.token_ids, "", {}, {}, true, o.finish_reason, o.status, 0, 0, {}, o.beam_score};
    }
    b.tokens.push_back(all.token_ids);
    b.scores.push_back(all.beam_score);
    b.reasons.push_back(all.finish_reason);
  }
  return b;
}

Request BeamRequest(int len, int max_new, int k, uint32_t seed) {
  Request r;
  std::mt19937 rng(seed);
  for (int i = 0; i < len; ++i) r.prompt.push_back(static_cast<int32_t>(32 + rng() % 200));
  r.stop.max_new_tokens = max_new;
  r.num_beams = k;
  r.num_return_sequences = k;
  return r;
}

// Records the most distinct KV blocks one launch's sequences reference together.
class TableBackend : public WrappedBackend {
 public:
  using WrappedBackend::WrappedBackend;
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override {
    std::set<int32_t> blocks;
    for (const SequenceStep& s : steps) blocks.insert(s.block_table.begin(), s.block_table.end());
    most_ = std::max(most_, static_cast<int>(blocks.size()));
    most_seqs_ = std::max(most_seqs_, static_cast<int>(steps.size()));
    return inner_->Launch(steps, queries);
  }
  int most() const { return most_; }
  int most_seqs() const { return most_seqs_; }

 private:
  int most_ = 0, most_seqs_ = 0;
};

std::unique_ptr<Engine> MakeBeamEngine(int num_blocks, bool share, int max_num_seqs = 16, int max_batch_tokens = 96,
                                       bool background = false, TableBackend** tables = nullptr) {
  auto model = Model::Load(testing::GoldenDir() + "/engine/skew");
  EXPECT_TRUE(model.ok()) << model.status();
  auto inner = NewCpuBackend(*model, KvCacheConfig{16, num_blocks}, 2, cpu::WeightType::kF32, cpu::KvType::kF32);
  EXPECT_TRUE(inner.ok()) << inner.status();
  auto backend = std::make_unique<TableBackend>(*std::move(inner));
  if (tables != nullptr) *tables = backend.get();
  EngineConfig config;
  config.scheduler.max_batch_tokens = max_batch_tokens;
  config.scheduler.max_num_seqs = max_num_seqs;
  config.background_thread = background;
  config.prefix_caching = false;
  config.share_beam_blocks = share;
  config.check_invariants = true;
  auto engine = Engine::Create(*model, std::move(backend), NewByteTokenizer(), config);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

// Beams alone on a large pool, one step at a time.
Beams Alone(const Request& r) { return DrainBeams(*MakeBeamEngine(256, true, 16, 96, true)->SubmitGroup(r)); }

// k beams of a 100-token prompt (6 full blocks of 16 and 4 tokens) and 8 new tokens, all k in
// each step: with sharing, their block tables hold the prompt's full blocks once and one block
// per beam (its copy of the partial block, recomputed, and its tokens); without, every beam holds
// its own 7. The outputs are bitwise the same either way.
TEST(BeamTest, BeamsHoldThePromptsFullBlocksOnce) {
  for (int k : {2, 4, 8}) {
    SCOPED_TRACE(::testing::Message() << "num_beams " << k);
    Request r = BeamRequest(100, 8, k, 5);
    r.stop.ignore_eos = true;  // every beam runs to the end
    Beams out[2];
    for (bool share : {true, false}) {
      TableBackend* tables = nullptr;
      auto engine = MakeBeamEngine(256, share, 16, 1024, false, &tables);
      auto handles = engine->SubmitGroup(r);
      ASSERT_TRUE(handles.ok()) << handles.status();
      for (int step = 0; step < 200 && engine->Stats().finished == 0; ++step) engine->RunOnce();
      ASSERT_EQ(engine->Stats().finished, 1);
      EXPECT_EQ(tables->most_seqs(), k);
      EXPECT_EQ(tables->most(), share ? 6 + k : 7 * k);
      EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
      out[share ? 0 : 1] = DrainBeams(*handles);
    }
    EXPECT_TRUE(out[0] == out[1]);
    ASSERT_EQ(out[0].tokens.size(), static_cast<size_t>(k));
    for (int i = 0; i < k; ++i) {
      EXPECT_EQ(out[0].tokens[i].size(), 8u);
      EXPECT_EQ(out[0].reasons[i], FinishReason::kLength);
      if (i > 0) EXPECT_GE(out[0].scores[i - 1], out[0].scores[i]);
    }
  }
}

// Two beam groups and a sampled request on a pool too small for all of them and fewer running
// places than beams: beams wait idle, are preempted and recomputed, forks wait for places; every
// output is bitwise what it is alone on a large pool.
TEST(BeamTest, TheSameBeamsUnderPressure) {
  Request a = BeamRequest(40, 12, 4, 1);
  Request b = BeamRequest(23, 10, 3, 2);
  b.length_penalty = 0.5f;
  b.early_stopping = EarlyStopping::kTrue;
  Request c = Prompt(30, 20);
  c.sampling.temperature = 0.8f;
  c.sampling.seed = 9;
  const Beams want_a = Alone(a), want_b = Alone(b), want_c = Alone(c);
  for (bool share : {true, false}) {
    SCOPED_TRACE(share ? "sharing" : "not sharing");
    auto engine = MakeBeamEngine(24, share, /*max_num_seqs=*/3, /*max_batch_tokens=*/32);
    auto ha = *engine->SubmitGroup(a);
    auto hb = *engine->SubmitGroup(b);
    auto hc = *engine->SubmitGroup(c);
    for (int step = 0; step < 5000 && engine->Stats().finished < 3; ++step) engine->RunOnce();
    ASSERT_EQ(engine->Stats().finished, 3);
    EXPECT_GT(engine->Stats().preemptions, 0);
    EXPECT_TRUE(DrainBeams(ha) == want_a);
    EXPECT_TRUE(DrainBeams(hb) == want_b);
    EXPECT_TRUE(DrainBeams(hc) == want_c);
    EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
  }
}

// With steps launched ahead (the engine thread over an asynchronous backend), beams step only when
// every sibling's answer has landed: the outputs are those of one step at a time.
TEST(BeamTest, LaunchingAheadLeavesBeamsAsTheyAre) {
  Request a = BeamRequest(20, 9, 3, 4);
  Request c = Prompt(12, 15);
  c.sampling.temperature = 0.7f;
  AheadBackend* backend = nullptr;
  auto engine = MakeAheadEngine("skew", EngineSetup{}, &backend);
  auto ha = *engine->SubmitGroup(a);
  auto hc = *engine->SubmitGroup(c);
  EXPECT_TRUE(DrainBeams(ha) == Alone(a));
  EXPECT_TRUE(DrainBeams(hc) == Alone(c));
  EXPECT_GT(backend->fed(), 0);
}

// Cancelling any returned sequence's handle ends the whole group, its blocks freed; so does the deadline.
TEST(BeamTest, CancelAndDeadlineEndTheGroup) {
  for (bool deadline : {false, true}) {
    auto engine = MakeBeamEngine(256, true);
    Request r = BeamRequest(30, 20, 4, 3);
    r.num_return_sequences = 2;
    if (deadline) r.deadline = absl::Now() - absl::Seconds(1);
    auto h = *engine->SubmitGroup(r);
    ASSERT_EQ(h.size(), 2u);
    engine->RunOnce();
    engine->RunOnce();
    if (!deadline) h[1]->Cancel();
    engine->RunOnce();
    const Beams got = DrainBeams(h);
    const FinishReason want = deadline ? FinishReason::kDeadline : FinishReason::kCancelled;
    EXPECT_EQ(got.reasons, (std::vector<FinishReason>{want, want}));
    EXPECT_EQ(engine->Stats().finished, 1);
    EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
    EXPECT_EQ(engine->Stats().num_running, 0);
  }
}

TEST(BeamTest, RefusalsNameTheField) {
  auto engine = MakeBeamEngine(64, true);
  auto refused = [&](Request r, const std::string& field) {
    auto h = engine->SubmitGroup(r);
    ASSERT_FALSE(h.ok()) << field;
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(h.status().message()), HasSubstr(field));
  };
  Request r = BeamRequest(10, 8, 4, 1);
  r.num_beams = 17;
  refused(r, "num_beams");
  r = BeamRequest(10, 8, 4, 1);
  r.num_return_sequences = 5;
  refused(r, "num_return_sequences");
  r = BeamRequest(10, 8, 4, 1);
  r.sampling.repetition_penalty = 1.3f;
  refused(r, "repetition_penalty");
  r = BeamRequest(10, 8, 4, 1);
  r.stop.stop_strings = {"x"};
  refused(r, "stop: not with num_beams > 1 (4)");
  r = BeamRequest(10, 8, 16, 1);
  r.stop.max_new_tokens = 200;  // 16 beams of 13 blocks each do not fit 64
  refused(r, "--kv_cache_tokens");
}

}  // namespace
}  // namespace relgen
