// Hugging Face T5 / mT5 encoder-decoder checkpoints, served as transformers saves them, against
// transformers' own float32 outputs (tools/make_t5_checkpoints.py): every decoder step's logits and
// greedy token through the CPU backend for inputs of 1..500 tokens; chunked == stepwise and sharded
// == unsharded bitwise; the tokenizer; continuous batching (each request equal to it alone, bitwise,
// under preemption too, no block left after finish, cancel or deadline). The server: t5_server_test.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/backends/cpu_backend.h"
#include "engine/backends/device.h"
#include "engine/core/engine.h"
#include "engine/model/hf_checkpoint.h"
#include "engine/model/model.h"
#include "engine/tokenizers/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/t5_reference.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

constexpr double kRtol = 1e-4;  // float32 relgen vs float32 transformers

std::vector<std::string> CaseNames() {
  std::vector<std::string> names;
  for (const auto& c : testing::T5Cases()) names.push_back(c["name"]);
  return names;
}

nlohmann::json Case(const std::string& name) {
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] == name) return c;
  }
  return {};
}

std::string TestName(std::string n) {
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

std::unique_ptr<Backend> Cpu(const std::shared_ptr<const Model>& model, int blocks = 128) {
  return *NewCpuBackend(model, KvCacheConfig{16, blocks}, 2);
}

TEST(T5FixtureTest, CasesExist) {
  ASSERT_FALSE(testing::T5CasesDir().empty()) << "RELGEN_T5_CASES_DIR is not set (ctest fixture t5_checkpoints)";
  EXPECT_EQ(testing::T5Cases().size(), 4u);
  EXPECT_GE(testing::T5Manifest()["bad"].size(), 8u);
}

class T5CheckpointTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    case_ = Case(GetParam());
    auto m = Model::Load(case_["dir"]);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
    inputs_ = testing::ReadT5Reference(case_);
    ASSERT_EQ(inputs_.size(), 5u);
  }
  std::vector<float> Check(Backend& b, const std::string& what, bool chunked = false) {
    const ModelConfig& c = model_->config();
    return testing::ExpectBackendMatchesT5(b, inputs_, c.vocab_size, c.decoder_start_token_id, kRtol, what, chunked);
  }

  nlohmann::json case_;
  std::shared_ptr<const Model> model_;
  std::vector<testing::T5Input> inputs_;
};

TEST_P(T5CheckpointTest, ConfigIsMapped) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.source, "hf:" + case_["model_type"].get<std::string>());
  EXPECT_EQ(c.architecture, "t5");
  EXPECT_TRUE(c.encoder_decoder);
  EXPECT_EQ(c.vocab_size, case_["vocab_size"].get<int>());
  EXPECT_EQ(c.d_model, case_["d_model"].get<int>());
  EXPECT_EQ(c.head_dim, case_["d_kv"].get<int>());
  EXPECT_EQ(c.n_encoder_layers, case_["num_layers"].get<int>());
  EXPECT_EQ(c.n_layers, case_["num_decoder_layers"].get<int>());
  EXPECT_EQ(c.tie_embeddings, case_["tied"].get<bool>());
  EXPECT_EQ(c.ffn_gated, case_["feed_forward_proj"].get<std::string>().rfind("gated-", 0) == 0);
  EXPECT_EQ(c.lm_head_input_scale == 1.0f, !case_["tied"].get<bool>());
  EXPECT_EQ(c.decoder_start_token_id, case_["decoder_start_token_id"].get<int>());
  EXPECT_EQ(c.eos_token_id, case_["eos_token_id"].get<int>());
  EXPECT_EQ(c.rel.scheme, relpos::Scheme::kT5);
  EXPECT_EQ(c.rel.num_buckets, case_["relative_attention_num_buckets"].get<int>());
  EXPECT_EQ(c.rel.max_distance, case_["relative_attention_max_distance"].get<int>());
  EXPECT_EQ(c.tokenizer, TokenizerKind::kSentencePiece);
  EXPECT_EQ(model_->file_dtype(), case_.value("dtype", std::string("F32")) == "F16" ? DType::kF16 : DType::kF32);
  // relgen's buckets are exact; the reference's inputs must not reach a distance where
  // transformers' float32 logarithm rounds into another bucket.
  for (const auto& [direction, diffs] : case_["bucket_differences"].items()) {
    for (const auto& d : diffs) EXPECT_GT(std::abs(d["relative_position"].get<int>()), 500) << direction << d;
  }
}

TEST_P(T5CheckpointTest, LogitsAndGreedyTokensMatchTransformers) {
  auto backend = Cpu(model_);
  Check(*backend, GetParam());
}

// A decoder chunk (what a preempted sequence recomputes) gives each row the bits of its decode step.
TEST_P(T5CheckpointTest, ChunkedDecoderEqualsStepwiseBitwise) {
  auto a = Cpu(model_), b = Cpu(model_);
  const std::vector<float> stepwise = Check(*a, "stepwise");
  const std::vector<float> chunked = Check(*b, "chunked", true);
  ASSERT_EQ(stepwise.size(), chunked.size());
  ASSERT_FALSE(stepwise.empty());
  EXPECT_EQ(std::memcmp(stepwise.data(), chunked.data(), stepwise.size() * sizeof(float)), 0);
}

TEST_P(T5CheckpointTest, ShardedEqualsUnshardedBitwise) {
  auto sharded = Model::Load(case_["sharded_dir"]);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  auto a = Cpu(model_), b = Cpu(*sharded);
  const std::vector<float> la = Check(*a, "unsharded");
  const std::vector<float> lb = Check(*b, "sharded");
  ASSERT_EQ(la.size(), lb.size());
  ASSERT_FALSE(la.empty());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0);
}

// T5's tokenizer as transformers runs it: the text's pieces then </s>; sentinels are tokens.
TEST_P(T5CheckpointTest, TokenizerMatchesTransformers) {
  auto tok = NewTokenizer(model_->config(), model_->dir());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode(case_["text"].get<std::string>()), case_["text_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ((*tok)->Decode(case_["text_greedy"].get<std::vector<int32_t>>()),
            case_["text_greedy_decoded"].get<std::string>());
  const nlohmann::json manifest = testing::T5Manifest();
  for (const auto& s : manifest["sentinel_texts"]) {
    EXPECT_EQ((*tok)->Encode(s["text"].get<std::string>()), s["ids"].get<std::vector<int32_t>>()) << s["text"];
  }
  // Sequences with lone and leading spaces, special ids and sentinels, whole and streamed.
  // The decode cases need the fast tokenizer; a fixture that could not build it has none.
  ASSERT_TRUE(manifest["tokenizer_json"].get<bool>()) << "the fixture has no fast tokenizer, so no decode cases";
  ASSERT_GE(manifest["decode_cases"].size(), 100u);
  int with_specials = 0;
  for (const auto& d : manifest["decode_cases"]) {
    const auto ids = d["ids"].get<std::vector<int32_t>>();
    const std::string want = d["text"].get<std::string>();
    EXPECT_EQ((*tok)->Decode(ids), want) << d["ids"];
    auto stream = (*tok)->NewStream();
    std::string streamed;
    for (int32_t id : ids) streamed += stream->Push(id);
    EXPECT_EQ(streamed + stream->Finish(), want) << d["ids"];
    // skip_special_tokens=False: <pad>, </s> and <unk> as text.
    const std::string keep = d["text_keep"].get<std::string>();
    with_specials += keep != want ? 1 : 0;
    EXPECT_EQ((*tok)->Decode(ids, /*skip_special_tokens=*/false), keep) << d["ids"];
    auto kept = (*tok)->NewStreamWithSpecials();
    std::string kept_streamed;
    for (int32_t id : ids) kept_streamed += kept->Push(id);
    EXPECT_EQ(kept_streamed + kept->Finish(), keep) << d["ids"];
  }
  EXPECT_GT(with_specials, 20) << "too few cases hold a special piece";
  const int top = model_->config().vocab_size - 1;  // <extra_id_0>
  EXPECT_EQ((*tok)->TokenText(top), "<extra_id_0>");
  EXPECT_EQ((*tok)->Decode({top}), "<extra_id_0>");
}

// All five inputs at once through the engine (continuous batching, greedy): transformers' tokens.
TEST_P(T5CheckpointTest, EngineGreedyEqualsTransformersBatched) {
  auto tokenizer = NewTokenizer(model_->config(), model_->dir());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto engine = Engine::Create(model_, Cpu(model_), *std::move(tokenizer), EngineConfig{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (const auto& p : inputs_) {
    Request r;
    r.prompt = p.input;
    r.sampling.temperature = 0.f;
    r.stop.max_new_tokens = static_cast<int>(p.greedy.size());
    r.stop.ignore_eos = true;
    auto h = (*engine)->Submit(std::move(r));
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    Output all, o;
    while (handles[i]->Next(&o)) {
      all.token_ids.insert(all.token_ids.end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) break;
    }
    EXPECT_EQ(all.token_ids, inputs_[i].greedy) << "input " << i;
    EXPECT_EQ(o.prompt_tokens, static_cast<int>(inputs_[i].input.size()));
  }
}

INSTANTIATE_TEST_SUITE_P(T5, T5CheckpointTest, ::testing::ValuesIn(CaseNames()),
                         [](const auto& i) { return TestName(i.param); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(T5CheckpointTest);

class T5BadCheckpointTest : public ::testing::TestWithParam<int> {};

TEST_P(T5BadCheckpointTest, RefusedNamingWhatAndWhy) {
  const auto bad = testing::T5Manifest()["bad"][GetParam()];
  auto m = Model::Load(bad["dir"]);
  std::string message;
  if (m.ok()) {
    // A checkpoint without its tokenizer loads; serving it needs the tokenizer.
    auto tok = NewTokenizer((*m)->config(), (*m)->dir());
    ASSERT_FALSE(tok.ok()) << bad["name"] << " was loaded";
    message = std::string(tok.status().message());
  } else {
    message = std::string(m.status().message());
  }
  for (const auto& s : bad["expect"]) EXPECT_THAT(message, HasSubstr(s.get<std::string>())) << bad["name"];
}

INSTANTIATE_TEST_SUITE_P(
    T5, T5BadCheckpointTest,
    ::testing::Range(0, testing::T5CasesDir().empty() ? 0 : static_cast<int>(testing::T5Manifest()["bad"].size())),
    [](const auto& i) { return TestName(testing::T5Manifest()["bad"][i.param]["name"]); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(T5BadCheckpointTest);

// ------------------------------------------------------------------ continuous batching

// Requests driven by the test on the caller's thread (RunOnce): what shares a step is decided by
// the submissions, not by the machine's speed.
class T5EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::T5Cases().empty()) GTEST_SKIP() << "no T5 fixture";
    auto m = Model::Load(Case("t5-v1_1")["dir"]);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
  }
  std::unique_ptr<Engine> NewEngine(int blocks, int max_batch_tokens = 512) {
    EngineConfig config;
    config.background_thread = false;
    config.scheduler.max_batch_tokens = max_batch_tokens;
    auto e = Engine::Create(model_, Cpu(model_, blocks), *NewTokenizer(model_->config(), model_->dir()), config);
    EXPECT_TRUE(e.ok()) << e.status();
    return *std::move(e);
  }
  // 16 inputs of different lengths (1..300 tokens), sampled at temperature 0.8 with logprobs.
  static std::vector<Request> Work() {
    std::mt19937 rng(11);
    std::vector<Request> out;
    const int lengths[16] = {1, 300, 7, 64, 33, 150, 2, 90, 17, 240, 5, 128, 48, 3, 200, 70};
    for (int i = 0; i < 16; ++i) {
      Request r;
      r.id = std::to_string(i);
      for (int t = 0; t < lengths[i]; ++t) r.prompt.push_back(3 + static_cast<int>(rng() % 400));
      r.sampling.temperature = 0.8f;
      r.sampling.seed = 100 + i;
      r.sampling.logprobs = 2;
      r.stop.max_new_tokens = 20 + i;
      r.stop.ignore_eos = true;
      out.push_back(r);
    }
    return out;
  }
  static std::vector<Output> Run(Engine& e, const std::vector<Request>& work) {
    std::vector<std::shared_ptr<RequestHandle>> handles;
    for (const Request& r : work) handles.push_back(*e.Submit(r));
    std::vector<Output> out(work.size());
    std::vector<bool> done(work.size());
    for (size_t finished = 0; finished < work.size();) {
      e.RunOnce();
      for (size_t i = 0; i < work.size(); ++i) {
        Output o;
        while (!done[i] && handles[i]->Next(&o, absl::ZeroDuration())) {
          out[i].token_ids.insert(out[i].token_ids.end(), o.token_ids.begin(), o.token_ids.end());
          out[i].logprobs.insert(out[i].logprobs.end(), o.logprobs.begin(), o.logprobs.end());
          if (o.finished) {
            out[i].finish_reason = o.finish_reason;
            done[i] = true;
            ++finished;
          }
        }
      }
    }
    return out;
  }
  static void ExpectSame(const Output& a, const Output& b, const std::string& what) {
    EXPECT_EQ(a.token_ids, b.token_ids) << what;
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << what;
    for (size_t t = 0; t < a.logprobs.size(); ++t) {
      // Bitwise: the same float from the same arithmetic.
      EXPECT_EQ(std::memcmp(&a.logprobs[t].logprob, &b.logprobs[t].logprob, sizeof(float)), 0) << what << " token " << t;
    }
  }

  std::shared_ptr<const Model> model_;
};

// The defaults (64 sequences, 512 tokens a step, 2048 input tokens encoded a step, the pool the
// backend's default sizes for 64 sequences): 64 requests with 512-token inputs arriving while
// another decodes all run together within 16 steps (4 inputs a step), and the decode beside them
// gains one token every step. Charged to the step's token budget instead, inputs were admitted one
// a step, so at most 32 (one per step of a 32-token output) ran at once.
TEST_F(T5EngineTest, SixtyFourLongInputsRunTogetherWhileADecodeKeepsItsTokenEveryStep) {
  struct Peak : EngineObserver {
    int most = 0;
    void OnStep(int num_seqs, int num_tokens) override { most = std::max(most, num_seqs); }
  };
  auto peak = std::make_shared<Peak>();
  EngineConfig config;
  config.background_thread = false;
  config.observer = peak;
  DeviceOptions o;
  o.device = "cpu";
  o.threads = 1;
  o.max_step_seqs = config.scheduler.max_num_seqs;
  auto backend = NewBackend(model_, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto e = Engine::Create(model_, *std::move(backend), *NewTokenizer(model_->config(), model_->dir()), config);
  ASSERT_TRUE(e.ok()) << e.status();
  Engine& engine = **e;
  Request a;
  a.prompt = {5, 6, 7};
  a.sampling.temperature = 0;
  a.stop.max_new_tokens = 200;
  a.stop.ignore_eos = true;
  auto ha = *engine.Submit(a);
  auto tokens_of_a = [&] {
    int n = 0;
    Output out;
    while (ha->Next(&out, absl::ZeroDuration())) n += static_cast<int>(out.token_ids.size());
    return n;
  };
  engine.RunOnce();
  ASSERT_EQ(tokens_of_a(), 1);
  std::mt19937 rng(3);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 64; ++i) {
    Request r;
    for (int t = 0; t < 512; ++t) r.prompt.push_back(3 + static_cast<int>(rng() % 400));
    r.sampling.temperature = 0;
    r.stop.max_new_tokens = 32;
    r.stop.ignore_eos = true;
    auto h = engine.Submit(r);
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
  }
  for (int step = 0; step < 20; ++step) {
    engine.RunOnce();
    EXPECT_EQ(tokens_of_a(), 1) << "step " << step;
  }
  // a and 63 of the inputs (max_num_seqs 64); the 64th waits for a slot.
  EXPECT_EQ(peak->most, 64);
  for (auto& h : handles) h->Cancel();
  ha->Cancel();
  engine.RunOnce();
}

TEST_F(T5EngineTest, SixteenConcurrentRequestsEachEqualAlone) {
  const std::vector<Request> work = Work();
  std::vector<Output> alone;
  for (const Request& r : work) {
    auto e = NewEngine(256);
    alone.push_back(Run(*e, {r})[0]);
  }
  auto e = NewEngine(256);
  const std::vector<Output> together = Run(*e, work);
  EXPECT_GT(e->Stats().steps, 0);
  for (size_t i = 0; i < work.size(); ++i) {
    EXPECT_EQ(together[i].finish_reason, FinishReason::kLength);
    EXPECT_EQ(static_cast<int>(together[i].token_ids.size()), work[i].stop.max_new_tokens);
    ExpectSame(together[i], alone[i], "request " + std::to_string(i));
  }
  const EngineStats st = e->Stats();
  EXPECT_EQ(st.kv_blocks_used, 0) << "self or cross blocks left after finish";
  int64_t input_tokens = 0;
  for (const Request& r : work) input_tokens += static_cast<int64_t>(r.prompt.size());
  EXPECT_EQ(st.encoder_tokens, input_tokens) << "each input encoded once without preemption";
  EXPECT_EQ(st.preemptions, 0);
}

// A pool of 24 blocks (384 token slots) holds the 300-token input with its output and little else:
// sequences are preempted, freed and encoded again, and still produce exactly their lone outputs.
TEST_F(T5EngineTest, PreemptionUnderASmallPoolGivesIdenticalOutputs) {
  const std::vector<Request> work = Work();
  auto roomy = NewEngine(256);
  const std::vector<Output> reference = Run(*roomy, work);
  auto tight = NewEngine(24, 128);
  const std::vector<Output> squeezed = Run(*tight, work);
  const EngineStats st = tight->Stats();
  EXPECT_GT(st.preemptions, 0) << "the pool should have run out";
  int64_t input_tokens = 0;
  for (const Request& r : work) input_tokens += static_cast<int64_t>(r.prompt.size());
  EXPECT_GT(st.encoder_tokens, input_tokens) << "preempted inputs are encoded again";
  for (size_t i = 0; i < work.size(); ++i) ExpectSame(squeezed[i], reference[i], "request " + std::to_string(i));
  EXPECT_EQ(st.kv_blocks_used, 0);
}

TEST_F(T5EngineTest, CancelAndDeadlineFreeSelfAndCrossBlocks) {
  auto e = NewEngine(128);
  std::vector<Request> work = Work();
  work.resize(3);
  work[1].deadline = absl::Now() + absl::Hours(1);
  auto h0 = *e->Submit(work[0]);
  auto h1 = *e->Submit(work[1]);
  auto h2 = *e->Submit(work[2]);
  e->RunOnce();  // all three admitted and encoded: self and cross blocks held
  const int held = e->Stats().kv_blocks_used;
  EXPECT_GE(held, 3 + (1 + 300 / 16 + 1) + 1) << "each holds a decoder block and its input's blocks";
  h0->Cancel();
  h1->Cancel(FinishReason::kDeadline);
  e->RunOnce();
  Output o;
  while (h0->Next(&o, absl::ZeroDuration()) && !o.finished) {}
  EXPECT_EQ(o.finish_reason, FinishReason::kCancelled);
  while (h1->Next(&o, absl::ZeroDuration()) && !o.finished) {}
  EXPECT_EQ(o.finish_reason, FinishReason::kDeadline);
  EXPECT_EQ(e->Stats().kv_blocks_used, 2) << "only the third request's two blocks remain";
  h2->Cancel();
  e->RunOnce();
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
}

// n samples of one input: each equals a request of its own with seed + i, and the input is encoded
// once for the group (the samples share its cross-attention K/V).
TEST_F(T5EngineTest, SamplesShareTheEncodedInput) {
  Request r = Work()[5];  // 150 input tokens
  std::vector<Request> alone;
  for (int i = 0; i < 3; ++i) {
    alone.push_back(r);
    alone.back().sampling.seed = r.sampling.seed + i;
  }
  auto solo = NewEngine(256);
  const std::vector<Output> want = Run(*solo, alone);
  auto e = NewEngine(256);
  r.n = 3;
  auto hs = e->SubmitGroup(r);
  ASSERT_TRUE(hs.ok()) << hs.status();
  std::vector<Output> got(3);
  std::vector<bool> done(3);
  for (int finished = 0; finished < 3;) {
    e->RunOnce();
    for (int i = 0; i < 3; ++i) {
      Output o;
      while (!done[i] && (*hs)[i]->Next(&o, absl::ZeroDuration())) {
        got[i].token_ids.insert(got[i].token_ids.end(), o.token_ids.begin(), o.token_ids.end());
        got[i].logprobs.insert(got[i].logprobs.end(), o.logprobs.begin(), o.logprobs.end());
        if (o.finished) done[i] = ++finished > 0;
      }
    }
  }
  for (int i = 0; i < 3; ++i) ExpectSame(got[i], want[i], "sample " + std::to_string(i));
  EXPECT_EQ(e->Stats().encoder_tokens, 150);
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
}

// Scoring transformers' own greedy outputs as continuations of their inputs: each token's
// log-probability is the log-softmax of transformers' logits for that step.
TEST_F(T5EngineTest, ScoresMatchTransformers) {
  const nlohmann::json c = Case("t5-v1_1");
  const std::vector<testing::T5Input> inputs = testing::ReadT5Reference(c);
  ASSERT_FALSE(inputs.empty());
  const int vocab = model_->config().vocab_size;
  auto e = NewEngine(256);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const testing::T5Input& p = inputs[i];
    Request r;
    r.prompt = p.input;
    const int len = static_cast<int>(p.greedy.size());
    r.continuations = {p.greedy, std::vector<int32_t>(p.greedy.begin(), p.greedy.begin() + (len + 1) / 2)};
    auto hs = e->SubmitGroup(r);
    ASSERT_TRUE(hs.ok()) << hs.status();
    std::vector<std::vector<SampleResult>> got(2);
    std::vector<bool> done(2);
    for (int finished = 0; finished < 2;) {
      e->RunOnce();
      for (int k = 0; k < 2; ++k) {
        Output o;
        while (!done[k] && (*hs)[k]->Next(&o, absl::ZeroDuration())) {
          got[k].insert(got[k].end(), o.logprobs.begin(), o.logprobs.end());
          if (o.finished) done[k] = ++finished > 0;
        }
      }
    }
    for (int k = 0; k < 2; ++k) {
      ASSERT_EQ(got[k].size(), r.continuations[k].size());
      for (size_t t = 0; t < got[k].size(); ++t) {
        const double* row = p.logits.data() + t * vocab;
        double mx = -INFINITY, z = 0;
        for (int v = 0; v < vocab; ++v) mx = std::max(mx, row[v]);
        for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
        const double want = row[p.greedy[t]] - mx - std::log(z);
        // transformers computes in float32 too: a few float32 ulps of the largest logit.
        EXPECT_NEAR(got[k][t].logprob, want, 1e-4 * std::max(1.0, mx)) << "input " << i << " token " << t;
      }
    }
  }
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
}

TEST_F(T5EngineTest, InputAndOutputLimitsAreEachTheContext) {
  auto e = NewEngine(256);
  const int ctx = model_->config().max_seq_len;
  Request r;
  r.prompt.assign(ctx + 1, 5);
  r.stop.max_new_tokens = 4;
  auto too_long = e->Submit(r);
  ASSERT_FALSE(too_long.ok());
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("prompt: the input is " + std::to_string(ctx + 1) +
                                                                  " tokens; the model's encoder takes at most " +
                                                                  std::to_string(ctx)));
  r.prompt.assign(ctx, 5);
  r.stop.max_new_tokens = ctx;  // input and output at the context each: allowed
  EXPECT_TRUE(e->Submit(r).ok());
  r.stop.max_new_tokens = ctx + 1;
  EXPECT_FALSE(e->Submit(r).ok());
}

}  // namespace
}  // namespace relgen
