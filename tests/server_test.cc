// relgen-server end to end: a real server process on loopback and a real gRPC client.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "engine/backends/cpu_backend.h"
#include "engine/core/engine.h"
#include "engine/model/safetensors.h"
#include "relgen/v1/generation.grpc.pb.h"
#include "tests/grpc_test_util.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

// Standard services spoken through the generic stub: the request and response bytes are tiny
// protobuf messages written out by hand.
std::string GenericUnary(const std::string& address, const std::string& method, const std::string& request) {
  const auto [s, body] = RawUnary(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), method, request);
  return s.ok() ? body : "error: " + s.error_message();
}

std::string ReflectionListServices(const std::string& address) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  auto step = [&](intptr_t t) { return cq.Next(&tag, &ok) && ok && reinterpret_cast<intptr_t>(tag) == t; };
  call->StartCall(reinterpret_cast<void*>(1));
  if (!step(1)) return "";
  const std::string list_services = std::string("\x3a\x01*", 3);  // field 7 (list_services) = "*"
  grpc::Slice slice(list_services);
  grpc::ByteBuffer req(&slice, 1), resp;
  call->Write(req, reinterpret_cast<void*>(2));
  if (!step(2)) return "";
  call->Read(&resp, reinterpret_cast<void*>(3));
  if (!step(3)) return "";
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  return Bytes(resp);
}

// The same request through the engine API in this process.
std::vector<int32_t> EngineTokens(const std::string& model_dir, const Request& r) {
  auto model = *Model::Load(model_dir);
  auto engine = *Engine::Create(model, *NewCpuBackend(model, KvCacheConfig{16, 256}, 1), NewByteTokenizer(), EngineConfig{});
  auto h = *engine->Submit(r);
  std::vector<int32_t> out;
  Output o;
  while (h->Next(&o)) out.insert(out.end(), o.token_ids.begin(), o.token_ids.end());
  return out;
}

std::vector<int32_t> Ids(const google::protobuf::RepeatedField<int32_t>& ids) { return {ids.begin(), ids.end()}; }

v1::ScoreRequest ScoreIds(const std::vector<int32_t>& context, const std::vector<std::vector<int32_t>>& continuations) {
  v1::ScoreRequest r;
  for (int32_t t : context) r.mutable_token_ids()->add_ids(t);
  for (const auto& c : continuations) {
    auto* ids = r.add_continuations()->mutable_token_ids();
    for (int32_t t : c) ids->add_ids(t);
  }
  return r;
}

// A unary Generate that must succeed.
v1::GenerateResponse MustGenerate(v1::GenerationService::Stub& stub, const v1::GenerateRequest& req) {
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  const grpc::Status s = stub.Generate(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp;
}

v1::ScoreResponse MustScore(v1::GenerationService::Stub& stub, const v1::ScoreRequest& req) {
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  const grpc::Status s = stub.Score(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp;
}

// Each continuation's scores equal the prompt log-probabilities a Generate computes for context +
// that continuation (the continuation's token j sits at prompt position context + j, whose entry
// is prompt_logprobs[context + j - 1]); each sum is the sum of its tokens'.
void ExpectScoresMatchPromptLogprobs(v1::GenerationService::Stub& stub, const v1::ScoreRequest& score,
                                     const std::vector<int32_t>& context_ids,
                                     const std::vector<std::vector<int32_t>>& continuations, int top) {
  const v1::ScoreResponse resp = MustScore(stub, score);
  ASSERT_EQ(resp.scores_size(), static_cast<int>(continuations.size()));
  int total = 0;
  for (size_t c = 0; c < continuations.size(); ++c) {
    const std::vector<int32_t>& cont = continuations[c];
    total += static_cast<int>(cont.size());
    const v1::ContinuationScore& sc = resp.scores(static_cast<int>(c));
    EXPECT_EQ(Ids(sc.token_ids()), cont) << "continuation " << c;
    ASSERT_EQ(sc.logprobs_size(), static_cast<int>(cont.size())) << "continuation " << c;
    std::vector<int32_t> full = context_ids;
    full.insert(full.end(), cont.begin(), cont.end());
    v1::GenerateRequest g = TokenRequest(full, 1);
    g.set_temperature(0);
    g.set_prompt_logprobs(top);
    const v1::GenerateResponse gen = MustGenerate(stub, g);
    ASSERT_EQ(gen.prompt_logprobs_size(), static_cast<int>(full.size()) - 1) << "continuation " << c;
    double sum = 0;
    for (size_t j = 0; j < cont.size(); ++j) {
      const v1::TokenInfo& got = sc.logprobs(static_cast<int>(j));
      const v1::TokenInfo& want = gen.prompt_logprobs(static_cast<int>(context_ids.size() + j - 1));
      EXPECT_EQ(got.token_id(), cont[j]);
      EXPECT_EQ(want.token_id(), cont[j]);
      EXPECT_NEAR(got.logprob(), want.logprob(), 1e-5) << "continuation " << c << " token " << j;
      EXPECT_LE(got.logprob(), 0.0f);
      ASSERT_EQ(got.top_logprobs_size(), top);
      ASSERT_EQ(want.top_logprobs_size(), top);
      for (int k = 0; k < top; ++k) {
        EXPECT_EQ(got.top_logprobs(k).token_id(), want.top_logprobs(k).token_id());
        EXPECT_NEAR(got.top_logprobs(k).logprob(), want.top_logprobs(k).logprob(), 1e-5);
      }
      sum += got.logprob();
    }
    EXPECT_NEAR(sc.sum_logprob(), sum, 1e-9 * (1 + std::abs(sum))) << "continuation " << c;
  }
  EXPECT_EQ(resp.usage().prompt_tokens(), static_cast<int>(context_ids.size()));
  EXPECT_EQ(resp.usage().continuation_tokens(), total);
  EXPECT_EQ(resp.usage().generated_tokens(), 0);
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = StartServer({"--model", ModelDir("skew"), "--kv_cache_tokens", "8192", "--max_new_tokens", "300",
                           "--max_prompt_bytes", "1000", "--enable_test_hooks"})
                  .release();
  }
  static void TearDownTestSuite() { delete server_; }
  static testing::ServerProcess* server_;
};
testing::ServerProcess* ServerTest::server_ = nullptr;

// Streams `req` with the engine let through one step at first: the first message must carry that
// step's one token and the request must still be running, whatever the machine's speed.
Collected StreamFirstStepAlone(v1::GenerationService::Stub& stub, const v1::GenerateRequest& req, int metrics_port) {
  Collected c;
  absl::Cleanup resume = [metrics_port] { testing::ResumeEngine(metrics_port); };
  if (!testing::PauseEngine(metrics_port) || !testing::StepEngine(metrics_port)) {
    ADD_FAILURE() << "the test hooks did not answer";
    return c;
  }
  grpc::ClientContext ctx;
  auto reader = stub.GenerateStream(&ctx, req);
  v1::GenerateStreamResponse m;
  if (!reader->Read(&m)) {
    c.status = reader->Finish();
    ADD_FAILURE() << "no first message: " << c.status.error_message();
    return c;
  }
  EXPECT_EQ(m.token_ids_size(), 1) << "one step ran, so the first message carries one token";
  EXPECT_EQ(m.finish_reason(), v1::FINISH_REASON_UNSPECIFIED) << "the stream answered before the request ended";
  testing::ResumeEngine(metrics_port);
  do {
    ++c.chunks;
    c.tokens.insert(c.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    c.text += m.text_delta();
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) c.reason = m.finish_reason();
  } while (reader->Read(&m));
  c.status = reader->Finish();
  return c;
}

TEST_F(ServerTest, UnaryAndStreamingMatchTheEngine) {
  auto stub = Stub(*server_);
  Request local;
  local.prompt = {10, 20, 30, 40, 50, 60};
  local.stop.max_new_tokens = 40;
  local.stop.ignore_eos = true;
  for (bool sampled : {false, true}) {
    v1::GenerateRequest req = TokenRequest(local.prompt, 40);
    if (sampled) {
      req.set_temperature(0.8f);
      req.set_top_k(50);
      req.set_seed(1234);
      local.sampling.temperature = 0.8f;
      local.sampling.top_k = 50;
      local.sampling.seed = 1234;
    } else {
      req.set_temperature(0.0f);
      local.sampling.temperature = 0.0f;
    }
    const std::vector<int32_t> want = EngineTokens(ModelDir("skew"), local);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok());
    EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()), want);
    EXPECT_EQ(resp.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(resp.usage().prompt_tokens(), 6);
    EXPECT_EQ(resp.usage().generated_tokens(), 40);
    EXPECT_FALSE(resp.request_id().empty());
    const Collected s = StreamFirstStepAlone(*stub, req, server_->metrics_port());
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.tokens, want);
    EXPECT_EQ(s.text, resp.text());
    EXPECT_EQ(s.reason, v1::FINISH_REASON_LENGTH);
  }
}

TEST_F(ServerTest, TextPromptsGetBosAndEchoRequestId) {
  auto stub = Stub(*server_);
  v1::GenerateRequest req;
  req.set_text("Hello, relgen");
  req.set_max_new_tokens(12);
  req.set_temperature(0);
  req.set_request_id("my-id-7");
  req.set_ignore_eos(true);
  req.set_logprobs(3);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.request_id(), "my-id-7");
  Request local;
  local.prompt = {256};
  for (char ch : std::string("Hello, relgen")) local.prompt.push_back(static_cast<uint8_t>(ch));
  local.stop.max_new_tokens = 12;
  local.stop.ignore_eos = true;
  local.sampling.temperature = 0;
  EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()), EngineTokens(ModelDir("skew"), local));
  ASSERT_EQ(resp.logprobs_size(), 12);
  EXPECT_EQ(resp.logprobs(0).top_logprobs_size(), 3);
  // Greedy: the chosen token is the most likely one.
  EXPECT_EQ(resp.logprobs(0).token_id(), resp.logprobs(0).top_logprobs(0).token_id());
  EXPECT_EQ(resp.usage().prompt_tokens(), 14);
}

TEST_F(ServerTest, ModelInfoHealthAndReflection) {
  auto stub = Stub(*server_);
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  const ModelConfig c = (*Model::Load(ModelDir("skew")))->config();
  EXPECT_EQ(info.name(), c.name);
  EXPECT_EQ(info.vocab_size(), c.vocab_size);
  EXPECT_EQ(info.d_model(), c.d_model);
  EXPECT_EQ(info.n_layers(), c.n_layers);
  EXPECT_EQ(info.n_heads(), c.n_heads);
  EXPECT_EQ(info.head_dim(), c.head_dim);
  EXPECT_EQ(info.ffn_dim(), c.ffn_dim);
  EXPECT_EQ(info.max_seq_len(), c.max_seq_len);
  EXPECT_EQ(info.relative_attention().scheme(), "skew");
  EXPECT_EQ(info.relative_attention().max_relative_position(), c.rel.max_relative_position);
  EXPECT_EQ(info.eos_token_id(), c.eos_token_id);
  EXPECT_EQ(info.tokenizer(), "byte");
  EXPECT_EQ(info.device(), "cpu");
  EXPECT_EQ(info.kv_cache_tokens(), 8192);
  EXPECT_EQ(info.max_new_tokens_limit(), 300);
  EXPECT_EQ(GenericUnary(server_->address(), "/grpc.health.v1.Health/Check", ""), std::string("\x08\x01", 2))
      << "health status SERVING (1)";
  EXPECT_THAT(ReflectionListServices(server_->address()), HasSubstr("relgen.v1.GenerationService"));
}

struct BadCase {
  const char* name;
  std::function<void(v1::GenerateRequest&)> mutate;
  const char* field;
};

TEST_F(ServerTest, InvalidInputsNameTheField) {
  auto stub = Stub(*server_);
  const std::vector<BadCase> cases = {
      {"empty text", [](auto& r) { r.set_text(""); }, "text: the prompt is empty"},
      {"no prompt", [](auto& r) { r.clear_token_ids(); }, "prompt: missing"},
      {"empty ids", [](auto& r) { r.mutable_token_ids()->clear_ids(); }, "prompt: empty; allowed 1 or more tokens"},
      {"id >= vocab", [](auto& r) { r.mutable_token_ids()->add_ids(259); }, "prompt: ids[3] = 259; allowed 0..258"},
      {"negative id", [](auto& r) { r.mutable_token_ids()->set_ids(0, -1); }, "prompt: ids[0] = -1"},
      {"max_new < 0", [](auto& r) { r.set_max_new_tokens(-1); }, "max_new_tokens: -1; allowed 0..300"},
      {"max_new over limit", [](auto& r) { r.set_max_new_tokens(301); }, "max_new_tokens: 301; allowed 0..300"},
      {"over context", [](auto& r) {
         for (int i = 0; i < 300; ++i) r.mutable_token_ids()->add_ids(5);
         r.set_max_new_tokens(250);
       }, "max_new_tokens: 250 after a prompt of 303 tokens exceeds the model's context of 512 tokens; allowed 0..209"},
      {"prompt fills context", [](auto& r) {
         for (int i = 0; i < 600; ++i) r.mutable_token_ids()->add_ids(5);
       }, "prompt: the prompt is 603 tokens"},
      {"temperature < 0", [](auto& r) { r.set_temperature(-0.5f); }, "temperature: -0.5; allowed 0..100"},
      {"top_p 0", [](auto& r) { r.set_top_p(0); }, "top_p: 0; allowed (0, 1]"},
      {"top_p > 1", [](auto& r) { r.set_top_p(1.5f); }, "top_p: 1.5; allowed (0, 1]"},
      {"top_k < 0", [](auto& r) { r.set_top_k(-1); }, "top_k: -1; allowed 0..259"},
      {"repetition_penalty", [](auto& r) { r.set_repetition_penalty(0); }, "repetition_penalty: 0; allowed (0, 10]"},
      {"too many stops", [](auto& r) { for (int i = 0; i < 17; ++i) r.add_stop("x"); }, "stop: 17 strings; allowed at most 16"},
      {"stop too long", [](auto& r) { r.add_stop(std::string(257, 'a')); }, "stop: stop[0] is 257 bytes; allowed 1..256"},
      {"empty stop", [](auto& r) { r.add_stop(""); }, "stop: stop[0] is 0 bytes"},
      {"stop id", [](auto& r) { r.add_stop_token_ids(400); }, "stop_token_ids: stop_token_ids[0] = 400"},
      {"logprobs", [](auto& r) { r.set_logprobs(21); }, "logprobs: 21; allowed 0..20"},
      {"oversized text", [](auto& r) { r.set_text(std::string(1001, 'a')); }, "text: 1001 bytes; allowed at most 1000"},
      {"request_id", [](auto& r) { r.set_request_id(std::string(129, 'r')); }, "request_id: 129 bytes; allowed at most 128"},
      {"n 0", [](auto& r) { r.set_n(0); }, "n: 0 samples; allowed 1..16"},
      {"n 17", [](auto& r) { r.set_n(17); }, "n: 17 samples; allowed 1..16"},
      {"prompt_logprobs 21", [](auto& r) { r.set_prompt_logprobs(21); }, "prompt_logprobs: 21; allowed 0..20"},
      {"prompt_logprobs -1", [](auto& r) { r.set_prompt_logprobs(-1); }, "prompt_logprobs: -1; allowed 0..20"},
  };
  for (const BadCase& c : cases) {
    v1::GenerateRequest req = TokenRequest({1, 2, 3}, 10);
    c.mutate(req);
    for (bool stream : {false, true}) {
      grpc::Status s;
      if (stream) {
        s = Stream(*stub, req).status;
      } else {
        grpc::ClientContext ctx;
        v1::GenerateResponse resp;
        s = stub->Generate(&ctx, req, &resp);
      }
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
      EXPECT_THAT(s.error_message(), HasSubstr(c.field)) << c.name;
    }
  }
  // Still serving.
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_TRUE(stub->Generate(&ctx, TokenRequest({1, 2, 3}, 5), &resp).ok());
  EXPECT_EQ(resp.token_ids_size(), 5);
}

TEST_F(ServerTest, MessageOverGrpcLimitIsRefusedByGrpc) {
  auto stub = Stub(*server_);
  v1::GenerateRequest req;
  req.set_text(std::string(5 << 20, 'a'));  // above --max_message_bytes (4 MiB)
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_EQ(stub->Generate(&ctx, req, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST_F(ServerTest, ScoreInvalidInputsNameTheField) {
  auto stub = Stub(*server_);
  struct ScoreCase {
    const char* name;
    std::function<void(v1::ScoreRequest&)> mutate;
    const char* message;
  };
  const std::vector<ScoreCase> cases = {
      {"no context", [](auto& r) { r.clear_token_ids(); }, "context: missing; set text or token_ids"},
      {"empty context text", [](auto& r) { r.set_text(""); }, "text: the context is empty"},
      {"empty context ids", [](auto& r) { r.mutable_token_ids()->clear_ids(); }, "context: empty; allowed 1 or more tokens"},
      {"context id >= vocab", [](auto& r) { r.mutable_token_ids()->set_ids(1, 259); },
       "context: ids[1] = 259; allowed 0..258"},
      {"context fills the model", [](auto& r) {
         for (int i = 0; i < 509; ++i) r.mutable_token_ids()->add_ids(7);
       }, "context: the context is 512 tokens; the model's context is 512 tokens, so at most 511 context tokens"},
      {"oversized context text", [](auto& r) { r.set_text(std::string(1001, 'a')); },
       "text: 1001 bytes; allowed at most 1000"},
      {"no continuations", [](auto& r) { r.clear_continuations(); }, "continuations: 0 continuations; allowed 1..64"},
      {"too many continuations", [](auto& r) {
         while (r.continuations_size() < 65) r.add_continuations()->set_text("x");
       }, "continuations: 65 continuations; allowed 1..64"},
      {"empty continuation text", [](auto& r) { r.add_continuations()->set_text(""); },
       "continuations: continuations[1] is empty; each continuation needs at least one token"},
      {"empty continuation ids", [](auto& r) { r.add_continuations()->mutable_token_ids(); },
       "continuations: continuations[1] is empty"},
      {"continuation unset", [](auto& r) { r.add_continuations(); }, "continuations: continuations[1] is empty"},
      {"continuation id >= vocab", [](auto& r) { r.mutable_continuations(0)->mutable_token_ids()->add_ids(300); },
       "continuations: continuations[0]: ids[2] = 300; allowed 0..258"},
      {"oversized continuation text", [](auto& r) { r.add_continuations()->set_text(std::string(1001, 'b')); },
       "continuations: continuations[1] is 1001 bytes; allowed at most 1000"},
      {"context + continuation too long", [](auto& r) {
         for (int i = 0; i < 497; ++i) r.mutable_token_ids()->add_ids(7);  // 500 context tokens
         auto* ids = r.add_continuations()->mutable_token_ids();
         for (int i = 0; i < 13; ++i) ids->add_ids(8);
       }, "continuations: continuations[1] is 13 tokens after a context of 500 tokens: together over the model's "
          "context of 512 tokens; allowed at most 12 continuation tokens"},
      {"top_logprobs 21", [](auto& r) { r.set_top_logprobs(21); }, "top_logprobs: 21; allowed 0..20"},
      {"top_logprobs -1", [](auto& r) { r.set_top_logprobs(-1); }, "top_logprobs: -1; allowed 0..20"},
      {"request_id", [](auto& r) { r.set_request_id(std::string(129, 'r')); }, "request_id: 129 bytes; allowed at most 128"},
  };
  for (const ScoreCase& c : cases) {
    v1::ScoreRequest req = ScoreIds({1, 2, 3}, {{4, 5}});
    c.mutate(req);
    grpc::ClientContext ctx;
    v1::ScoreResponse resp;
    const grpc::Status s = stub->Score(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
  }
  // The limits themselves are allowed: 64 continuations, and context + continuation = the model's context.
  v1::ScoreRequest most = ScoreIds({1, 2, 3}, {});
  for (int i = 0; i < 64; ++i) most.add_continuations()->mutable_token_ids()->add_ids(10 + i);
  EXPECT_EQ(MustScore(*stub, most).scores_size(), 64);
  std::vector<int32_t> context(500, 7), cont(12, 8);
  EXPECT_EQ(MustScore(*stub, ScoreIds(context, {cont})).scores(0).logprobs_size(), 12);
}

// Score against Generate's prompt log-probabilities on the same tokens: text and ids, shared full
// blocks (a 40-token context spans two and a half) and alternatives.
TEST_F(ServerTest, ScoreEqualsGenerateWithPromptLogprobs) {
  auto stub = Stub(*server_);
  // Text: the context after BOS, each continuation without one.
  v1::ScoreRequest text;
  text.set_text("Hello");
  text.add_continuations()->set_text(" world");
  text.add_continuations()->set_text("!");
  text.set_top_logprobs(2);
  std::vector<int32_t> hello = {256, 'H', 'e', 'l', 'l', 'o'};
  std::vector<std::vector<int32_t>> text_conts = {{' ', 'w', 'o', 'r', 'l', 'd'}, {'!'}};
  ExpectScoresMatchPromptLogprobs(*stub, text, hello, text_conts, 2);

  std::vector<int32_t> context;
  for (int i = 0; i < 40; ++i) context.push_back((i * 37 + 11) % 256);
  const std::vector<std::vector<int32_t>> conts = {{5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22},
                                                   {200},
                                                   {65, 66, 67}};
  v1::ScoreRequest ids = ScoreIds(context, conts);
  ExpectScoresMatchPromptLogprobs(*stub, ids, context, conts, 0);
  // top_logprobs unset is 0: no alternatives.
  EXPECT_EQ(MustScore(*stub, ids).scores(0).logprobs(0).top_logprobs_size(), 0);
}

// prompt_logprobs and Score against the PyTorch reference's logits (tools/relgen_ref.py, float64):
// log_softmax of position j - 1's logits at token j.
TEST(ServerScoreTest, LogprobsMatchTheReference) {
  const std::string dir = testing::GoldenDir() + "/skew_short_range";
  auto server = StartServer({"--model", dir, "--kv_cache_tokens", "4096"});
  auto stub = Stub(*server);
  auto golden = SafetensorsFile::Open(dir + "/golden.safetensors");
  ASSERT_TRUE(golden.ok()) << golden.status();
  constexpr int kLen = 129;
  const TensorInfo* tt = (*golden)->Find("tokens_" + std::to_string(kLen));
  const TensorInfo* lt = (*golden)->Find("logits_" + std::to_string(kLen));
  ASSERT_TRUE(tt != nullptr && lt != nullptr);
  std::vector<int32_t> tokens(kLen);
  std::memcpy(tokens.data(), tt->data, kLen * sizeof(int32_t));
  std::vector<double> logits(lt->numel());
  std::memcpy(logits.data(), lt->data, lt->nbytes);
  const int vocab = static_cast<int>(logits.size() / kLen);
  // ref[j]: log-probability of tokens[j] after tokens[0..j-1]; best[j]: the most likely there.
  std::vector<double> ref(kLen), best(kLen);
  for (int j = 1; j < kLen; ++j) {
    const double* row = &logits[static_cast<size_t>(j - 1) * vocab];
    double mx = row[0];
    for (int v = 1; v < vocab; ++v) mx = std::max(mx, row[v]);
    double z = 0;
    for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
    ref[j] = row[tokens[j]] - mx - std::log(z);
    best[j] = -std::log(z);
  }
  constexpr double kTol = 1e-3;  // float32 engine vs float64 reference
  v1::GenerateRequest g = TokenRequest(tokens, 1);
  g.set_prompt_logprobs(3);
  const v1::GenerateResponse gen = MustGenerate(*stub, g);
  ASSERT_EQ(gen.prompt_logprobs_size(), kLen - 1);
  for (int j = 1; j < kLen; ++j) {
    const v1::TokenInfo& t = gen.prompt_logprobs(j - 1);
    EXPECT_EQ(t.token_id(), tokens[j]);
    EXPECT_NEAR(t.logprob(), ref[j], kTol) << "prompt token " << j;
    ASSERT_EQ(t.top_logprobs_size(), 3);
    EXPECT_NEAR(t.top_logprobs(0).logprob(), best[j], kTol) << "prompt token " << j;
  }
  // The same tokens scored as a 40-token context and continuations of it.
  const int ctx_len = 40;
  const std::vector<int32_t> context(tokens.begin(), tokens.begin() + ctx_len);
  const std::vector<int32_t> rest(tokens.begin() + ctx_len, tokens.end());
  const std::vector<int32_t> part(tokens.begin() + ctx_len, tokens.begin() + ctx_len + 7);
  const v1::ScoreResponse sc = MustScore(*stub, ScoreIds(context, {rest, part}));
  ASSERT_EQ(sc.scores_size(), 2);
  for (int c = 0; c < 2; ++c) {
    const v1::ContinuationScore& s = sc.scores(c);
    ASSERT_EQ(s.logprobs_size(), c == 0 ? kLen - ctx_len : 7);
    double sum = 0, ref_sum = 0;
    for (int j = 0; j < s.logprobs_size(); ++j) {
      EXPECT_NEAR(s.logprobs(j).logprob(), ref[ctx_len + j], kTol) << "continuation " << c << " token " << j;
      EXPECT_NEAR(s.logprobs(j).logprob(), gen.prompt_logprobs(ctx_len + j - 1).logprob(), 1e-5);
      sum += s.logprobs(j).logprob();
      ref_sum += ref[ctx_len + j];
    }
    EXPECT_NEAR(s.sum_logprob(), sum, 1e-9 * (1 + std::abs(sum)));
    EXPECT_NEAR(s.sum_logprob(), ref_sum, kTol * s.logprobs_size());
  }
}

// Sample i of n = 3 with seed s is what a request of its own with seed s + i gets, from the server
// and from an engine in this process.
TEST_F(ServerTest, SamplesEqualSeparateRequestsWithTheirSeeds) {
  auto stub = Stub(*server_);
  const std::vector<int32_t> prompt = {10, 20, 30, 40, 50};
  v1::GenerateRequest req = TokenRequest(prompt, 24);
  req.set_temperature(0.9f);
  req.set_top_k(60);
  req.set_seed(4242);
  req.set_logprobs(1);
  req.set_n(3);
  const v1::GenerateResponse resp = MustGenerate(*stub, req);
  ASSERT_EQ(resp.samples_size(), 3);
  int generated = 0;
  for (int i = 0; i < 3; ++i) {
    const v1::Sample& s = resp.samples(i);
    EXPECT_EQ(s.index(), i);
    v1::GenerateRequest one = req;
    one.clear_n();
    one.set_seed(4242 + i);
    const v1::GenerateResponse alone = MustGenerate(*stub, one);
    EXPECT_TRUE(alone.samples().empty()) << "n = 1 answers in the top-level fields only";
    EXPECT_EQ(Ids(s.token_ids()), Ids(alone.token_ids())) << "sample " << i;
    EXPECT_EQ(s.text(), alone.text()) << "sample " << i;
    EXPECT_EQ(s.finish_reason(), alone.finish_reason()) << "sample " << i;
    EXPECT_EQ(s.generated_tokens(), alone.usage().generated_tokens());
    ASSERT_EQ(s.logprobs_size(), alone.logprobs_size());
    for (int j = 0; j < s.logprobs_size(); ++j) {
      EXPECT_EQ(s.logprobs(j).token_id(), alone.logprobs(j).token_id());
      EXPECT_EQ(s.logprobs(j).logprob(), alone.logprobs(j).logprob());
    }
    Request local;
    local.prompt = prompt;
    local.stop.max_new_tokens = 24;
    local.stop.ignore_eos = true;
    local.sampling.temperature = 0.9f;
    local.sampling.top_k = 60;
    local.sampling.seed = 4242 + i;
    EXPECT_EQ(Ids(s.token_ids()), EngineTokens(ModelDir("skew"), local)) << "sample " << i;
    generated += s.generated_tokens();
  }
  // Sample 0 in the fields older clients read.
  EXPECT_EQ(Ids(resp.token_ids()), Ids(resp.samples(0).token_ids()));
  EXPECT_EQ(resp.text(), resp.samples(0).text());
  EXPECT_EQ(resp.finish_reason(), resp.samples(0).finish_reason());
  EXPECT_EQ(resp.logprobs_size(), resp.samples(0).logprobs_size());
  EXPECT_EQ(resp.usage().prompt_tokens(), 5);
  EXPECT_EQ(resp.usage().generated_tokens(), generated);
  EXPECT_EQ(generated, 72);
}

// A stream of n = 2: every chunk is tagged with its sample, each sample's chunks add up to the
// unary answer's sample, and each ends with one final message carrying its finish reason.
TEST_F(ServerTest, StreamTagsChunksWithTheirSample) {
  auto stub = Stub(*server_);
  v1::GenerateRequest req = TokenRequest({7, 8, 9}, 30);
  req.set_temperature(1.0f);
  req.set_seed(99);
  req.set_n(2);
  req.set_request_id("stream-n2");
  const v1::GenerateResponse unary = MustGenerate(*stub, req);
  ASSERT_EQ(unary.samples_size(), 2);
  grpc::ClientContext ctx;
  auto reader = stub->GenerateStream(&ctx, req);
  std::vector<std::vector<int32_t>> tokens(2);
  std::vector<std::string> texts(2);
  std::vector<int> finals(2, 0);
  std::vector<int> chunks(2, 0);
  v1::GenerateStreamResponse m;
  while (reader->Read(&m)) {
    EXPECT_EQ(m.request_id(), "stream-n2");
    const int i = m.sample_index();
    ASSERT_TRUE(i == 0 || i == 1) << i;
    EXPECT_EQ(finals[i], 0) << "a message of sample " << i << " after its final one";
    ++chunks[i];
    tokens[i].insert(tokens[i].end(), m.token_ids().begin(), m.token_ids().end());
    texts[i] += m.text_delta();
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      ++finals[i];
      EXPECT_EQ(m.finish_reason(), unary.samples(i).finish_reason());
      EXPECT_EQ(m.usage().prompt_tokens(), 3);
      EXPECT_EQ(m.usage().generated_tokens(), static_cast<int>(tokens[i].size()));
    }
  }
  const grpc::Status s = reader->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(finals[i], 1) << "sample " << i;
    EXPECT_GT(chunks[i], 0) << "sample " << i;
    EXPECT_EQ(tokens[i], Ids(unary.samples(i).token_ids())) << "sample " << i;
    EXPECT_EQ(texts[i], unary.samples(i).text()) << "sample " << i;
  }
}

// prompt_logprobs reach unary and stream alike: sample 0's first message carries them, once.
TEST_F(ServerTest, PromptLogprobsUnaryAndStream) {
  auto stub = Stub(*server_);
  v1::GenerateRequest req = TokenRequest({3, 1, 4, 1, 5, 9, 2, 6}, 5);
  req.set_temperature(0);
  req.set_prompt_logprobs(4);
  req.set_n(2);
  const v1::GenerateResponse unary = MustGenerate(*stub, req);
  ASSERT_EQ(unary.prompt_logprobs_size(), 7);
  for (int j = 0; j < 7; ++j) {
    EXPECT_EQ(unary.prompt_logprobs(j).token_id(), req.token_ids().ids(j + 1));
    EXPECT_EQ(unary.prompt_logprobs(j).top_logprobs_size(), 4);
    EXPECT_GE(unary.prompt_logprobs(j).top_logprobs(0).logprob(), unary.prompt_logprobs(j).logprob());
  }
  grpc::ClientContext ctx;
  auto reader = stub->GenerateStream(&ctx, req);
  v1::GenerateStreamResponse m;
  int messages_with = 0;
  bool first_of_sample0 = true;
  while (reader->Read(&m)) {
    if (m.prompt_logprobs_size() > 0) {
      ++messages_with;
      EXPECT_EQ(m.sample_index(), 0);
      EXPECT_TRUE(first_of_sample0) << "prompt log-probabilities after sample 0's first message";
      ASSERT_EQ(m.prompt_logprobs_size(), 7);
      for (int j = 0; j < 7; ++j) {
        EXPECT_EQ(m.prompt_logprobs(j).token_id(), unary.prompt_logprobs(j).token_id());
        EXPECT_EQ(m.prompt_logprobs(j).logprob(), unary.prompt_logprobs(j).logprob());
      }
    }
    if (m.sample_index() == 0) first_of_sample0 = false;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(messages_with, 1);
}

TEST(ServerCancelTest, CancelAndDeadlineFreeBlocksAndAreCounted) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--enable_test_hooks"});
  auto stub = Stub(*server);
  const v1::GenerateRequest req = TokenRequest({5, 6, 7, 8}, 1800);
  const Collected cancelled = Stream(*stub, req, /*cancel_after=*/3);
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") == 1 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(Metric(m, "relgen_num_requests_running"), 0);

  // A deadline that passes mid-generation: once the first tokens arrived the engine is held, so
  // the request is still running, holding blocks, when its deadline comes. The engine resumes only
  // once the server's copy of the deadline (received before the first token) has surely passed:
  // the request then ends as a deadline however late the client's cancel reached the server.
  {
    grpc::ClientContext ctx;
    const auto timeout = std::chrono::seconds(5);
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    auto reader = stub->GenerateStream(&ctx, req);
    v1::GenerateStreamResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    const auto server_deadline_by = std::chrono::steady_clock::now() + timeout;
    ASSERT_TRUE(testing::PauseEngine(server->metrics_port()));
    int tokens = msg.token_ids_size();
    while (reader->Read(&msg)) tokens += msg.token_ids_size();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_GT(tokens, 0);
    EXPECT_LT(tokens, 1800);
    EXPECT_GT(Metric(testing::ParseMetrics(testing::Scrape(server->metrics_port())), "relgen_kv_cache_blocks{state=\"used\"}"), 0);
    std::this_thread::sleep_until(server_deadline_by + std::chrono::milliseconds(100));
    ASSERT_TRUE(testing::ResumeEngine(server->metrics_port()));
  }
  m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"deadline\"}") == 1 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"deadline\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_usage_ratio"), 0);
}

// A client that cancels a stream of n = 2 cancels both samples: each is in the books as cancelled
// and their blocks are freed.
TEST(ServerCancelTest, CancellingAStreamCancelsEverySample) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192"});
  auto stub = Stub(*server);
  v1::GenerateRequest req = TokenRequest({5, 6, 7, 8}, 1800);
  req.set_n(2);
  const Collected cancelled = Stream(*stub, req, /*cancel_after=*/3);
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  const auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") == 2 &&
           Metric(m, "relgen_request_errors_total{code=\"CANCELLED\"}") >= 1 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), 2);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(Metric(m, "relgen_num_requests_running"), 0);
  // Booked once per call, not per sample, whichever end of the call the server sees first.
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"CANCELLED\"}"), 1);
}

TEST(ServerMetricsTest, FiftyRequestsAreAllInTheBooks) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "16384", "--max_num_seqs", "8",
                             "--enable_test_hooks"});
  auto stub = Stub(*server);
  // The engine holds still until the "during" sample is taken, so load is in flight then however
  // fast or slow the machine is.
  ASSERT_TRUE(testing::PauseEngine(server->metrics_port()));
  std::atomic<int64_t> tokens_received{0}, prompt_sent{0};
  std::atomic<int> ok{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 5; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 10; ++i) {
        std::vector<int32_t> prompt(3 + (c * 10 + i) % 40, 65 + c);
        v1::GenerateRequest req = TokenRequest(prompt, 20 + (c * 10 + i) % 60);
        req.set_temperature(0);
        prompt_sent += static_cast<int64_t>(prompt.size());
        if (i % 2 == 0) {
          grpc::ClientContext ctx;
          v1::GenerateResponse resp;
          if (stub->Generate(&ctx, req, &resp).ok()) ++ok;
          tokens_received += resp.token_ids_size();
        } else {
          const Collected s = Stream(*stub, req);
          if (s.status.ok()) ++ok;
          tokens_received += static_cast<int64_t>(s.tokens.size());
        }
      }
    });
  }
  // During the run: every metric is there, and nothing counted exceeds what the engine holds. Each
  // client's first request is in the engine's queue.
  const auto during = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_received_total") == 5 && Metric(m, "relgen_num_requests_waiting") == 5;
  });
  const int64_t received_then = tokens_received.load();
  ASSERT_TRUE(testing::ResumeEngine(server->metrics_port()));
  for (auto& t : clients) t.join();
  // The engine's iteration is timed once it has delivered (so after its client may have seen the end).
  const auto after = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_e2e_request_latency_seconds_count") == 50 &&
           Metric(m, "relgen_engine_step_seconds_count") == Metric(m, "relgen_batch_size_count");
  });
  ASSERT_EQ(ok.load(), 50);
  for (const auto* m : {&during, &after}) {
    for (const char* name :
         {"relgen_time_to_first_token_seconds_count", "relgen_time_per_output_token_seconds_count",
          "relgen_e2e_request_latency_seconds_count", "relgen_request_queue_time_seconds_count",
          "relgen_request_prompt_tokens_count", "relgen_request_generation_tokens_count", "relgen_batch_size_count",
          "relgen_engine_step_plan_seconds_count", "relgen_engine_step_wait_seconds_count",
          "relgen_engine_step_land_seconds_count", "relgen_engine_step_seconds_count",
          "relgen_prompt_tokens_total", "relgen_generation_tokens_total", "relgen_requests_total{finish_reason=\"length\"}",
          "relgen_preemptions_total", "relgen_num_requests_running", "relgen_num_requests_waiting",
          "relgen_kv_cache_usage_ratio", "relgen_kv_cache_blocks{state=\"used\"}", "relgen_kv_cache_blocks{state=\"free\"}",
          "relgen_kv_cache_blocks{state=\"cached\"}", "relgen_prefix_cache_queries_total", "relgen_prefix_cache_hits_total",
          "relgen_device_memory_bytes{device=\"cpu\",kind=\"weights\"}",
          "relgen_device_memory_bytes{device=\"cpu\",kind=\"kv_cache\"}", "process_resident_memory_bytes"}) {
      EXPECT_GE(Metric(*m, name), 0) << name << (m == &during ? " (during)" : " (after)");
    }
  }
  EXPECT_GE(Metric(during, "relgen_generation_tokens_total"), received_then);
  EXPECT_EQ(Metric(during, "relgen_num_requests_running"), 0);
  EXPECT_EQ(Metric(during, "relgen_num_requests_waiting"), 5);
  EXPECT_EQ(Metric(during, "relgen_requests_received_total"), 5);
  EXPECT_EQ(Metric(after, "relgen_generation_tokens_total"), tokens_received.load());
  EXPECT_EQ(Metric(after, "relgen_prompt_tokens_total"), prompt_sent.load());
  double requests = 0;
  for (const char* r : {"length", "stop", "eos", "cancelled", "deadline", "error"}) {
    requests += Metric(after, std::string("relgen_requests_total{finish_reason=\"") + r + "\"}");
  }
  EXPECT_EQ(requests, 50);
  EXPECT_EQ(Metric(after, "relgen_requests_total{finish_reason=\"length\"}"), 50);
  EXPECT_EQ(Metric(after, "relgen_time_to_first_token_seconds_count"), 50);
  EXPECT_EQ(Metric(after, "relgen_request_generation_tokens_sum"), tokens_received.load());
  EXPECT_EQ(Metric(after, "relgen_time_per_output_token_seconds_count"), tokens_received.load() - 50);
  EXPECT_EQ(Metric(after, "relgen_num_requests_running"), 0);
  EXPECT_EQ(Metric(after, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  // Blocks of finished prompts stay cached (prefix caching is on by default) until reclaimed.
  EXPECT_EQ(Metric(after, "relgen_kv_cache_blocks{state=\"free\"}") + Metric(after, "relgen_kv_cache_blocks{state=\"cached\"}"),
            1024);
  EXPECT_GT(Metric(after, "relgen_batch_size_sum") / Metric(after, "relgen_batch_size_count"), 1.5) << "batching";
  // Host time per step: the CPU backend lands each step in the iteration that launched it, so every
  // step is timed once; its parts add up to it.
  EXPECT_EQ(Metric(after, "relgen_engine_step_seconds_count"), Metric(after, "relgen_batch_size_count"));
  for (const char* part : {"plan", "wait", "land"}) {
    const std::string name = std::string("relgen_engine_step_") + part + "_seconds";
    EXPECT_EQ(Metric(after, name + "_count"), Metric(after, "relgen_engine_step_seconds_count")) << part;
    EXPECT_EQ(Metric(after, name + "_bucket{le=\"+Inf\"}"), Metric(after, name + "_count")) << part;
    EXPECT_GE(Metric(after, name + "_sum"), 0) << part;
  }
  const double step_sum = Metric(after, "relgen_engine_step_seconds_sum");
  EXPECT_GT(step_sum, 0);
  EXPECT_NEAR(Metric(after, "relgen_engine_step_plan_seconds_sum") + Metric(after, "relgen_engine_step_wait_seconds_sum") +
                  Metric(after, "relgen_engine_step_land_seconds_sum"),
              step_sum, 1e-6 * step_sum + 1e-9);
}

// Each sample and each scored continuation finishes in the books as a request of its own; the call
// counters count calls.
TEST(ServerMetricsTest, SamplesAndContinuationsAreEachInTheBooks) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192"});
  auto stub = Stub(*server);
  v1::GenerateRequest req = TokenRequest({1, 2, 3, 4}, 6);
  req.set_n(3);
  EXPECT_EQ(MustGenerate(*stub, req).samples_size(), 3);
  req.set_n(2);
  const Collected streamed = Stream(*stub, req);
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
  EXPECT_EQ(streamed.tokens.size(), 12u);
  EXPECT_EQ(MustScore(*stub, ScoreIds({1, 2, 3}, {{4}, {5, 6}})).scores_size(), 2);
  req.set_n(17);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_EQ(stub->Generate(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"length\"}") == 7;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"length\"}"), 7);  // 3 + 2 samples, 2 continuations
  EXPECT_EQ(Metric(m, "relgen_e2e_request_latency_seconds_count"), 7);
  EXPECT_EQ(Metric(m, "relgen_generation_tokens_total"), 30);  // 5 samples of 6
  EXPECT_EQ(Metric(m, "relgen_prompt_tokens_total"), 4 + 4 + 3) << "a call's prompt counts once";
  EXPECT_EQ(Metric(m, "relgen_requests_received_total"), 4);
  EXPECT_EQ(Metric(m, "relgen_requests_rejected_total"), 1);
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"INVALID_ARGUMENT\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
}

// Two requests with the same 80-token prompt: the second finds the first's full blocks. The flag
// turns the cache off in both spellings, and the outputs are the same either way.
TEST(ServerPrefixCacheTest, HitsAreCountedAndTheFlagTurnsItOff) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 80; ++i) prompt.push_back((i * 7 + 3) % 250);
  v1::GenerateRequest req = TokenRequest(prompt, 8);
  req.set_temperature(0);
  std::vector<int32_t> first_tokens;
  for (const char* flag : {"", "--noenable_prefix_caching", "--enable_prefix_caching=false"}) {
    std::vector<std::string> args = {"--model", ModelDir("server"), "--kv_cache_tokens", "8192"};
    if (*flag != '\0') args.push_back(flag);
    auto server = StartServer(args);
    auto stub = Stub(*server);
    const v1::GenerateResponse a = MustGenerate(*stub, req);
    const v1::GenerateResponse b = MustGenerate(*stub, req);
    EXPECT_EQ(Ids(a.token_ids()), Ids(b.token_ids())) << flag;
    if (first_tokens.empty()) first_tokens = Ids(a.token_ids());
    EXPECT_EQ(Ids(a.token_ids()), first_tokens) << flag;
    const auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
      return Metric(m, "relgen_requests_total{finish_reason=\"length\"}") == 2 &&
             Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
    });
    const double queries = Metric(m, "relgen_prefix_cache_queries_total");
    const double hits = Metric(m, "relgen_prefix_cache_hits_total");
    const double used = Metric(m, "relgen_kv_cache_blocks{state=\"used\"}");
    const double cached = Metric(m, "relgen_kv_cache_blocks{state=\"cached\"}");
    const double free = Metric(m, "relgen_kv_cache_blocks{state=\"free\"}");
    EXPECT_EQ(used + cached + free, 8192 / 16) << flag;
    if (*flag == '\0') {
      EXPECT_EQ(queries, 160) << "two admissions of 80 prompt tokens";
      // The second request takes the whole blocks before its last prompt token, whose logits it
      // needs: (80 - 1) / 16 = 4 blocks of 16.
      EXPECT_EQ(hits, 64) << "only the second request hits, 4 whole blocks";
      EXPECT_GT(cached, 0) << "the prompt's blocks stay cached after the requests";
    } else {
      EXPECT_EQ(queries, 0) << flag;
      EXPECT_EQ(hits, 0) << flag;
      EXPECT_EQ(cached, 0) << flag;
    }
  }
}

// Requests in flight when SIGTERM comes: the engine is held (test hook) so they are still there
// when the server starts draining, whatever the machine's speed.
class ServerDrainTest : public ::testing::Test {
 protected:
  // Starts a server with `grace`, holds its engine, sends `n` requests and waits until the
  // engine's queue has them all; then SIGTERM, and waits until health says NOT_SERVING.
  void StartDraining(const std::string& grace, int n) {
    server_ = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "32768", "--drain_grace_seconds",
                           grace, "--enable_test_hooks"});
    stub_ = Stub(*server_);
    ASSERT_TRUE(testing::PauseEngine(server_->metrics_port()));
    for (int i = 0; i < n; ++i) {
      calls_.push_back(std::async(std::launch::async, [this, i] { return Stream(*stub_, TokenRequest({1, 2, 3, i}, 20)); }));
    }
    WaitForMetrics(server_->metrics_port(),
                   [n](const auto& m) { return Metric(m, "relgen_num_requests_waiting") == n; });
    server_->Signal(SIGTERM);
    std::string health;
    for (int i = 0; i < 6000 && health != std::string("\x08\x02", 2); ++i) {
      health = GenericUnary(server_->address(), "/grpc.health.v1.Health/Check", "");
      if (health != std::string("\x08\x02", 2)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // Draining: health says NOT_SERVING (2), readiness 503, and new work is refused.
    EXPECT_EQ(health, std::string("\x08\x02", 2));
    EXPECT_THAT(testing::HttpGet(server_->metrics_port(), "/readyz"), HasSubstr("503 Service Unavailable"));
    EXPECT_THAT(testing::HttpGet(server_->metrics_port(), "/healthz"), HasSubstr("200 OK"));
    EXPECT_EQ(Stream(*stub_, TokenRequest({1}, 5)).status.error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  std::unique_ptr<testing::ServerProcess> server_;
  std::unique_ptr<v1::GenerationService::Stub> stub_;
  std::vector<std::future<Collected>> calls_;
};

TEST_F(ServerDrainTest, RequestsInFlightFinishWithinTheGracePeriod) {
  StartDraining("3600", 4);
  ASSERT_TRUE(testing::ResumeEngine(server_->metrics_port()));
  for (auto& f : calls_) {
    const Collected c = f.get();
    EXPECT_TRUE(c.status.ok()) << c.status.error_message();
    EXPECT_EQ(c.tokens.size(), 20u);
  }
  std::string output;
  EXPECT_EQ(server_->Wait(&output), 0) << output;
  EXPECT_THAT(output, HasSubstr("draining (4 in flight"));
  EXPECT_THAT(output, HasSubstr("stopped (0 requests cut at the grace period"));
}

TEST_F(ServerDrainTest, RequestsLeftAtTheGracePeriodEndUnavailable) {
  StartDraining("1", 4);  // the engine stays held: nothing can finish
  for (auto& f : calls_) {
    const Collected c = f.get();
    EXPECT_EQ(c.status.error_code(), grpc::StatusCode::UNAVAILABLE) << c.status.error_message();
    EXPECT_TRUE(c.tokens.empty());
  }
  std::string output;
  EXPECT_EQ(server_->Wait(&output), 0) << output;
  EXPECT_THAT(output, HasSubstr("stopped (4 requests cut at the grace period"));
}

// A second server on a port another one listens on is refused; before, gRPC's SO_REUSEPORT let it
// start and take a share of the first one's new connections.
TEST(ServerPortTest, ASecondServerOnATakenPortIsRefused) {
  auto first = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192"});
  const std::string taken = first->address();
  testing::ServerProcess second;
  std::string error;
  const bool started = second.Start({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--listen", taken}, &error);
  EXPECT_FALSE(started) << "a second server started on " << taken;
  if (!started) {
    std::string output;
    EXPECT_NE(second.Wait(&output), 0);
    EXPECT_THAT(output, HasSubstr("cannot listen on " + taken));
    EXPECT_THAT(output, HasSubstr("already in use by another process"));
  }
  // Every new connection reaches the first server: 24 requests on 24 connections, all in its books.
  for (int i = 0; i < 24; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("relgen.test.connection", i);  // distinct arguments: a connection of its own
    auto stub = v1::GenerationService::NewStub(grpc::CreateCustomChannel(taken, grpc::InsecureChannelCredentials(), args));
    EXPECT_TRUE(Stream(*stub, TokenRequest({1, 2, 3}, 2)).status.ok());
  }
  const auto m = WaitForMetrics(first->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_received_total") >= 24;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_received_total"), 24);
}

// Port sharing stays possible when every server asks for it.
TEST(ServerPortTest, ReusePortSharesDeliberately) {
  auto first = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--reuse_port"});
  auto second = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--reuse_port", "--listen",
                             first->address()});
  EXPECT_EQ(second->address(), first->address());
}

TEST(ServerTlsTest, ServesOverTls) {
  const std::string dir = testing::TempDir("tls");
  ASSERT_EQ(std::system(("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=localhost "
                         "-addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout '" + dir + "/key.pem' -out '" +
                         dir + "/cert.pem' 2>/dev/null").c_str()),
            0);
  auto server = StartServer({"--model", ModelDir("none"), "--kv_cache_tokens", "4096", "--tls_cert", dir + "/cert.pem",
                             "--tls_key", dir + "/key.pem"});
  EXPECT_THAT(server->startup_output(), HasSubstr("(TLS)"));
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = testing::ReadFile(dir + "/cert.pem");
  auto tls = v1::GenerationService::NewStub(grpc::CreateChannel(server->address(), grpc::SslCredentials(ssl)));
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  ASSERT_TRUE(tls->Generate(&ctx, TokenRequest({1, 2}, 3), &resp).ok());
  EXPECT_EQ(resp.token_ids_size(), 3);
  // A plaintext client cannot talk to it.
  grpc::ClientContext plain_ctx;
  plain_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  EXPECT_FALSE(Stub(*server)->Generate(&plain_ctx, TokenRequest({1, 2}, 3), &resp).ok());
}

// Threads a library started before main (the BLAS pool) do not block SIGTERM, and the kernel may hand
// the process's SIGTERM to any of them: that must drain the server like one main takes, not kill it.
TEST(ServerLifecycleTest, SigtermToAnyThreadDrains) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "4096"});
  const pid_t pid = server->pid();
  pid_t target = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    const pid_t tid = std::stoi(task.path().filename().string());
    if (tid == pid) continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigBlk:", 0) != 0) continue;
      const unsigned long long blocked = std::strtoull(line.c_str() + 7, nullptr, 16);
      if ((blocked & (1ull << (SIGTERM - 1))) == 0) target = tid;
    }
  }
  if (target == 0) GTEST_SKIP() << "every thread but main blocks SIGTERM here: no other thread can receive it";
  ASSERT_EQ(syscall(SYS_tgkill, pid, target, SIGTERM), 0);
  std::string output;
  EXPECT_EQ(server->Wait(&output), 0) << output;
  EXPECT_THAT(output, HasSubstr("SIGTERM: draining"));
  EXPECT_THAT(output, HasSubstr("relgen-server: stopped"));
}

TEST(ServerLifecycleTest, BadModelExitsNonZeroWithTheLoadersMessage) {
  const std::string dir = testing::TempDir("badmodel");
  std::system(("cp -r '" + ModelDir("none") + "/.' '" + dir + "'").c_str());
  std::string cfg = testing::ReadFile(dir + "/config.json");
  cfg.replace(cfg.find("\"none\""), 6, "\"rope\"");
  testing::WriteFile(dir + "/config.json", cfg);
  testing::ServerProcess p;
  std::string error;
  EXPECT_FALSE(p.Start({"--model", dir}, &error));
  std::string output;
  EXPECT_EQ(p.Wait(&output), 1);
  EXPECT_THAT(error, HasSubstr("cannot load model"));
  EXPECT_THAT(error, HasSubstr("'relative_attention.scheme' is \"rope\""));
}

}  // namespace
}  // namespace relgen
