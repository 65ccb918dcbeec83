// LoRA adapters against PEFT: tiny random T5 (relu and gated), BLOOM and MPT checkpoints with three
// random PEFT adapters each (tools/make_lora_adapters.py, ctest fixture lora_adapters, directory in
// RELGEN_LORA_CASES_DIR), and PEFT's own float32 outputs for each as the reference.
//
// The cases run on the CPU backend, and in lora_test_emu (RELGEN_LORA_TEST_CUDA) on the CUDA backend
// against relgen's SIMT emulator.
//
// - Each adapter, and the base alone: every step's argmax is PEFT's greedy token
//   and every log-probability of every row within 1e-4 of PEFT's.
// - One step mixing the base and all three adapters gives each row the bits it gets alone.
// - The engine with fewer resident slots than adapters (max_loras 2 for 3 adapters and the base),
//   every request submitted at once: each gets its adapter's greedy tokens.
// - The prefix cache never hands one adapter's K/V to another (or to the base).
// - Refusals: each broken adapter is refused at load naming what is wrong; an unknown adapter name
//   in a request is NOT_FOUND naming it.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/backends/cpu_backend.h"
#include "engine/backends/cuda_backend.h"
#include "engine/core/engine.h"
#include "engine/model/lora.h"
#include "engine/model/model.h"
#include "engine/tokenizers/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/hf_reference.h"
#include "tests/t5_reference.h"
#include "tests/test_util.h"
#if defined(RELGEN_LORA_TEST_CUDA)
#include "tests/simt/simt.h"
#endif

namespace relgen {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

constexpr int kMaxRank = 16;

std::string CasesDir() {
  const char* d = std::getenv("RELGEN_LORA_CASES_DIR");
  return d == nullptr ? "" : d;
}

json Manifest() { return testing::ReadJson(CasesDir() + "/manifest.json"); }

json Base(const std::string& name) {
  const json m = Manifest();
  for (const json& b : m["bases"]) {
    if (b["name"] == name) return b;
  }
  ADD_FAILURE() << "no base " << name << " in the manifest";
  return json::object();
}

// The backend under test: the CPU's, or (lora_test_emu) the CUDA backend on the SIMT emulator, its
// float32 kernels, decode steps through captured graphs.
std::unique_ptr<Backend> MakeBackend(const std::shared_ptr<const Model>& model, int max_loras, int blocks = 128,
                                     int block_size = 16) {
#if defined(RELGEN_LORA_TEST_CUDA)
  CudaOptions o;
  o.num_blocks = blocks;
  o.block_size = block_size;
  o.max_step_tokens = 256;
  o.max_step_seqs = 16;
  o.max_step_encoder_tokens = 256;
  auto be = NewCudaBackend(model, o);
#else
  auto be = NewCpuBackend(model, KvCacheConfig{block_size, blocks}, 2);
#endif
  EXPECT_TRUE(be.ok()) << be.status();
  EXPECT_TRUE((*be)->ConfigureLora(max_loras, kMaxRank).ok());
  return *std::move(be);
}

// A base and its adapters as relgen loads them.
struct Loaded {
  json base;
  std::shared_ptr<const Model> model;
  std::vector<std::shared_ptr<const LoraAdapter>> adapters;  // in the manifest's order
};

Loaded Load(const std::string& name) {
  Loaded l;
  l.base = Base(name);
  auto m = Model::Load(l.base["dir"].get<std::string>());
  EXPECT_TRUE(m.ok()) << m.status();
  l.model = *m;
  for (const json& a : l.base["adapters"]) {
    auto ad = LoadLoraAdapter(a["name"], a["dir"], *l.model, kMaxRank);
    EXPECT_TRUE(ad.ok()) << ad.status();
    if (ad.ok()) l.adapters.push_back(*ad);
  }
  return l;
}

// An engine on the caller's thread over `l`'s adapters, two resident slots, books audited each step.
std::unique_ptr<Engine> NewEngine(const Loaded& l, std::unique_ptr<Backend> backend) {
  EngineConfig config;
  config.background_thread = false;
  config.adapters = l.adapters;
  config.scheduler.max_loras = 2;
  config.check_invariants = true;
  auto tok = NewTokenizer(l.model->config(), l.model->dir());
  EXPECT_TRUE(tok.ok()) << tok.status();
  auto e = Engine::Create(l.model, std::move(backend), *std::move(tok), config);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

// Every row's log-probabilities within `tol` of the reference's (log-softmax of both in double).
void ExpectLogprobsClose(const float* got, const double* want, int rows, int vocab, double tol, const std::string& what) {
  for (int r = 0; r < rows; ++r) {
    auto lse = [&](auto* row) {
      double mx = -1e300, s = 0;
      for (int c = 0; c < vocab; ++c) mx = std::max(mx, static_cast<double>(row[c]));
      for (int c = 0; c < vocab; ++c) s += std::exp(static_cast<double>(row[c]) - mx);
      return mx + std::log(s);
    };
    const float* g = got + int64_t{r} * vocab;
    const double* w = want + int64_t{r} * vocab;
    const double lg = lse(g), lw = lse(w);
    double worst = 0;
    for (int c = 0; c < vocab; ++c) worst = std::max(worst, std::abs((g[c] - lg) - (w[c] - lw)));
    ASSERT_LE(worst, tol) << what << ": row " << r << " of " << rows;
  }
}

// The backend under `adapter` (null: the base) against PEFT's reference in `entry`.
void ExpectMatchesPeft(Backend& be, const Model& model, const json& entry, const LoraAdapter* adapter) {
  const ModelConfig& c = model.config();
  const std::string what = entry["name"].get<std::string>();
  if (c.encoder_decoder) {
    for (const testing::T5Input& p : testing::ReadT5Reference(entry)) {
      const std::string name = what + " input of " + std::to_string(p.input.size());
      const std::vector<float> all =
          testing::TeacherForcedT5(be, p, c.decoder_start_token_id, false, 1 << 30, name, adapter);
      ASSERT_EQ(all.size(), p.greedy.size() * c.vocab_size) << name;
      for (size_t t = 0; t < p.greedy.size(); ++t) {
        const float* row = all.data() + t * c.vocab_size;
        EXPECT_EQ(std::max_element(row, row + c.vocab_size) - row, p.greedy[t]) << name << " token " << t;
      }
      ExpectLogprobsClose(all.data(), p.logits.data(), static_cast<int>(p.greedy.size()), c.vocab_size, 1e-4, name);
    }
    return;
  }
  for (const testing::HfPrompt& p : testing::ReadHfReference(entry)) {
    const std::string name = what + " prompt of " + std::to_string(p.prompt.size());
    const std::vector<float> all = testing::TeacherForcedHf(be, p, 1 << 30, name, adapter);
    const int n = static_cast<int>(p.prompt.size()), rows = static_cast<int>(all.size()) / c.vocab_size;
    ASSERT_EQ(rows, n + static_cast<int>(p.greedy.size()) - 1) << name;
    for (int t = 0; n - 1 + t < rows; ++t) {
      const float* row = all.data() + int64_t{n - 1 + t} * c.vocab_size;
      EXPECT_EQ(std::max_element(row, row + c.vocab_size) - row, p.greedy[t]) << name << " token " << t;
    }
    ExpectLogprobsClose(all.data(), p.logits.data(), rows, c.vocab_size, 1e-4, name);
  }
}

class LoraTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (CasesDir().empty()) GTEST_SKIP() << "no LoRA fixture";
  }
};

TEST(LoraFixtureTest, CasesExist) {
  ASSERT_FALSE(CasesDir().empty()) << "RELGEN_LORA_CASES_DIR is not set (ctest fixture lora_adapters)";
  const json m = Manifest();
  ASSERT_EQ(m["bases"].size(), 4u);
  for (const json& b : m["bases"]) EXPECT_EQ(b["adapters"].size(), 3u) << b["name"];
  EXPECT_EQ(m["bad"].size(), 10u);
}

TEST_P(LoraTest, EachAdapterMatchesPeft) {
  Loaded l = Load(GetParam());
  ASSERT_EQ(l.adapters.size(), 3u);
  auto be = MakeBackend(l.model, 2);
  ExpectMatchesPeft(*be, *l.model, l.base, nullptr);
  for (size_t i = 0; i < l.adapters.size(); ++i) {
    SCOPED_TRACE(l.adapters[i]->name);
    ExpectMatchesPeft(*be, *l.model, l.base["adapters"][i], l.adapters[i].get());
  }
  // Back to the first after the others took both slots: what was evicted is loaded again.
  ExpectMatchesPeft(*be, *l.model, l.base["adapters"][0], l.adapters[0].get());
}

// One step of the base and all three adapters, a prompt each (and, encoder-decoder, each encoded in
// it), then one decode step of all four: each row's logits are the bits it gets in a step alone.
TEST_P(LoraTest, MixedBatchIsBitwiseEachAlone) {
  Loaded l = Load(GetParam());
  ASSERT_EQ(l.adapters.size(), 3u);
  const ModelConfig& c = l.model->config();
  const bool t5 = c.encoder_decoder;
  std::vector<const LoraAdapter*> who = {nullptr};
  for (const auto& a : l.adapters) who.push_back(a.get());
  const int k = static_cast<int>(who.size());
  // Sequence i: prompt (decoder) or input (encoder-decoder) i of the base's reference, cycled.
  std::vector<std::vector<int32_t>> prompts, decoder(k);
  if (t5) {
    for (const auto& p : testing::ReadT5Reference(l.base)) prompts.push_back(p.input);
  } else {
    for (const auto& p : testing::ReadHfReference(l.base)) prompts.push_back(p.prompt);
  }
  ASSERT_FALSE(prompts.empty());
  std::vector<std::vector<int32_t>> tables(k), cross(k);
  for (int i = 0; i < k; ++i) {
    for (int b = 0; b < 4; ++b) tables[i].push_back(i * 8 + b);
    for (int b = 4; b < 8; ++b) cross[i].push_back(i * 8 + b);
    decoder[i] = t5 ? std::vector<int32_t>{c.decoder_start_token_id, 5} : prompts[i % prompts.size()];
    if (!t5) decoder[i].push_back(5);  // the decode step's token
  }
  auto steps_of = [&](int i, bool first) {
    SequenceStep s;
    const int n = t5 ? 1 : static_cast<int>(decoder[i].size()) - 1;
    s.tokens = first ? absl::MakeConstSpan(decoder[i]).subspan(0, n) : absl::MakeConstSpan(decoder[i]).subspan(n, 1);
    s.start_pos = first ? 0 : n;
    s.block_table = tables[i];
    s.all_logits = first;
    s.adapter = who[i];
    if (t5) {
      const std::vector<int32_t>& in = prompts[i % prompts.size()];
      s.encoder_len = static_cast<int>(in.size());
      s.cross_block_table = cross[i];
      if (first) s.encoder_tokens = in;
    }
    return s;
  };
  auto be = MakeBackend(l.model, 4);
  for (bool first : {true, false}) {
    std::vector<SequenceStep> batch;
    for (int i = 0; i < k; ++i) batch.push_back(steps_of(i, first));
    std::vector<float> together;
    ASSERT_TRUE(ForwardLogits(*be, batch, &together).ok());
    // Alone, in a backend of its own (the K/V of the first step are written again, the same).
    int row = 0;
    for (int i = 0; i < k; ++i) {
      auto alone_be = MakeBackend(l.model, 4);
      std::vector<float> alone;
      if (!first) {
        SequenceStep prefill = steps_of(i, true);
        ASSERT_TRUE(ForwardLogits(*alone_be, {&prefill, 1}, &alone).ok());
      }
      SequenceStep s = steps_of(i, first);
      ASSERT_TRUE(ForwardLogits(*alone_be, {&s, 1}, &alone).ok());
      ASSERT_LE(int64_t{row} * c.vocab_size + static_cast<int64_t>(alone.size()), static_cast<int64_t>(together.size()));
      EXPECT_EQ(std::memcmp(together.data() + int64_t{row} * c.vocab_size, alone.data(), alone.size() * sizeof(float)), 0)
          << (who[i] == nullptr ? "base" : who[i]->name) << (first ? " first step" : " decode step");
      row += static_cast<int>(alone.size()) / c.vocab_size;
    }
    EXPECT_EQ(int64_t{row} * c.vocab_size, static_cast<int64_t>(together.size()));
  }
}

// Greedy requests for the base and every adapter, three prompts each, all submitted at once to an
// engine with two resident slots for three adapters: each gets PEFT's greedy tokens.
TEST_P(LoraTest, EngineWithFewerSlotsThanAdaptersServesEach) {
  Loaded l = Load(GetParam());
  ASSERT_EQ(l.adapters.size(), 3u);
  const ModelConfig& c = l.model->config();
  std::unique_ptr<Engine> e = NewEngine(l, MakeBackend(l.model, 2));
  ASSERT_NE(e, nullptr);
  struct Want {
    std::shared_ptr<RequestHandle> handle;
    std::vector<int32_t> greedy;
    std::string what;
    std::vector<int32_t> got;
    bool done = false;
  };
  std::vector<Want> wants;
  std::vector<json> entries = {l.base};
  for (const json& a : l.base["adapters"]) entries.push_back(a);
  for (size_t i = 0; i < entries.size(); ++i) {
    std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> cases;
    if (c.encoder_decoder) {
      for (const auto& p : testing::ReadT5Reference(entries[i])) cases.emplace_back(p.input, p.greedy);
    } else {
      for (const auto& p : testing::ReadHfReference(entries[i])) cases.emplace_back(p.prompt, p.greedy);
    }
    for (auto& [prompt, greedy] : cases) {
      Request r;
      r.id = entries[i]["name"].get<std::string>() + "/" + std::to_string(prompt.size());
      r.prompt = prompt;
      r.sampling.temperature = 0;
      r.stop.max_new_tokens = static_cast<int>(greedy.size());
      r.stop.ignore_eos = true;
      r.adapter = i == 0 ? "" : l.adapters[i - 1]->name;
      auto h = e->Submit(r);
      ASSERT_TRUE(h.ok()) << h.status();
      wants.push_back({*h, greedy, r.id});
    }
  }
  for (int steps = 0, left = static_cast<int>(wants.size()); left > 0; ++steps) {
    ASSERT_LT(steps, 10000) << "the requests did not finish";
    e->RunOnce();
    for (Want& w : wants) {
      Output o;
      while (!w.done && w.handle->Next(&o, absl::ZeroDuration())) {
        w.got.insert(w.got.end(), o.token_ids.begin(), o.token_ids.end());
        if (o.finished) {
          EXPECT_TRUE(o.status.ok()) << w.what << ": " << o.status;
          w.done = true;
          --left;
        }
      }
    }
  }
  for (const Want& w : wants) EXPECT_EQ(w.got, w.greedy) << w.what;
}

// The same prompt under one adapter, then under another and the base, then under the first again:
// only the last finds its blocks in the prefix cache (decoder models), and each gets its own
// adapter's tokens.
TEST_P(LoraTest, PrefixCacheNeverCrossesAdapters) {
  Loaded l = Load(GetParam());
  ASSERT_EQ(l.adapters.size(), 3u);
  const ModelConfig& c = l.model->config();
  std::unique_ptr<Engine> e = NewEngine(l, MakeBackend(l.model, 2, 256, 4));
  ASSERT_NE(e, nullptr);
  // The longest prompt (several whole blocks of 4).
  std::vector<int32_t> prompt;
  std::vector<std::vector<int32_t>> greedy(4);
  std::vector<json> entries = {l.base};
  for (const json& a : l.base["adapters"]) entries.push_back(a);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (c.encoder_decoder) {
      const auto p = testing::ReadT5Reference(entries[i]).back();
      prompt = p.input;
      greedy[i] = p.greedy;
    } else {
      const auto p = testing::ReadHfReference(entries[i]).back();
      prompt = p.prompt;
      greedy[i] = p.greedy;
    }
  }
  ASSERT_GE(prompt.size(), 8u);
  auto run = [&](int who) {
    Request r;
    r.prompt = prompt;
    r.sampling.temperature = 0;
    r.stop.max_new_tokens = static_cast<int>(greedy[who].size());
    r.stop.ignore_eos = true;
    r.adapter = who == 0 ? "" : l.adapters[who - 1]->name;
    auto h = e->Submit(r);
    EXPECT_TRUE(h.ok()) << h.status();
    std::vector<int32_t> got;
    for (bool done = false; !done;) {
      e->RunOnce();
      Output o;
      while (!done && (*h)->Next(&o, absl::ZeroDuration())) {
        got.insert(got.end(), o.token_ids.begin(), o.token_ids.end());
        done = o.finished;
      }
    }
    EXPECT_EQ(got, greedy[who]) << (who == 0 ? "base" : l.adapters[who - 1]->name);
    return e->Stats().prefix_cache_hits;
  };
  const int64_t first = run(1);
  EXPECT_EQ(run(2), first) << "another adapter found the first one's blocks";
  EXPECT_EQ(run(0), first) << "the base found an adapter's blocks";
  const int64_t again = run(1);
  // An encoder-decoder request's decoder prompt is its start token alone: nothing of a new request
  // is looked up (a preempted one's recomputation is, under the same root of adapter and input).
  if (!c.encoder_decoder) EXPECT_GT(again, first) << "the same adapter again found nothing: the test would prove nothing";
}

TEST_P(LoraTest, UnknownAdapterIsNotFound) {
  Loaded l = Load(GetParam());
  std::unique_ptr<Engine> e = NewEngine(l, MakeBackend(l.model, 2));
  ASSERT_NE(e, nullptr);
  Request r;
  r.prompt = {3, 4, 5};
  r.adapter = "no-such-adapter";
  auto h = e->Submit(r);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(h.status().message(), HasSubstr("'no-such-adapter'"));
  EXPECT_THAT(h.status().message(), HasSubstr(l.adapters[0]->name));  // what is registered
}

#if defined(RELGEN_LORA_TEST_CUDA)
// Rows without an adapter cost nothing: a step of the base alone on a backend with adapters resident
// launches what it launches on one without LoRA (no slot lookup, the fused QKV writing the cache)
// and gives the same bits; a step with an adapter adds its launches (prefill, then a decode step
// through its graph).
TEST_P(LoraTest, StepsWithoutAnAdapterLaunchWhatTheBaseDoes) {
  Loaded l = Load(GetParam());
  ASSERT_EQ(l.adapters.size(), 3u);
  const ModelConfig& c = l.model->config();
  std::vector<int32_t> tokens;
  if (c.encoder_decoder) {
    tokens = {c.decoder_start_token_id, 5};
  } else {
    tokens = testing::ReadHfReference(l.base).back().prompt;
    tokens.push_back(5);
  }
  const std::vector<int32_t> input = c.encoder_decoder ? testing::ReadT5Reference(l.base).back().input : std::vector<int32_t>{};
  // The base's blocks, and the adapted sequence's apart from them.
  const std::vector<int32_t> tables[2] = {{0, 1, 2, 3}, {8, 9, 10, 11}}, cross[2] = {{4, 5, 6, 7}, {12, 13, 14, 15}};
  auto step = [&](bool first, const LoraAdapter* adapter) {
    SequenceStep s;
    const int n = static_cast<int>(tokens.size()) - 1;
    s.tokens = first ? absl::MakeConstSpan(tokens).subspan(0, n) : absl::MakeConstSpan(tokens).subspan(n, 1);
    s.start_pos = first ? 0 : n;
    s.block_table = tables[adapter != nullptr];
    s.adapter = adapter;
    if (c.encoder_decoder) {
      s.encoder_len = static_cast<int>(input.size());
      s.cross_block_table = cross[adapter != nullptr];
      if (first) s.encoder_tokens = input;
    }
    return s;
  };
  auto with_lora = MakeBackend(l.model, 2);
  auto plain = NewCudaBackend(l.model, KvCacheConfig{16, 128});
  ASSERT_TRUE(plain.ok()) << plain.status();
  // The adapters resident first.
  for (const auto& a : {l.adapters[0].get(), l.adapters[1].get()}) {
    SequenceStep s = step(true, a);
    std::vector<float> ignored;
    ASSERT_TRUE(ForwardLogits(*with_lora, {&s, 1}, &ignored).ok());
  }
  for (bool first : {true, false}) {
    const std::string what = first ? "prefill" : "decode";
    std::vector<float> got, want, adapted;
    simt::Counters base_launches[2];
    for (int i = 0; i < 2; ++i) {
      Backend& be = i == 0 ? *with_lora : **plain;
      SequenceStep s = step(first, nullptr);
      // The decode graph is captured on its first step: count a replay.
      if (!first) ASSERT_TRUE(ForwardLogits(be, {&s, 1}, i == 0 ? &got : &want).ok());
      simt::ResetCounters();
      ASSERT_TRUE(ForwardLogits(be, {&s, 1}, i == 0 ? &got : &want).ok());
      base_launches[i] = simt::GetCounters();
    }
    EXPECT_EQ(base_launches[0].launches, base_launches[1].launches) << what;
    EXPECT_EQ(base_launches[0].host_launches, base_launches[1].host_launches) << what;
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
    SequenceStep s = step(first, l.adapters[0].get());
    if (!first) ASSERT_TRUE(ForwardLogits(*with_lora, {&s, 1}, &adapted).ok());
    simt::ResetCounters();
    ASSERT_TRUE(ForwardLogits(*with_lora, {&s, 1}, &adapted).ok());
    EXPECT_GT(simt::GetCounters().launches, base_launches[0].launches) << what << ": the adapter's terms";
    EXPECT_NE(std::memcmp(adapted.data(), got.data(), got.size() * sizeof(float)), 0) << what;
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Bases, LoraTest, ::testing::Values("t5", "t5-gated", "bloom", "mpt"),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n = p.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(LoraRefusalTest, BrokenAdaptersAreRefusedNamingWhatIsWrong) {
  if (CasesDir().empty()) GTEST_SKIP() << "no LoRA fixture";
  const json m = Manifest();
  for (const json& bad : m["bad"]) {
    SCOPED_TRACE(bad["name"].get<std::string>());
    auto model = Model::Load(Base(bad["base"])["dir"].get<std::string>());
    ASSERT_TRUE(model.ok()) << model.status();
    auto a = LoadLoraAdapter(bad["name"], bad["dir"], **model, kMaxRank);
    ASSERT_FALSE(a.ok());
    for (const json& want : bad["expect"]) EXPECT_THAT(a.status().message(), HasSubstr(want.get<std::string>()));
  }
}

TEST(LoraRefusalTest, EngineRefusesAdaptersWithoutSlots) {
  if (CasesDir().empty()) GTEST_SKIP() << "no LoRA fixture";
  Loaded l = Load("bloom");
  EngineConfig config;
  config.background_thread = false;
  config.adapters = l.adapters;
  auto e = Engine::Create(l.model, MakeBackend(l.model, 2), *NewTokenizer(l.model->config(), l.model->dir()), config);
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("max_loras"));
}

// A request names its adapter: an empty name, the first's included, or one registered twice is
// refused when the engine is made.
TEST(LoraRefusalTest, EngineRefusesEmptyAndRepeatedNames) {
  if (CasesDir().empty()) GTEST_SKIP() << "no LoRA fixture";
  Loaded l = Load("bloom");
  ASSERT_EQ(l.adapters.size(), 3u);
  auto unnamed = std::make_shared<LoraAdapter>(*l.adapters[0]);
  unnamed->name.clear();
  auto twin = std::make_shared<LoraAdapter>(*l.adapters[1]);
  twin->name = l.adapters[0]->name;
  for (const auto& [adapters, want] :
       {std::pair{std::vector<std::shared_ptr<const LoraAdapter>>{unnamed, l.adapters[1]}, std::string("empty name")},
        std::pair{std::vector<std::shared_ptr<const LoraAdapter>>{l.adapters[1], unnamed}, std::string("empty name")},
        std::pair{std::vector<std::shared_ptr<const LoraAdapter>>{l.adapters[0], twin},
                  "'" + l.adapters[0]->name + "' is registered twice"}}) {
    EngineConfig config;
    config.background_thread = false;
    config.adapters = adapters;
    config.scheduler.max_loras = 2;
    auto e = Engine::Create(l.model, MakeBackend(l.model, 2), *NewTokenizer(l.model->config(), l.model->dir()), config);
    ASSERT_FALSE(e.ok()) << want;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(e.status().message(), HasSubstr(want));
  }
}

}  // namespace
}  // namespace relgen
