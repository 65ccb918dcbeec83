// Every rule about a request's fields, through both APIs of one relgen-server: the same bad field
// sent as a gRPC GenerateRequest and as an OpenAI /v1/completions body is refused with the same
// message, INVALID_ARGUMENT on gRPC and 400 with `param` naming the field on HTTP. The expected
// messages are written here from the rules (engine/core/request_checks.h, server/validation.h)
// and the served model (the "skew" golden: 259 ids, a context of 512 tokens) and flags.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <functional>
#include <future>
#include <string>

#include "nlohmann/json.hpp"
#include "relgen/v1/generation.grpc.pb.h"
#include "tests/grpc_test_util.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using json = nlohmann::json;

// What every refusal of a beam search's conflicting field says after the field.
const std::string kNotWithBeams2 =
    "not with num_beams > 1 (2); beam search returns num_return_sequences sequences, ends a beam at the "
    "end-of-sequence token or max_new_tokens, and applies the controls that ban or bias tokens";

struct BadField {
  const char* name;
  std::function<void(v1::GenerateRequest&)> grpc;  // on {1, 2, 3}, max_new_tokens 10
  json http;           // fields over {"prompt": [1, 2, 3], "max_tokens": 10}; null: not on HTTP
  std::string message;
  std::string param;  // HTTP's name for the field
};

std::vector<int32_t> Fives(int n) { return std::vector<int32_t>(n, 5); }

void SetIds(v1::GenerateRequest& r, const std::vector<int32_t>& ids) {
  r.mutable_token_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
}

std::vector<BadField> Cases() {
  std::vector<BadField> c = {
      {"empty text", [](auto& r) { r.set_text(""); }, {{"prompt", ""}},
       "text: the prompt is empty; give text or token_ids", "prompt"},
      {"text over --max_prompt_bytes", [](auto& r) { r.set_text(std::string(1001, 'a')); },
       {{"prompt", std::string(1001, 'a')}}, "text: 1001 bytes; allowed at most 1000 (--max_prompt_bytes)", "prompt"},
      {"id past the vocabulary", [](auto& r) { r.mutable_token_ids()->add_ids(259); }, {{"prompt", {1, 2, 3, 259}}},
       "prompt: ids[3] = 259; allowed 0..258", "prompt"},
      {"negative id", [](auto& r) { r.mutable_token_ids()->set_ids(0, -1); }, {{"prompt", {-1, 2, 3}}},
       "prompt: ids[0] = -1; allowed 0..258", "prompt"},
      {"prompt fills the context", [](auto& r) { SetIds(r, Fives(512)); },
       {{"prompt", Fives(512)}},
       "prompt: the prompt is 512 tokens; the model's context is 512 tokens, so at most 511 prompt tokens", "prompt"},
      {"truncate_prompt_tokens < 0", [](auto& r) { r.set_truncate_prompt_tokens(-1); },
       {{"truncate_prompt_tokens", -1}}, "truncate_prompt_tokens: -1; allowed 0..512 (0 = off)",
       "truncate_prompt_tokens"},
      {"truncate_prompt_tokens > context", [](auto& r) { r.set_truncate_prompt_tokens(513); },
       {{"truncate_prompt_tokens", 513}}, "truncate_prompt_tokens: 513; allowed 0..512 (0 = off)",
       "truncate_prompt_tokens"},
      {"max_new_tokens < 0", [](auto& r) { r.set_max_new_tokens(-1); }, {{"max_tokens", -1}},
       "max_new_tokens: -1; allowed 0..300", "max_tokens"},
      {"max_new_tokens over --max_new_tokens", [](auto& r) { r.set_max_new_tokens(301); }, {{"max_tokens", 301}},
       "max_new_tokens: 301; allowed 0..300", "max_tokens"},
      {"max_new_tokens past the context", [](auto& r) {
         SetIds(r, Fives(300));
         r.set_max_new_tokens(250);
       }, {{"prompt", Fives(300)}, {"max_tokens", 250}},
       "max_new_tokens: 250 after a prompt of 300 tokens exceeds the model's context of 512 tokens; allowed 0..212",
       "max_tokens"},
      {"temperature < 0", [](auto& r) { r.set_temperature(-0.5f); }, {{"temperature", -0.5}},
       "temperature: -0.5; allowed 0..100 (0 = greedy)", "temperature"},
      {"temperature > 100", [](auto& r) { r.set_temperature(101); }, {{"temperature", 101}},
       "temperature: 101; allowed 0..100 (0 = greedy)", "temperature"},
      {"top_k < 0", [](auto& r) { r.set_top_k(-2); }, {{"top_k", -2}}, "top_k: -2; allowed 0..259 (0 = off)", "top_k"},
      {"top_k > vocabulary", [](auto& r) { r.set_top_k(260); }, {{"top_k", 260}},
       "top_k: 260; allowed 0..259 (0 = off)", "top_k"},
      {"top_p 0", [](auto& r) { r.set_top_p(0); }, {{"top_p", 0}}, "top_p: 0; allowed (0, 1]", "top_p"},
      {"top_p > 1", [](auto& r) { r.set_top_p(1.5f); }, {{"top_p", 1.5}}, "top_p: 1.5; allowed (0, 1]", "top_p"},
      {"repetition_penalty 0", [](auto& r) { r.set_repetition_penalty(0); }, {{"repetition_penalty", 0}},
       "repetition_penalty: 0; allowed (0, 10] (1 = off)", "repetition_penalty"},
      {"repetition_penalty > 10", [](auto& r) { r.set_repetition_penalty(11); }, {{"repetition_penalty", 11}},
       "repetition_penalty: 11; allowed (0, 10] (1 = off)", "repetition_penalty"},
      {"logprobs > 20", [](auto& r) { r.set_logprobs(21); }, {{"logprobs", 21}}, "logprobs: 21; allowed 0..20",
       "logprobs"},
      {"logprobs < 0", [](auto& r) { r.set_logprobs(-1); }, {{"logprobs", -1}}, "logprobs: -1; allowed 0..20",
       "logprobs"},
      {"too many stop strings", [](auto& r) { for (int i = 0; i < 17; ++i) r.add_stop("x"); },
       {{"stop", std::vector<std::string>(17, "x")}}, "stop: 17 strings; allowed at most 16", "stop"},
      {"empty stop string", [](auto& r) { r.add_stop(""); }, {{"stop", ""}}, "stop: stop[0] is 0 bytes; allowed 1..256",
       "stop"},
      {"long stop string", [](auto& r) { r.add_stop(std::string(257, 's')); }, {{"stop", std::string(257, 's')}},
       "stop: stop[0] is 257 bytes; allowed 1..256", "stop"},
      {"too many stop ids", [](auto& r) { for (int i = 0; i < 65; ++i) r.add_stop_token_ids(i); },
       {{"stop_token_ids", [] { std::vector<int> v; for (int i = 0; i < 65; ++i) v.push_back(i); return v; }()}},
       "stop_token_ids: 65 ids; allowed at most 64", "stop_token_ids"},
      {"stop id past the vocabulary", [](auto& r) { r.add_stop_token_ids(400); }, {{"stop_token_ids", {400}}},
       "stop_token_ids: stop_token_ids[0] = 400; allowed 0..258", "stop_token_ids"},
      {"n 0", [](auto& r) { r.set_n(0); }, {{"n", 0}}, "n: 0 samples; allowed 1..16", "n"},
      {"n 17", [](auto& r) { r.set_n(17); }, {{"n", 17}}, "n: 17 samples; allowed 1..16", "n"},
      {"num_beams 0", [](auto& r) { r.set_num_beams(0); }, {{"num_beams", 0}}, "num_beams: 0; allowed 1..16",
       "num_beams"},
      {"num_beams 17", [](auto& r) { r.set_num_beams(17); }, {{"num_beams", 17}}, "num_beams: 17; allowed 1..16",
       "num_beams"},
      // HTTP's n is the number of sequences a beam search returns.
      {"num_return_sequences > num_beams", [](auto& r) {
         r.set_num_beams(4);
         r.set_num_return_sequences(5);
       }, {{"num_beams", 4}, {"n", 5}}, "num_return_sequences: 5; allowed 1..num_beams (4)", "n"},
      {"length_penalty > 100", [](auto& r) { r.set_length_penalty(101); }, {{"length_penalty", 101}},
       "length_penalty: 101; allowed -100..100", "length_penalty"},
      {"stop with beams", [](auto& r) {
         r.set_num_beams(2);
         r.add_stop("x");
       }, {{"num_beams", 2}, {"stop", "x"}}, "stop: " + kNotWithBeams2, "stop"},
      {"the prompt alone with beams", [](auto& r) {
         r.set_num_beams(2);
         r.set_max_new_tokens(0);
       }, {{"num_beams", 2}, {"max_tokens", 0}}, "max_new_tokens: " + kNotWithBeams2, "max_tokens"},
      {"logprobs with beams", [](auto& r) {
         r.set_num_beams(2);
         r.set_logprobs(1);
       }, {{"num_beams", 2}, {"logprobs", 1}}, "logprobs: " + kNotWithBeams2, "logprobs"},
      {"presence_penalty with beams", [](auto& r) {
         r.set_num_beams(2);
         r.set_presence_penalty(1);
       }, {{"num_beams", 2}, {"presence_penalty", 1}}, "presence_penalty: " + kNotWithBeams2, "presence_penalty"},
      {"presence_penalty > 2", [](auto& r) { r.set_presence_penalty(2.5f); }, {{"presence_penalty", 2.5}},
       "presence_penalty: 2.5; allowed -2..2 (0 = off)", "presence_penalty"},
      {"frequency_penalty < -2", [](auto& r) { r.set_frequency_penalty(-2.5f); }, {{"frequency_penalty", -2.5}},
       "frequency_penalty: -2.5; allowed -2..2 (0 = off)", "frequency_penalty"},
      {"min_p > 1", [](auto& r) { r.set_min_p(1.5f); }, {{"min_p", 1.5}}, "min_p: 1.5; allowed 0..1 (0 = off)",
       "min_p"},
      {"min_tokens > max_new_tokens", [](auto& r) { r.set_min_tokens(11); }, {{"min_tokens", 11}},
       "min_tokens: 11; allowed 0..max_new_tokens (10)", "min_tokens"},
      {"min_tokens < 0", [](auto& r) { r.set_min_tokens(-1); }, {{"min_tokens", -1}},
       "min_tokens: -1; allowed 0..max_new_tokens (10)", "min_tokens"},
      {"logit_bias id past the vocabulary", [](auto& r) { (*r.mutable_logit_bias())[300] = 1; },
       {{"logit_bias", {{"300", 1}}}}, "logit_bias: token id 300; allowed 0..258", "logit_bias"},
      {"logit_bias over 100", [](auto& r) { (*r.mutable_logit_bias())[5] = 101; }, {{"logit_bias", {{"5", 101}}}},
       "logit_bias: the bias of token 5 is 101; allowed -100..100", "logit_bias"},
      {"allowed_token_ids negative", [](auto& r) { r.add_allowed_token_ids(-1); }, {{"allowed_token_ids", {-1}}},
       "allowed_token_ids: allowed_token_ids[0] = -1; allowed 0..258", "allowed_token_ids"},
      {"empty bad word", [](auto& r) { r.add_bad_words(); }, {{"bad_words", json::array({json::array()})}},
       "bad_words: bad_words[0] is empty; each word needs 1 or more ids", "bad_words"},
      {"bad word past the vocabulary", [](auto& r) { 
         auto* w = r.add_bad_words();
         w->add_ids(1);
         w->add_ids(300);
       },
       {{"bad_words", {{1, 300}}}}, "bad_words: bad_words[0] holds 300; allowed 0..258", "bad_words"},
      {"too many bad words", [](auto& r) { for (int i = 0; i < 129; ++i) r.add_bad_words()->add_ids(7); },
       {{"bad_words", std::vector<std::vector<int>>(129, {7})}}, "bad_words: 129 words; allowed at most 128",
       "bad_words"},
      {"no_repeat_ngram_size > 64", [](auto& r) { r.set_no_repeat_ngram_size(65); }, {{"no_repeat_ngram_size", 65}},
       "no_repeat_ngram_size: 65; allowed 0..64 (0 = off)", "no_repeat_ngram_size"},
      // gRPC's own fields.
      {"request_id too long", [](auto& r) { r.set_request_id(std::string(129, 'r')); }, nullptr,
       "request_id: 129 bytes; allowed at most 128", ""},
      {"prompt_logprobs > 20", [](auto& r) { r.set_prompt_logprobs(21); }, nullptr, "prompt_logprobs: 21; allowed 0..20",
       ""},
      {"early_stopping unknown", [](auto& r) { r.set_early_stopping(static_cast<v1::EarlyStopping>(7)); }, nullptr,
       "early_stopping: 7; allowed FALSE, TRUE, NEVER", ""},
  };
  return c;
}

class RequestChecksTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = StartServer({"--model", ModelDir("skew"), "--kv_cache_tokens", "8192", "--max_new_tokens", "300",
                           "--max_prompt_bytes", "1000"})
                  .release();
  }
  static void TearDownTestSuite() { delete server_; }
  static testing::ServerProcess* server_;
};
testing::ServerProcess* RequestChecksTest::server_ = nullptr;

// The HTTP answer's status code and JSON body.
std::pair<int, json> PostCompletion(int port, const json& body) {
  const std::string raw = testing::HttpRequest(port, "POST", "/v1/completions", body.dump());
  const size_t space = raw.find(' '), split = raw.find("\r\n\r\n");
  if (space == std::string::npos || split == std::string::npos) return {0, json()};
  return {std::stoi(raw.substr(space + 1, 3)), json::parse(raw.substr(split + 4), nullptr, false)};
}

std::string ModelName(const testing::ServerProcess& server) {
  const std::string raw = testing::HttpGet(server.http_port(), "/v1/models");
  return json::parse(raw.substr(raw.find("\r\n\r\n") + 4))["data"][0]["id"];
}

TEST_F(RequestChecksTest, EachBadFieldIsRefusedAlikeByBothApis) {
  auto stub = Stub(*server_);
  const std::string model = ModelName(*server_);
  const std::vector<BadField> cases = Cases();
  EXPECT_GE(cases.size(), 40u);
  for (const BadField& c : cases) {
    SCOPED_TRACE(c.name);
    v1::GenerateRequest req = TokenRequest({1, 2, 3}, 10);
    c.grpc(req);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    const grpc::Status unary = stub->Generate(&ctx, req, &resp);
    EXPECT_EQ(unary.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(unary.error_message(), c.message);
    const grpc::Status streamed = Stream(*stub, req).status;
    EXPECT_EQ(streamed.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(streamed.error_message(), c.message);
    if (c.http.is_null()) continue;
    json body = {{"model", model}, {"prompt", {1, 2, 3}}, {"max_tokens", 10}, {"ignore_eos", true}};
    body.update(c.http);
    const auto [status, answer] = PostCompletion(server_->http_port(), body);
    EXPECT_EQ(status, 400) << answer.dump();
    ASSERT_TRUE(answer.contains("error")) << answer.dump();
    EXPECT_EQ(answer["error"]["message"], c.message);
    EXPECT_EQ(answer["error"]["param"], c.param);
    EXPECT_EQ(answer["error"]["type"], "invalid_request_error");
  }
  // Still serving, both ways.
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_TRUE(stub->Generate(&ctx, TokenRequest({1, 2, 3}, 5), &resp).ok());
  const auto [status, answer] =
      PostCompletion(server_->http_port(), {{"model", model}, {"prompt", {1, 2, 3}}, {"max_tokens", 5}});
  EXPECT_EQ(status, 200) << answer.dump();
}

// An HTTP call past its deadline (--http_request_timeout_seconds) ends in the engine as a gRPC call
// past its own does: its request is cancelled at the engine's next step, its blocks freed, and the
// call answers 504. The engine is held (the test hook) until the call is queued, so the
// microsecond deadline has passed before any step looks at it.
TEST(HttpDeadlineTest, ACallPastItsDeadlineIsCancelledWithNothingLeft) {
  auto server = StartServer({"--model", ModelDir("skew"), "--kv_cache_tokens", "8192", "--enable_test_hooks",
                             "--http_request_timeout_seconds", "0.000001"});
  const std::string model = ModelName(*server);
  ASSERT_TRUE(testing::PauseEngine(server->metrics_port()));
  const json body = {{"model", model}, {"prompt", {1, 2, 3}}, {"max_tokens", 50}, {"ignore_eos", true}};
  auto answer = std::async(std::launch::async, [&] { return PostCompletion(server->http_port(), body); });
  WaitForMetrics(server->metrics_port(), [](const auto& m) { return Metric(m, "relgen_num_requests_waiting") == 1; });
  ASSERT_TRUE(testing::ResumeEngine(server->metrics_port()));
  const auto [status, error] = answer.get();
  EXPECT_EQ(status, 504) << error.dump();
  EXPECT_EQ(error["error"]["message"], "deadline passed");
  EXPECT_EQ(error["error"]["type"], "server_error");
  const auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_num_requests_running") == 0 && Metric(m, "relgen_num_requests_waiting") == 0 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_num_requests_running"), 0);
  EXPECT_EQ(Metric(m, "relgen_num_requests_waiting"), 0);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  // The call is no longer in flight: the server drains with nothing left.
  server->Signal(SIGTERM);
  std::string output;
  EXPECT_EQ(server->Wait(&output), 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("draining (0 in flight"));
}

}  // namespace
}  // namespace relgen
