// relgen-server on Hugging Face T5 directories: model info, a text request end to end (the
// SentencePiece tokenizer with </s>, transformers' greedy tokens and text), the encoder-token and
// KV-block metrics, broken checkpoints refused at start. Not built in the sanitizer trees: there
// SentencePiece cannot share a process with gRPC (engine/tokenizers/sentencepiece_wrapper.cc).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "relgen/v1/generation.grpc.pb.h"
#include "tests/server_process.h"
#include "tests/t5_reference.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;
namespace v1 = ::relgen::v1;

TEST(T5ServerTest, ServesACheckpointDirectoryAsItIs) {
  ASSERT_FALSE(testing::T5Cases().empty()) << "no T5 fixture (RELGEN_T5_CASES_DIR, ctest fixture t5_checkpoints)";
  int served = 0;  // a renamed or missing case must fail, not leave the loop empty
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] != "t5-v1_1" && c["name"] != "mt5") continue;
    ++served;
    testing::ServerProcess server;
    std::string error;
    ASSERT_TRUE(server.Start({"--model", c["sharded_dir"].get<std::string>()}, &error)) << error;
    auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    {
      grpc::ClientContext ctx;
      v1::ModelInfo info;
      ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
      EXPECT_EQ(info.source(), "hf:" + c["model_type"].get<std::string>());
      EXPECT_EQ(info.architecture(), "t5");
      EXPECT_TRUE(info.encoder_decoder());
      EXPECT_EQ(info.n_encoder_layers(), c["num_layers"].get<int>());
      EXPECT_EQ(info.n_layers(), c["num_decoder_layers"].get<int>());
      EXPECT_EQ(info.decoder_start_token_id(), c["decoder_start_token_id"].get<int>());
      EXPECT_EQ(info.tokenizer(), "sentencepiece");
      EXPECT_EQ(info.relative_attention().scheme(), "t5");
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
    EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()),
              c["text_greedy"].get<std::vector<int32_t>>())
        << c["name"];
    EXPECT_EQ(resp.text(), c["text_greedy_decoded"].get<std::string>()) << c["name"];
    EXPECT_EQ(resp.usage().prompt_tokens(), static_cast<int>(c["text_ids"].size()));
    const auto m = testing::ParseMetrics(testing::Scrape(server.metrics_port()));
    EXPECT_EQ(m.at("relgen_prompt_tokens_total"), static_cast<double>(c["text_ids"].size()));
    EXPECT_EQ(m.at("relgen_encoder_tokens_total"), static_cast<double>(c["text_ids"].size()));
    EXPECT_EQ(m.at("relgen_kv_cache_blocks{state=\"used\"}"), 0);
  }
  EXPECT_EQ(served, 2) << "the t5-v1_1 and mt5 fixtures";
}

// Score on an encoder-decoder model: the context is the encoder's input, each continuation the
// decoder's output. Against transformers' decoder logits before each of its greedy tokens, and
// against the logprobs Generate reports for the same greedy tokens. prompt_logprobs has nothing to
// score there: INVALID_ARGUMENT naming it.
TEST(T5ServerTest, ScoreMatchesTransformersAndPromptLogprobsIsRefused) {
  ASSERT_FALSE(testing::T5Cases().empty()) << "no T5 fixture (RELGEN_T5_CASES_DIR, ctest fixture t5_checkpoints)";
  int served = 0;
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] != "t5-v1_1") continue;
    ++served;
    testing::ServerProcess server;
    std::string error;
    ASSERT_TRUE(server.Start({"--model", c["dir"].get<std::string>()}, &error)) << error;
    auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    {
      grpc::ClientContext ctx;
      v1::GenerateRequest req;
      req.set_text(c["text"].get<std::string>());
      req.set_prompt_logprobs(0);
      v1::GenerateResponse resp;
      const grpc::Status s = stub->Generate(&ctx, req, &resp);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(s.error_message(), HasSubstr("prompt_logprobs: the model is encoder-decoder"));
    }
    {
      // The decoder's context holds its start token and the continuation.
      grpc::ClientContext ictx, ctx;
      v1::ModelInfo info;
      ASSERT_TRUE(stub->GetModelInfo(&ictx, v1::GetModelInfoRequest(), &info).ok());
      v1::ScoreRequest req;
      req.set_text(c["text"].get<std::string>());
      auto* ids = req.add_continuations()->mutable_token_ids();
      for (int i = 0; i < info.max_seq_len(); ++i) ids->add_ids(5);
      v1::ScoreResponse resp;
      const grpc::Status s = stub->Score(&ctx, req, &resp);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(s.error_message(),
                  HasSubstr("continuations: continuations[0] is " + std::to_string(info.max_seq_len()) +
                            " tokens; the model's decoder takes at most " + std::to_string(info.max_seq_len() - 1)));
    }
    const std::vector<testing::T5Input> inputs = testing::ReadT5Reference(c);
    ASSERT_FALSE(inputs.empty());
    v1::ScoreRequest score;  // every input's greedy output, each scored after its own input
    for (const testing::T5Input& in : inputs) {
      score.Clear();
      for (int32_t t : in.input) score.mutable_token_ids()->add_ids(t);
      auto* cont = score.add_continuations()->mutable_token_ids();
      for (int32_t t : in.greedy) cont->add_ids(t);
      score.add_continuations()->mutable_token_ids()->add_ids(in.greedy[0]);
      grpc::ClientContext ctx;
      v1::ScoreResponse resp;
      const grpc::Status s = stub->Score(&ctx, score, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(resp.scores_size(), 2);
      const int m = static_cast<int>(in.greedy.size());
      const int vocab = static_cast<int>(in.logits.size() / m);
      ASSERT_EQ(resp.scores(0).logprobs_size(), m);
      // The same tokens generated greedily, with their logprobs.
      grpc::ClientContext gctx;
      v1::GenerateRequest gen;
      for (int32_t t : in.input) gen.mutable_token_ids()->add_ids(t);
      gen.set_temperature(0);
      gen.set_max_new_tokens(m);
      gen.set_ignore_eos(true);
      gen.set_logprobs(0);
      v1::GenerateResponse g;
      ASSERT_TRUE(stub->Generate(&gctx, gen, &g).ok());
      ASSERT_EQ(std::vector<int32_t>(g.token_ids().begin(), g.token_ids().end()), in.greedy);
      double sum = 0;
      for (int j = 0; j < m; ++j) {
        const double* row = in.logits.data() + static_cast<size_t>(j) * vocab;
        const double mx = *std::max_element(row, row + vocab);
        double z = 0;
        for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
        const double want = row[in.greedy[j]] - mx - std::log(z);
        const v1::TokenInfo& got = resp.scores(0).logprobs(j);
        EXPECT_EQ(got.token_id(), in.greedy[j]);
        EXPECT_NEAR(got.logprob(), want, 1e-3) << "token " << j;
        EXPECT_NEAR(got.logprob(), g.logprobs(j).logprob(), 1e-5) << "token " << j;
        sum += got.logprob();
      }
      EXPECT_NEAR(resp.scores(0).sum_logprob(), sum, 1e-9 * (1 + std::abs(sum)));
      EXPECT_NEAR(resp.scores(1).logprobs(0).logprob(), resp.scores(0).logprobs(0).logprob(), 1e-5);
      EXPECT_EQ(resp.usage().prompt_tokens(), static_cast<int>(in.input.size()));
      EXPECT_EQ(resp.usage().continuation_tokens(), m + 1);
    }
  }
  EXPECT_EQ(served, 1) << "the t5-v1_1 fixture";
}

TEST(T5ServerTest, BrokenCheckpointExitsAtStartWithTheReason) {
  ASSERT_FALSE(testing::T5Cases().empty()) << "no T5 fixture (RELGEN_T5_CASES_DIR, ctest fixture t5_checkpoints)";
  const nlohmann::json manifest = testing::T5Manifest();
  int refused = 0;
  for (const auto& bad : manifest["bad"]) {
    if (bad["name"] != "t5-math-value" && bad["name"] != "mt5-no-spiece") continue;
    ++refused;
    testing::ServerProcess p;
    std::string error;
    EXPECT_FALSE(p.Start({"--model", bad["dir"].get<std::string>()}, &error));
    EXPECT_EQ(p.Wait(), 1);
    for (const auto& s : bad["expect"]) EXPECT_THAT(error, HasSubstr(s.get<std::string>())) << bad["name"];
  }
  EXPECT_EQ(refused, 2) << "the t5-math-value and mt5-no-spiece fixtures";
}

}  // namespace
}  // namespace relgen
