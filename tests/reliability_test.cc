// Faults and security against a real server on loopback: KV exhaustion under load, malformed and
// oversized messages, a client that never reads, corrupt model files at start, bearer-token auth,
// mutual TLS, the admin listener's health endpoints, per-connection stream limits, requests that
// look like paths, and the HTTP API's faults (clients that leave or never read, oversized and
// malformed bodies, floods of connections).
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <set>
#include <thread>

#include "nlohmann/json.hpp"
#include "server/auth.h"
#include "tests/grpc_test_util.h"
#include "tests/server_process.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<grpc::Channel> Plain(const testing::ServerProcess& p) {
  return grpc::CreateChannel(p.address(), grpc::InsecureChannelCredentials());
}

// ------------------------------------------------------------------ KV exhaustion

TEST(FaultTest, KvExhaustionPreemptsAndKeepsEveryOutput) {
  // 32 blocks of 16 tokens for 12 sequences that each grow to 5-7 blocks: the cache runs out
  // mid-generation, and the newest sequences are preempted and recomputed. The engine is held until
  // all 12 have arrived, so they meet however fast it runs.
  auto tight = StartServer({"--model", ModelDir("skew"), "--kv_cache_tokens", "512", "--max_num_seqs", "12",
                            "--enable_test_hooks"});
  auto roomy = StartServer({"--model", ModelDir("skew"), "--kv_cache_tokens", "8192", "--max_num_seqs", "1"});
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> prompt(10 + 3 * i);
    for (size_t k = 0; k < prompt.size(); ++k) prompt[k] = static_cast<int32_t>((37 * i + 11 * k) % 256);
    v1::GenerateRequest r = TokenRequest(prompt, 60);
    r.set_temperature(0.9f);
    r.set_seed(100 + i);
    reqs.push_back(r);
  }
  auto tight_stub = Stub(*tight);
  ASSERT_TRUE(testing::PauseEngine(tight->metrics_port()));
  std::vector<std::future<Collected>> calls;
  for (const auto& r : reqs) calls.push_back(std::async(std::launch::async, [&, r] { return Stream(*tight_stub, r); }));
  WaitForMetrics(tight->metrics_port(), [](const auto& m) { return Metric(m, "relgen_num_requests_waiting") == 12; });
  ASSERT_TRUE(testing::ResumeEngine(tight->metrics_port()));
  auto roomy_stub = Stub(*roomy);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Collected under_pressure = calls[i].get();
    const Collected alone = Stream(*roomy_stub, reqs[i]);
    ASSERT_TRUE(under_pressure.status.ok()) << i << ": " << under_pressure.status.error_message();
    ASSERT_TRUE(alone.status.ok());
    EXPECT_EQ(under_pressure.tokens, alone.tokens) << "request " << i;
    EXPECT_EQ(under_pressure.tokens.size(), 60u);
  }
  const auto m = WaitForMetrics(tight->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"length\"}") == 12;
  });
  std::printf("kv exhaustion: 12 requests on 32 blocks, %.0f preemptions, every output identical to the request alone\n",
              Metric(m, "relgen_preemptions_total"));
  EXPECT_GT(Metric(m, "relgen_preemptions_total"), 0) << "the cache should have run out";
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"length\"}"), 12);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  // Finished prompts' full blocks may stay cached (prefix caching): free again on demand.
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"free\"}") + Metric(m, "relgen_kv_cache_blocks{state=\"cached\"}"),
            32);
}

// ------------------------------------------------------------------ malformed and oversized

TEST(FaultTest, MalformedAndOversizedMessagesAreRefusedAndTheServerGoesOn) {
  auto server = StartServer({"--model", ModelDir("none"), "--kv_cache_tokens", "4096", "--max_message_bytes", "65536"});
  auto ch = Plain(*server);
  const std::string method = "/relgen.v1.GenerationService/Generate";
  const std::vector<std::string> malformed = {
      std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11),  // a varint tag over 64 bits
      std::string("\x12\x80\x80\x80\x80\x08", 6),                        // text whose length runs past the end
      std::string("\x1a\x05\x0a\x03\x01", 5),                            // token_ids cut inside its packed ids
      std::string("\x0b", 1),                                            // a group start with no end
  };
  for (const std::string& bytes : malformed) {
    const auto [s, body] = RawUnary(ch, method, bytes);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNAVAILABLE) << "the server must stay up";
  }
  // Well-formed protobuf that is not a valid request: answered INVALID_ARGUMENT naming the field.
  const auto [empty_status, empty_body] = RawUnary(ch, method, "");
  EXPECT_EQ(empty_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(empty_status.error_message(), HasSubstr("prompt"));
  // Over --max_message_bytes: gRPC refuses it before it is parsed.
  v1::GenerateRequest big;
  big.set_text(std::string(100000, 'a'));
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_EQ(v1::GenerationService::NewStub(ch)->Generate(&ctx, big, &resp).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Still serving.
  grpc::ClientContext ok_ctx;
  ASSERT_TRUE(v1::GenerationService::NewStub(ch)->Generate(&ok_ctx, TokenRequest({1, 2, 3}, 4), &resp).ok());
  EXPECT_EQ(resp.token_ids_size(), 4);
}

// ------------------------------------------------------------------ a client that never reads

// Makes the stream write timeout strike while the stalled request is still in the engine, whatever
// the machine's speed: on a slow machine it strikes while the request generates; on a fast one the
// engine is held (test hooks) once `tokens` are out (far more than the transport buffers past the
// window, so a write is pending) and released once the timeout is booked.
void HoldAfterTokens(testing::ServerProcess& server, double tokens, double total) {
  std::map<std::string, double> m;
  const auto timeouts = [&] { return Metric(m, "relgen_stream_write_timeouts_total"); };
  const auto generated = [&] { return Metric(m, "relgen_generation_tokens_total"); };
  for (int i = 0; i < 120000; ++i) {
    m = testing::ParseMetrics(testing::Scrape(server.metrics_port()));
    if (timeouts() >= 1 || generated() >= tokens) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (timeouts() >= 1) return;
  ASSERT_TRUE(testing::PauseEngine(server.metrics_port()));
  m = testing::ParseMetrics(testing::Scrape(server.metrics_port()));
  ASSERT_LT(generated(), total) << "the request ran to its end before the engine could be held";
  WaitForMetrics(server.metrics_port(), [](const auto& m) { return Metric(m, "relgen_stream_write_timeouts_total") == 1; });
  ASSERT_TRUE(testing::ResumeEngine(server.metrics_port()));
}

TEST(FaultTest, AStreamThatIsNeverReadIsCancelledAfterTheWriteTimeout) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192",
                             "--stream_write_timeout_seconds", "1", "--enable_test_hooks"});
  // A connection whose receive window is tiny, so the server's writes stall once it is full.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto stalled_channel = grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args);
  auto stalled_stub = v1::GenerationService::NewStub(stalled_channel);
  grpc::ClientContext stalled_ctx;
  // 20 alternatives a token: some 200 bytes of message a token.
  v1::GenerateRequest stalled_request = TokenRequest({9, 8, 7}, 2040);
  stalled_request.set_logprobs(20);
  auto reader = stalled_stub->GenerateStream(&stalled_ctx, stalled_request);
  const auto t0 = std::chrono::steady_clock::now();
  // Held once 1,200 tokens (some 240 KB, past the 1 KB window and what gRPC buffers beyond it) are
  // out: a write is pending, and the request is still in the engine when the timeout strikes,
  // however fast the machine generates.
  HoldAfterTokens(*server, 1200, 2040);

  // Meanwhile the server serves others.
  const Collected other = Stream(*Stub(*server), TokenRequest({1, 2}, 10));
  EXPECT_TRUE(other.status.ok());

  // The cancelled call is booked as an error too, though its final output was never written: the
  // write in progress broke (OnWriteDone(false)) before the engine's cancelled output could be.
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_stream_write_timeouts_total") == 1 &&
           Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") == 1 &&
           Metric(m, "relgen_request_errors_total{code=\"CANCELLED\"}") == 1 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(Metric(m, "relgen_stream_write_timeouts_total"), 1);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"CANCELLED\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(Metric(m, "relgen_num_requests_running"), 0);
  // Generation for it stopped: it left the engine (no block held, nothing running) before its end.
  const double tokens = Metric(m, "relgen_generation_tokens_total");
  EXPECT_LT(tokens, 2040 + 10) << "the stalled request must not run to its end";

  // The client, reading at last, gets what was sent before the stall and then CANCELLED.
  v1::GenerateStreamResponse msg;
  int received = 0;
  while (reader->Read(&msg)) received += msg.token_ids_size();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(received, 2040);
  std::printf("never-read stream: cancelled %.1f s after it started (timeout 1 s), %.0f of 2040 tokens generated, %d delivered\n",
              waited, tokens, received);
  // The watchdog is still alive: the server drains and exits promptly.
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

// Clients that cancel streams whose writes are stalled (never read): each call is booked once as
// CANCELLED, the one whose generation had already ended too (its final output never written: the
// write that broke found its request closed), and every block comes back.
TEST(FaultTest, CancelledStalledStreamsAreEachBookedOnce) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "16384", "--max_num_seqs", "16",
                             "--enable_test_hooks"});
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  // Stream 0 ends after 300 tokens, the others run to 1500: admitted together (the engine held
  // until all have arrived), one token a step each, stream 0 is the only one finished when 400
  // steps have run.
  constexpr int kStreams = 9;
  ASSERT_TRUE(testing::PauseEngine(server->metrics_port()));
  struct Stalled {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::GenerationService::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::GenerateStreamResponse>> reader;
  };
  std::vector<std::unique_ptr<Stalled>> streams;
  for (int i = 0; i < kStreams; ++i) {
    auto s = std::make_unique<Stalled>();
    s->channel = grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args);
    s->stub = v1::GenerationService::NewStub(s->channel);
    s->reader = s->stub->GenerateStream(&s->ctx, TokenRequest({9, 8, static_cast<int32_t>(i)}, i == 0 ? 300 : 1500));
    streams.push_back(std::move(s));
  }
  WaitForMetrics(server->metrics_port(), [](const auto& m) { return Metric(m, "relgen_num_requests_waiting") == kStreams; });
  ASSERT_TRUE(testing::ResumeEngine(server->metrics_port()));
  // Every stream's writes stall once its 1 KB window is full, long before 300 tokens.
  WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"length\"}") == 1 &&
           Metric(m, "relgen_generation_tokens_total") >= 300 + (kStreams - 1) * 400;
  });
  for (auto& s : streams) s->ctx.TryCancel();
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_request_errors_total{code=\"CANCELLED\"}") >= kStreams &&
           Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") == kStreams - 1 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"CANCELLED\"}"), kStreams);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), kStreams - 1);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"length\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  for (auto& s : streams) {
    v1::GenerateStreamResponse msg;
    while (s->reader->Read(&msg)) {
    }
    EXPECT_EQ(s->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

// ------------------------------------------------------------------ the HTTP API's faults

// A raw HTTP/1.1 connection to the server's OpenAI-compatible API.
class RawHttp {
 public:
  // `receive_buffer` > 0: a small window, so the server's writes wait once it is full.
  explicit RawHttp(int port, int receive_buffer = 0) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawHttp() { Close(); }
  bool Send(const std::string& bytes) {
    return connected_ && write(fd_, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
  }
  // Reads until `needle` has arrived `count` times, or the connection ends.
  std::string ReadUntil(const std::string& needle, int count) {
    while (Count(needle) < count) {
      char buf[4096];
      const ssize_t n = read(fd_, buf, sizeof(buf));
      if (n <= 0) break;
      got_.append(buf, n);
    }
    return got_;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int Count(const std::string& needle) const {
    int n = 0;
    for (size_t at = got_.find(needle); at != std::string::npos; at = got_.find(needle, at + 1)) ++n;
    return n;
  }
  int fd_ = -1;
  bool connected_ = false;
  std::string got_;
};

std::string PostCompletion(const std::string& body) {
  return "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

// The served model's name, from GET /v1/models.
std::string ServedModel(int http_port) {
  const std::string r = testing::HttpGet(http_port, "/v1/models");
  const size_t body = r.find("\r\n\r\n");
  if (body == std::string::npos) return "";
  return nlohmann::json::parse(r.substr(body + 4))["data"][0]["id"].get<std::string>();
}

std::string CompletionJson(const std::string& model, const std::string& fields) {
  return R"({"model": ")" + model + R"(", )" + fields + "}";
}

TEST(HttpFaultTest, AClientThatLeavesMidStreamCancelsItsRequest) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192"});
  const std::string model = ServedModel(server->http_port());
  ASSERT_FALSE(model.empty());
  RawHttp client(server->http_port());
  ASSERT_TRUE(client.Send(PostCompletion(
      CompletionJson(model, R"("prompt": [9, 8, 7], "max_tokens": 2000, "ignore_eos": true, "stream": true)"))));
  const std::string head = client.ReadUntil("data: ", 3);
  EXPECT_THAT(head, HasSubstr("200 OK"));
  EXPECT_THAT(head, HasSubstr("text/event-stream"));
  client.Close();
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_request_errors_total{api=\"http\",code=\"CANCELLED\"}") == 1 &&
           Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") == 1 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{api=\"http\",code=\"CANCELLED\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_LT(Metric(m, "relgen_generation_tokens_total"), 2000) << "the request must stop before its end";
  // The server goes on serving.
  const std::string next = testing::HttpRequest(server->http_port(), "POST", "/v1/completions",
                                                CompletionJson(model, R"("prompt": "ab", "max_tokens": 4)"));
  EXPECT_THAT(next, HasSubstr("200 OK"));
  EXPECT_THAT(next, HasSubstr(R"("finish_reason":)"));
  m = testing::ParseMetrics(testing::Scrape(server->metrics_port()));
  EXPECT_EQ(Metric(m, "relgen_requests_received_total{api=\"http\"}"), 2);
  EXPECT_EQ(Metric(m, "relgen_requests_rejected_total{api=\"http\"}"), 0);
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

TEST(HttpFaultTest, AStreamThatIsNeverReadIsCancelledAfterTheWriteTimeout) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "65536", "--max_num_seqs", "16",
                             "--stream_write_timeout_seconds", "1", "--enable_test_hooks"});
  const std::string model = ServedModel(server->http_port());
  ASSERT_FALSE(model.empty());
  // 16 samples of 2000 tokens with 20 alternatives each: megabytes of events, against the server's
  // 256 KiB send buffer and a 4 KiB window. The writes wait long before the samples' end.
  RawHttp stalled(server->http_port(), 4096);
  ASSERT_TRUE(stalled.Send(PostCompletion(CompletionJson(
      model, R"("prompt": [9, 8, 7], "max_tokens": 2000, "n": 16, "logprobs": 20, "ignore_eos": true, "stream": true)"))));
  // Held once 3,200 tokens (megabytes of events, far past the buffers) are out: a write is
  // pending, and the samples are still in the engine when the timeout strikes, however fast the
  // machine generates.
  HoldAfterTokens(*server, 3200, 16 * 2000);
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_stream_write_timeouts_total") == 1 &&
           Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") == 16 &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  EXPECT_EQ(Metric(m, "relgen_stream_write_timeouts_total"), 1);
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{api=\"http\",code=\"CANCELLED\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"), 16);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_LT(Metric(m, "relgen_generation_tokens_total"), 16 * 2000);
  // Meanwhile and after, the server serves others.
  const std::string other = testing::HttpRequest(server->http_port(), "POST", "/v1/completions",
                                                 CompletionJson(model, R"("prompt": [1, 2], "max_tokens": 5)"));
  EXPECT_THAT(other, HasSubstr("200 OK"));
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

TEST(HttpFaultTest, OversizedBodiesAndBadJsonAreRefusedAndBooked) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--max_message_bytes", "4096"});
  const std::string model = ServedModel(server->http_port());
  ASSERT_FALSE(model.empty());
  RawHttp big(server->http_port());
  ASSERT_TRUE(big.Send(PostCompletion(CompletionJson(model, R"("prompt": ")" + std::string(5000, 'x') + "\""))));
  const std::string too_large = big.ReadUntil("}}", 1);
  big.Close();
  EXPECT_THAT(too_large, HasSubstr("413"));
  EXPECT_THAT(too_large, HasSubstr("--max_message_bytes"));
  EXPECT_THAT(too_large, HasSubstr(R"("type":"invalid_request_error")"));
  const std::string bad = testing::HttpRequest(server->http_port(), "POST", "/v1/completions", R"({"model": "x", )");
  EXPECT_THAT(bad, HasSubstr("400 Bad Request"));
  EXPECT_THAT(bad, HasSubstr("not JSON"));
  const std::string good = testing::HttpRequest(server->http_port(), "POST", "/v1/completions",
                                                CompletionJson(model, R"("prompt": "ab", "max_tokens": 3)"));
  EXPECT_THAT(good, HasSubstr("200 OK"));
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"length\"}") == 1;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_received_total{api=\"http\"}"), 3);
  EXPECT_EQ(Metric(m, "relgen_requests_rejected_total{api=\"http\"}"), 2);
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{api=\"http\",code=\"RESOURCE_EXHAUSTED\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{api=\"http\",code=\"INVALID_ARGUMENT\"}"), 1);
  EXPECT_EQ(Metric(m, "relgen_requests_received_total{api=\"grpc\"}"), 0);
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

TEST(HttpFaultTest, AFloodOfConnectionsLeavesTheServerServing) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "16384", "--http_threads", "4"});
  const std::string model = ServedModel(server->http_port());
  ASSERT_FALSE(model.empty());
  // 200 connections that close without a request, beside 48 clients each asking for a completion,
  // against 4 threads: every completion is answered and booked once.
  constexpr int kClients = 48;
  std::vector<std::unique_ptr<RawHttp>> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(std::make_unique<RawHttp>(server->http_port()));
  std::vector<std::future<std::string>> answers;
  for (int i = 0; i < kClients; ++i) {
    answers.push_back(std::async(std::launch::async, [&, i] {
      return testing::HttpRequest(server->http_port(), "POST", "/v1/completions",
                                  CompletionJson(model, R"("prompt": [5, )" + std::to_string(i) +
                                                            R"(], "max_tokens": 6, "ignore_eos": true)"));
    }));
  }
  idle.clear();  // closed
  for (int i = 0; i < kClients; ++i) EXPECT_THAT(answers[i].get(), HasSubstr("200 OK")) << i;
  auto m = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_total{finish_reason=\"length\"}") == kClients;
  });
  EXPECT_EQ(Metric(m, "relgen_requests_received_total{api=\"http\"}"), kClients);
  EXPECT_EQ(Metric(m, "relgen_requests_rejected_total{api=\"http\"}"), 0);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"length\"}"), kClients);
  EXPECT_EQ(Metric(m, "relgen_generation_tokens_total"), kClients * 6);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_THAT(testing::HttpGet(server->http_port(), "/v1/models"), HasSubstr("200 OK"));
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

// ------------------------------------------------------------------ corrupt model files at start

class CorruptModelTest : public ::testing::Test {
 protected:
  // A copy of a golden model to damage.
  std::string Copy(const std::string& name, const std::string& from = "none") {
    const std::string dir = testing::TempDir("corrupt_" + name);
    EXPECT_EQ(std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "' && cp -r '" + ModelDir(from) + "/.' '" + dir + "'").c_str()), 0);
    return dir;
  }
  // Starts the server on `dir`; it must exit 1 without serving, saying `what`.
  void ExpectRefused(const std::string& dir, const std::vector<std::string>& what) {
    testing::ServerProcess p;
    std::string error;
    EXPECT_FALSE(p.Start({"--model", dir, "--kv_cache_tokens", "1024"}, &error)) << "it served a corrupt model";
    std::string output;
    EXPECT_EQ(p.Wait(&output), 1);
    EXPECT_THAT(error, HasSubstr("cannot load model"));
    for (const std::string& w : what) EXPECT_THAT(error, HasSubstr(w));
  }
  static uint64_t DataStart(const std::string& bytes) {
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    return 8 + n;
  }
};

TEST_F(CorruptModelTest, TruncatedWeights) {
  const std::string dir = Copy("truncated");
  const std::string w = testing::ReadFile(dir + "/model.safetensors");
  testing::WriteFile(dir + "/model.safetensors", w.substr(0, w.size() - 100));
  ExpectRefused(dir, {"model.safetensors", "truncated or corrupt file"});
}

TEST_F(CorruptModelTest, GarbledHeader) {
  const std::string dir = Copy("header");
  std::string w = testing::ReadFile(dir + "/model.safetensors");
  for (int i = 8; i < 24; ++i) w[i] = '#';
  testing::WriteFile(dir + "/model.safetensors", w);
  ExpectRefused(dir, {"model.safetensors", "header is not a JSON object"});
}

TEST_F(CorruptModelTest, NonFiniteWeight) {
  const std::string dir = Copy("nan");
  std::string w = testing::ReadFile(dir + "/model.safetensors");
  uint64_t header_len = 0;
  std::memcpy(&header_len, w.data(), 8);
  const auto header = nlohmann::json::parse(w.substr(8, header_len));
  const uint64_t begin = header["embed.weight"]["data_offsets"][0].get<uint64_t>();
  ASSERT_EQ(header["embed.weight"]["dtype"], "F32");
  const float nan = std::nanf("");
  std::memcpy(&w[DataStart(w) + begin + 4 * 5], &nan, 4);  // element 5
  testing::WriteFile(dir + "/model.safetensors", w);
  ExpectRefused(dir, {"tensor 'embed.weight' holds nan at element 5", "must be finite"});
}

TEST_F(CorruptModelTest, WeightsOfAnotherModel) {
  const std::string dir = Copy("swapped");
  ASSERT_EQ(std::system(("cp '" + ModelDir("skew") + "/model.safetensors' '" + dir + "/model.safetensors'").c_str()), 0);
  ExpectRefused(dir, {"model.safetensors", "'layers.0.attn.rel_k'"});
}

TEST_F(CorruptModelTest, ConfigNotJson) {
  const std::string dir = Copy("config");
  std::string cfg = testing::ReadFile(dir + "/config.json");
  testing::WriteFile(dir + "/config.json", cfg.substr(0, cfg.size() / 2));
  ExpectRefused(dir, {"config.json: not valid JSON"});
}

TEST_F(CorruptModelTest, TokenizerFileOutsideTheModelDirectory) {
  const std::string dir = Copy("tokpath");
  std::string cfg = testing::ReadFile(dir + "/config.json");
  const size_t at = cfg.find("\"kind\": \"byte\"");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, 14, "\"kind\": \"sentencepiece\", \"file\": \"../../etc/passwd\"");
  testing::WriteFile(dir + "/config.json", cfg);
  ExpectRefused(dir, {"'tokenizer.file'", "must be a file name in the model directory"});
}

// ------------------------------------------------------------------ bearer token

TEST(SecurityTest, ConstantTimeEqualsIsEquality) {
  using server::ConstantTimeEquals;
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("s3cret-token", "s3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-token", "s3cret-tokeN"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-token", "s3cret-toke"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-toke", "s3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
  EXPECT_FALSE(ConstantTimeEquals("abc", std::string("abc\0", 4)));
}

TEST(SecurityTest, BearerTokenGuardsTheServiceButNotHealth) {
  const std::string dir = testing::TempDir("auth");
  testing::WriteFile(dir + "/token", "correct-horse-battery-staple\n");
  auto server = StartServer({"--model", ModelDir("none"), "--kv_cache_tokens", "4096", "--auth_token_file", dir + "/token"});
  EXPECT_THAT(server->startup_output(), HasSubstr("(bearer token)"));
  auto stub = Stub(*server);
  auto call = [&](const char* authorization) {
    grpc::ClientContext ctx;
    if (authorization != nullptr) ctx.AddMetadata("authorization", authorization);
    v1::GenerateResponse resp;
    return stub->Generate(&ctx, TokenRequest({1, 2}, 3), &resp);
  };
  EXPECT_EQ(call(nullptr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("Bearer wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("Bearer correct-horse-battery-stapl").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("correct-horse-battery-staple").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("Basic correct-horse-battery-staple").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status refused = call("Bearer nope");
  EXPECT_THAT(refused.error_message(), HasSubstr("Bearer <token>"));
  EXPECT_THAT(refused.error_message(), ::testing::Not(HasSubstr("nope"))) << "never echo what was sent";
  EXPECT_TRUE(call("Bearer correct-horse-battery-staple").ok());
  {
    grpc::ClientContext ctx;
    v1::ModelInfo info;
    EXPECT_EQ(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer correct-horse-battery-staple");
    auto reader = stub->GenerateStream(&ctx, TokenRequest({5}, 4));
    v1::GenerateStreamResponse m;
    int n = 0;
    while (reader->Read(&m)) n += m.token_ids_size();
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(n, 4);
  }
  // Probes need no token: gRPC health on the service port, HTTP on the admin listener.
  const auto health = RawUnary(Plain(*server), "/grpc.health.v1.Health/Check", "");
  EXPECT_TRUE(health.first.ok());
  EXPECT_EQ(health.second, std::string("\x08\x01", 2));  // SERVING
  EXPECT_THAT(testing::HttpGet(server->metrics_port(), "/readyz"), HasSubstr("200 OK"));
  const auto m = testing::ParseMetrics(testing::Scrape(server->metrics_port()));
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"UNAUTHENTICATED\"}"), 7);
  EXPECT_EQ(Metric(m, "relgen_requests_rejected_total"), 6) << "the Generate calls (GetModelInfo is no request)";
  EXPECT_EQ(Metric(m, "relgen_requests_received_total"), 8);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"length\"}"), 2);
}

TEST(SecurityTest, ServerRefusesAnEmptyOrUnreadableTokenFile) {
  const std::string dir = testing::TempDir("auth_bad");
  testing::WriteFile(dir + "/empty", " \n");
  for (const std::string& file : {dir + "/empty", dir + "/missing"}) {
    testing::ServerProcess p;
    std::string error;
    EXPECT_FALSE(p.Start({"--model", ModelDir("none"), "--auth_token_file", file}, &error));
    EXPECT_EQ(p.Wait(), 2);
    EXPECT_THAT(error, HasSubstr("--auth_token_file"));
  }
}

// ------------------------------------------------------------------ mutual TLS

TEST(SecurityTest, MutualTlsAdmitsOnlyClientsWithACertificateFromTheCa) {
  const std::string d = testing::TempDir("mtls");
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  testing::WriteFile(d + "/san.ext", "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
  const std::string script =
      "cd '" + d + "' && "
      "openssl req -x509 " + ec + " -days 2 -subj /CN=relgen-test-ca -keyout ca.key -out ca.pem && "
      "openssl req " + ec + " -subj /CN=localhost -keyout server.key -out server.csr && "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext -out server.pem && "
      "openssl req " + ec + " -subj /CN=client -keyout client.key -out client.csr && "
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out client.pem && "
      "openssl req -x509 " + ec + " -days 2 -subj /CN=rogue-ca -keyout rogue.key -out rogue.pem && "
      "openssl req " + ec + " -subj /CN=intruder -keyout intruder.key -out intruder.csr && "
      "openssl x509 -req -in intruder.csr -CA rogue.pem -CAkey rogue.key -CAcreateserial -days 2 -out intruder.pem";
  ASSERT_EQ(std::system((script + " >/dev/null 2>&1").c_str()), 0);
  auto server = StartServer({"--model", ModelDir("none"), "--kv_cache_tokens", "4096", "--tls_cert", d + "/server.pem",
                             "--tls_key", d + "/server.key", "--tls_client_ca", d + "/ca.pem"});
  EXPECT_THAT(server->startup_output(), HasSubstr("(mutual TLS)"));
  auto try_call = [&](const std::string& cert, const std::string& key) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = testing::ReadFile(d + "/ca.pem");
    if (!cert.empty()) {
      ssl.pem_cert_chain = testing::ReadFile(d + "/" + cert);
      ssl.pem_private_key = testing::ReadFile(d + "/" + key);
    }
    auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(server->address(), grpc::SslCredentials(ssl)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GenerateResponse resp;
    return stub->Generate(&ctx, TokenRequest({1, 2}, 3), &resp);
  };
  EXPECT_TRUE(try_call("client.pem", "client.key").ok());
  EXPECT_FALSE(try_call("", "").ok()) << "no client certificate";
  EXPECT_FALSE(try_call("intruder.pem", "intruder.key").ok()) << "a certificate from another CA";
  grpc::ClientContext plain_ctx;
  plain_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::GenerateResponse resp;
  EXPECT_FALSE(Stub(*server)->Generate(&plain_ctx, TokenRequest({1}, 2), &resp).ok()) << "plaintext";

  // The HTTP API takes the same certificates: HTTPS, and a client certificate from the CA.
  auto curl = [&](const std::string& flags) {
    const std::string out = d + "/curl.out";
    const std::string cmd = "curl -s -o '" + out + "' -w '%{http_code}' --max-time 10 --cacert '" + d + "/ca.pem' " +
                            flags + " https://127.0.0.1:" + std::to_string(server->http_port()) + "/v1/models > '" +
                            d + "/curl.code' 2>/dev/null";
    std::system(cmd.c_str());
    return testing::ReadFile(d + "/curl.code");
  };
  EXPECT_EQ(curl("--cert '" + d + "/client.pem' --key '" + d + "/client.key'"), "200");
  EXPECT_NE(curl(""), "200") << "no client certificate";
  EXPECT_NE(curl("--cert '" + d + "/intruder.pem' --key '" + d + "/intruder.key'"), "200") << "another CA's";
  EXPECT_EQ(testing::HttpGet(server->http_port(), "/v1/models").find("200 OK"), std::string::npos) << "plaintext";
}

TEST(SecurityTest, ClientCaWithoutServerCertificateIsAFlagError) {
  testing::ServerProcess p;
  std::string error;
  EXPECT_FALSE(p.Start({"--model", ModelDir("none"), "--tls_client_ca", "/nonexistent.pem"}, &error));
  EXPECT_EQ(p.Wait(), 2);
  EXPECT_THAT(error, HasSubstr("--tls_client_ca needs --tls_cert"));
}

// ------------------------------------------------------------------ admin listener

TEST(SecurityTest, HealthAndReadinessLiveOnTheAdminListener) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--drain_grace_seconds", "3"});
  EXPECT_THAT(testing::HttpGet(server->metrics_port(), "/healthz"), HasSubstr("200 OK"));
  const std::string ready = testing::HttpGet(server->metrics_port(), "/readyz");
  EXPECT_THAT(ready, HasSubstr("200 OK"));
  EXPECT_THAT(ready, HasSubstr("serving"));
  EXPECT_THAT(testing::HttpGet(server->metrics_port(), "/anything-else"), HasSubstr("404"));
  // The test hooks exist only with --enable_test_hooks.
  EXPECT_THAT(testing::HttpRequest(server->metrics_port(), "POST", "/testing/pause"), HasSubstr("404"));
  // Draining (503 on /readyz, 200 on /healthz) is checked in server_test's ServerDrainTest.
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

// ------------------------------------------------------------------ limits

TEST(SecurityTest, ConcurrentStreamsPerConnectionAreCapped) {
  auto server = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192", "--max_concurrent_streams", "2",
                             "--enable_test_hooks"});
  // The engine is held, so the streams that reach the server stay open and count against the cap.
  ASSERT_TRUE(testing::PauseEngine(server->metrics_port()));
  auto stub = Stub(*server);  // one connection
  std::vector<std::future<Collected>> calls;
  for (int i = 0; i < 5; ++i) calls.push_back(std::async(std::launch::async, [&, i] { return Stream(*stub, TokenRequest({1, 2, i}, 150)); }));
  WaitForMetrics(server->metrics_port(), [](const auto& m) { return Metric(m, "relgen_requests_received_total") >= 2; });
  // A request on another connection reaches the server while the first connection's other three
  // streams must wait for a free slot.
  grpc::ChannelArguments args;
  args.SetInt("relgen.test.connection", 1);
  auto other = v1::GenerationService::NewStub(grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args));
  auto barrier = std::async(std::launch::async, [&] { return Stream(*other, TokenRequest({4, 5}, 3)); });
  // Both in one predicate: a scrape collects the counters before the engine's gauges, so a request
  // arriving in between is already waiting but not yet received in that sample.
  const auto held = WaitForMetrics(server->metrics_port(), [](const auto& m) {
    return Metric(m, "relgen_requests_received_total") >= 3 && Metric(m, "relgen_num_requests_waiting") >= 3;
  });
  EXPECT_EQ(Metric(held, "relgen_requests_received_total"), 3)
      << "more streams reached the server on one connection than --max_concurrent_streams";
  EXPECT_EQ(Metric(held, "relgen_num_requests_waiting"), 3);
  ASSERT_TRUE(testing::ResumeEngine(server->metrics_port()));
  EXPECT_TRUE(barrier.get().status.ok());
  for (auto& c : calls) {
    const Collected r = c.get();
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens.size(), 150u);
  }
}

// Files the process has open (not sockets, pipes or anonymous inodes), but its own memory map, which
// the sanitizer runtimes read from a thread of their own at any time (TSan's background thread).
std::set<std::string> OpenFiles(pid_t pid) {
  std::set<std::string> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  const std::string maps = "/proc/" + std::to_string(pid) + "/maps";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char target[4096];
    const ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string t(target, n);
    if (t.rfind("/", 0) == 0 && t.rfind("/dev/", 0) != 0 && t != maps) out.insert(t);
  }
  closedir(d);
  return out;
}

TEST(SecurityTest, NoRequestReachesTheFilesystem) {
  auto server = StartServer({"--model", ModelDir("none"), "--kv_cache_tokens", "4096"});
  const std::set<std::string> before = OpenFiles(server->pid());
  auto stub = Stub(*server);
  for (const std::string& path : {"/etc/passwd", "../../../../etc/shadow", "file:///proc/self/environ", "model.safetensors"}) {
    v1::GenerateRequest req;
    req.set_text(path);
    req.set_request_id(path);
    req.add_stop(path);
    req.set_max_new_tokens(3);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.request_id(), path) << "echoed as an opaque string";
  }
  EXPECT_EQ(OpenFiles(server->pid()), before);
}

}  // namespace
}  // namespace relgen
