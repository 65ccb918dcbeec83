// Hugging Face BLOOM and MPT checkpoints, served as transformers saves them, against transformers'
// own float32 outputs (tools/make_hf_checkpoints.py): logits of every position and greedy tokens
// through the CPU backend, the engine and the server; sharded == unsharded bitwise; broken
// checkpoints refused at load and at server start.
#include <grpcpp/grpcpp.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine/backends/cpu_backend.h"
#include "engine/core/engine.h"
#include "engine/model/hf_checkpoint.h"
#include "engine/model/model.h"
#include "engine/tokenizers/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "relgen/v1/generation.grpc.pb.h"
#include "tests/hf_reference.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;
namespace v1 = ::relgen::v1;

constexpr double kRtol = 1e-4;  // float32 relgen vs float32 transformers

std::vector<std::string> CaseNames() {
  std::vector<std::string> names;
  for (const auto& c : testing::HfCases()) names.push_back(c["name"]);
  return names;
}

nlohmann::json Case(const std::string& name) {
  for (const auto& c : testing::HfCases()) {
    if (c["name"] == name) return c;
  }
  return {};
}

TEST(HfFixtureTest, CasesExist) {
  ASSERT_FALSE(testing::HfCasesDir().empty()) << "RELGEN_HF_CASES_DIR is not set (ctest fixture hf_checkpoints)";
  EXPECT_EQ(testing::HfCases().size(), 6u);
  EXPECT_GE(testing::ReadJson(testing::HfCasesDir() + "/manifest.json")["bad"].size(), 20u);
}

class HfCheckpointTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    case_ = Case(GetParam());
    auto m = Model::Load(case_["dir"]);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
    prompts_ = testing::ReadHfReference(case_);
    ASSERT_EQ(prompts_.size(), 5u);
  }
  std::unique_ptr<Backend> Cpu(const std::shared_ptr<const Model>& model) {
    return *NewCpuBackend(model, KvCacheConfig{16, 64}, 2);
  }

  nlohmann::json case_;
  std::shared_ptr<const Model> model_;
  std::vector<testing::HfPrompt> prompts_;
};

TEST_P(HfCheckpointTest, ConfigIsMapped) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.source, "hf:" + case_["family"].get<std::string>());
  EXPECT_EQ(c.architecture, case_["family"].get<std::string>());
  EXPECT_EQ(c.vocab_size, case_["vocab_size"].get<int>());
  EXPECT_EQ(c.tie_embeddings, case_["tied"].get<bool>());
  EXPECT_EQ(c.tokenizer, TokenizerKind::kBpe);
  EXPECT_EQ(c.rel.scheme, relpos::Scheme::kAlibi);
  EXPECT_EQ(model_->file_dtype(), DType::kF32);
}

TEST_P(HfCheckpointTest, LogitsAndGreedyTokensMatchTransformers) {
  auto backend = Cpu(model_);
  testing::ExpectBackendMatchesHf(*backend, prompts_, model_->config().vocab_size, kRtol, GetParam());
}

TEST_P(HfCheckpointTest, ShardedEqualsUnshardedBitwise) {
  auto sharded = Model::Load(case_["sharded_dir"]);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  auto a = Cpu(model_), b = Cpu(*sharded);
  const int vocab = model_->config().vocab_size;
  const std::vector<float> la = testing::ExpectBackendMatchesHf(*a, prompts_, vocab, kRtol, "unsharded");
  const std::vector<float> lb = testing::ExpectBackendMatchesHf(*b, prompts_, vocab, kRtol, "sharded");
  ASSERT_EQ(la.size(), lb.size());
  ASSERT_FALSE(la.empty());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0);
}

// All five prompts at once through the engine (continuous batching, greedy): transformers' tokens.
TEST_P(HfCheckpointTest, EngineGreedyEqualsTransformersBatched) {
  auto tokenizer = NewTokenizer(model_->config(), model_->dir());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto engine = Engine::Create(model_, Cpu(model_), *std::move(tokenizer), EngineConfig{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (const auto& p : prompts_) {
    Request r;
    r.prompt = p.prompt;
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
    EXPECT_EQ(all.token_ids, prompts_[i].greedy) << "prompt " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Hf, HfCheckpointTest, ::testing::ValuesIn(CaseNames()),
                         [](const auto& i) { std::string n = i.param; std::replace(n.begin(), n.end(), '-', '_'); return n; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HfCheckpointTest);

class HfBadCheckpointTest : public ::testing::TestWithParam<int> {};

TEST_P(HfBadCheckpointTest, RefusedNamingWhatAndWhy) {
  const auto bad = testing::ReadJson(testing::HfCasesDir() + "/manifest.json")["bad"][GetParam()];
  auto m = Model::Load(bad["dir"]);
  ASSERT_FALSE(m.ok()) << bad["name"] << " was loaded";
  for (const auto& s : bad["expect"]) {
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(s.get<std::string>())) << bad["name"];
  }
}

INSTANTIATE_TEST_SUITE_P(Hf, HfBadCheckpointTest,
                         ::testing::Range(0, testing::HfCasesDir().empty()
                                                 ? 0
                                                 : static_cast<int>(testing::ReadJson(testing::HfCasesDir() +
                                                                                      "/manifest.json")["bad"]
                                                                        .size())),
                         [](const auto& i) {
                           std::string n = testing::ReadJson(testing::HfCasesDir() + "/manifest.json")["bad"][i.param]["name"];
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HfBadCheckpointTest);

// generation_config.json has the final word on the special ids.
TEST(HfCheckpointConfigTest, GenerationConfigOverridesTokenIds) {
  const nlohmann::json c = testing::HfCases().at(0);
  const std::string dir = testing::TempDir("hf-genconfig");
  std::system(("cp -r '" + c["dir"].get<std::string>() + "/.' '" + dir + "'").c_str());
  testing::WriteFile(dir + "/generation_config.json", R"({"bos_token_id": 5, "eos_token_id": [7], "pad_token_id": 9})");
  auto ckpt = LoadHfCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config.bos_token_id, 5);
  EXPECT_EQ(ckpt->config.eos_token_id, 7);
  EXPECT_EQ(ckpt->config.pad_token_id, 9);
  testing::WriteFile(dir + "/generation_config.json", R"({"eos_token_id": [7, 8]})");
  auto two = LoadHfCheckpoint(dir);
  ASSERT_FALSE(two.ok());
  EXPECT_THAT(std::string(two.status().message()), HasSubstr("'eos_token_id' is [7,8]; allowed: one token id"));
}

// The server started on a checkpoint directory: model info says where it came from, and a text
// prompt (relgen's BPE) gives transformers' greedy tokens and text.
TEST(HfServerTest, ServesACheckpointDirectoryAsItIs) {
  int served = 0;  // a renamed or missing case must fail, not leave the loop empty
  for (const auto& c : testing::HfCases()) {
    if (c["name"] != "bloom-h6-untied" && c["name"] != "mpt-h6-bias-untied") continue;
    ++served;
    testing::ServerProcess server;
    std::string error;
    ASSERT_TRUE(server.Start({"--model", c["sharded_dir"].get<std::string>()}, &error)) << error;
    auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    {
      grpc::ClientContext ctx;
      v1::ModelInfo info;
      ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
      EXPECT_EQ(info.source(), "hf:" + c["family"].get<std::string>());
      EXPECT_EQ(info.architecture(), c["family"].get<std::string>());
      EXPECT_EQ(info.tokenizer(), "bpe");
      EXPECT_EQ(info.relative_attention().scheme(), "alibi");
    }
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.set_text(c["text"].get<std::string>());
    req.set_temperature(0.f);
    req.set_max_new_tokens(static_cast<int>(c["text_greedy"].size()));
    req.set_ignore_eos(true);
    v1::GenerateResponse resp;
    const grpc::Status s = stub->Generate(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    std::vector<int32_t> want = c["text_greedy"].get<std::vector<int32_t>>();
    EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()), want) << c["name"];
    EXPECT_EQ(resp.text(), c["text_greedy_decoded"].get<std::string>()) << c["name"];
    EXPECT_EQ(resp.usage().prompt_tokens(), static_cast<int>(c["text_ids"].size()));
  }
  EXPECT_EQ(served, 2) << "the bloom-h6-untied and mpt-h6-bias-untied fixtures";
}

TEST(HfServerTest, BrokenCheckpointExitsAtStartWithTheReason) {
  const auto manifest = testing::ReadJson(testing::HfCasesDir() + "/manifest.json");
  int refused = 0;
  for (const auto& bad : manifest["bad"]) {
    if (bad["name"] != "mpt-math-key" && bad["name"] != "bloom-missing-shard") continue;
    ++refused;
    testing::ServerProcess p;
    std::string error;
    EXPECT_FALSE(p.Start({"--model", bad["dir"].get<std::string>()}, &error));
    EXPECT_EQ(p.Wait(), 1);
    for (const auto& s : bad["expect"]) EXPECT_THAT(error, HasSubstr(s.get<std::string>())) << bad["name"];
  }
  EXPECT_EQ(refused, 2) << "the mpt-math-key and bloom-missing-shard fixtures";
}

}  // namespace
}  // namespace relgen
