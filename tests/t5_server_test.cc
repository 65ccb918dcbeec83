// relgen-server on Hugging Face T5 directories: model info, a text request end to end (the
// SentencePiece tokenizer with </s>, transformers' greedy tokens and text), the encoder-token and
// KV-block metrics, broken checkpoints refused at start. Not built in the sanitizer trees: there
// SentencePiece cannot share a process with gRPC (engine/tokenizers/sentencepiece_wrapper.cc).
#include <grpcpp/grpcpp.h>

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
  if (testing::T5Cases().empty()) GTEST_SKIP() << "no T5 fixture";
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] != "t5-v1_1" && c["name"] != "mt5") continue;
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
}

TEST(T5ServerTest, BrokenCheckpointExitsAtStartWithTheReason) {
  if (testing::T5Cases().empty()) GTEST_SKIP() << "no T5 fixture";
  const nlohmann::json manifest = testing::T5Manifest();
  for (const auto& bad : manifest["bad"]) {
    if (bad["name"] != "t5-math-value" && bad["name"] != "mt5-no-spiece") continue;
    testing::ServerProcess p;
    std::string error;
    EXPECT_FALSE(p.Start({"--model", bad["dir"].get<std::string>()}, &error));
    EXPECT_EQ(p.Wait(), 1);
    for (const auto& s : bad["expect"]) EXPECT_THAT(error, HasSubstr(s.get<std::string>())) << bad["name"];
  }
}

}  // namespace
}  // namespace relgen
