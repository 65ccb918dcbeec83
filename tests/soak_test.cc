// Soak: thousands of requests at concurrency 64 against a real server on loopback, with random
// prompt and output lengths, client cancels, deadlines, slow readers and unary calls mixed. At the
// end: every request is in the books exactly once, no KV block is held, the resident set grew
// less than 5% after warm-up, and the server still drains and exits 0 (under ASan, leak-free).
// RELGEN_SOAK_REQUESTS sets the request count (default 5000).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "tests/grpc_test_util.h"
#include "tests/server_process.h"

namespace relgen {
namespace {

enum Kind { kStream, kUnary, kCancel, kDeadline, kSlowReader, kNumKinds };
const char* const kKindNames[] = {"stream", "unary", "cancel", "deadline", "slow reader"};

struct Tally {
  std::atomic<int64_t> issued{0}, ok{0}, cancelled{0}, deadline{0}, other{0};
  std::atomic<int64_t> tokens{0};
  std::atomic<int64_t> by_kind[kNumKinds] = {};
  std::mutex mu;
  std::vector<std::string> failures;  // first few unexpected outcomes
  void Fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (failures.size() < 10) failures.push_back(what);
  }
};

// One request of a random kind; checks what the client sees.
void RunOne(v1::GenerationService::Stub& stub, std::mt19937_64& rng, Tally* t) {
  const Kind kind = static_cast<Kind>(std::uniform_int_distribution<int>(0, 99)(rng) < 50 ? kStream
                                      : std::uniform_int_distribution<int>(1, kNumKinds - 1)(rng));
  const int prompt_len = std::uniform_int_distribution<int>(1, 48)(rng);
  const int max_new = std::uniform_int_distribution<int>(1, 64)(rng);
  std::vector<int32_t> prompt(prompt_len);
  for (int32_t& id : prompt) id = std::uniform_int_distribution<int>(0, 255)(rng);
  v1::GenerateRequest req = TokenRequest(prompt, max_new);
  req.set_temperature(0.8f);
  req.set_seed(rng());
  ++t->issued;
  ++t->by_kind[kind];

  grpc::Status status;
  int64_t tokens = 0;
  // Calls wait for a connection rather than fail fast: Debian 12's gRPC client can fail a connect
  // attempt to a healthy server (connect_fault_test), and a fail-fast call then fails at once. The
  // server side is what is under test; every connection is checked to be the server's at the end.
  const auto give_up = std::chrono::system_clock::now() + std::chrono::minutes(5);
  if (kind == kUnary) {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(give_up);
    v1::GenerateResponse resp;
    status = stub.Generate(&ctx, req, &resp);
    tokens = resp.token_ids_size();
  } else {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(give_up);
    const int cancel_after = std::uniform_int_distribution<int>(1, 8)(rng);
    if (kind == kDeadline) {
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(std::uniform_int_distribution<int>(2, 80)(rng)));
    }
    auto reader = stub.GenerateStream(&ctx, req);
    v1::GenerateStreamResponse m;
    int chunks = 0;
    while (reader->Read(&m)) {
      tokens += m.token_ids_size();
      ++chunks;
      if (kind == kCancel && chunks == cancel_after) ctx.TryCancel();
      if (kind == kSlowReader) std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(1, 6)(rng)));
    }
    status = reader->Finish();
  }
  t->tokens += tokens;
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
      ++t->ok;
      if (tokens != max_new) t->Fail(std::string(kKindNames[kind]) + ": OK with " + std::to_string(tokens) + " of " + std::to_string(max_new) + " tokens");
      break;
    case grpc::StatusCode::CANCELLED:
      ++t->cancelled;
      if (kind != kCancel) t->Fail(std::string(kKindNames[kind]) + ": CANCELLED " + status.error_message());
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      ++t->deadline;
      if (kind != kDeadline) t->Fail(std::string(kKindNames[kind]) + ": DEADLINE_EXCEEDED");
      break;
    default:
      ++t->other;
      t->Fail(std::string(kKindNames[kind]) + ": status " + std::to_string(status.error_code()) + " " + status.error_message());
  }
}

TEST(SoakTest, ThousandsOfMixedRequestsAtConcurrency64) {
  const char* env = std::getenv("RELGEN_SOAK_REQUESTS");
  const int total = env != nullptr ? std::atoi(env) : 5000;
  const int warmup = total / 5;
  constexpr int kConcurrency = 64;
  auto server = StartServer({"--model", ModelDir("skew"), "--kv_cache_tokens", "8192", "--max_num_seqs", "64",
                             "--max_batch_tokens", "512", "--threads", "2"});
  ASSERT_GT(server->metrics_port(), 0);
  const int64_t blocks_total = 8192 / 16;

  Tally t;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int64_t rss_after_warmup = 0;
  std::mutex rss_mu;
  std::vector<std::thread> clients;
  const auto t0 = std::chrono::steady_clock::now();
  // A connection per four clients: many streams share one, as behind a proxy.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < kConcurrency / 4; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("relgen.soak.channel", c);  // distinct arguments: a connection of its own
    channels.push_back(grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args));
  }
  for (int c = 0; c < kConcurrency; ++c) {
    clients.emplace_back([&, c] {
      auto stub = v1::GenerationService::NewStub(channels[c / 4]);
      std::mt19937_64 rng(1000 + c);
      while (next.fetch_add(1) < total) {
        RunOne(*stub, rng, &t);
        if (done.fetch_add(1) + 1 == warmup) {
          std::lock_guard<std::mutex> lock(rss_mu);
          rss_after_warmup = testing::RssBytes(server->pid());
        }
      }
    });
  }
  for (auto& th : clients) th.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const auto m = WaitForMetrics(server->metrics_port(), [&](const auto& m) {
    return Metric(m, "relgen_e2e_request_latency_seconds_count") == Metric(m, "relgen_requests_received_total") &&
           Metric(m, "relgen_kv_cache_blocks{state=\"used\"}") == 0;
  });
  const int64_t rss_end = testing::RssBytes(server->pid());
  std::printf("soak: %d requests in %.1f s (%.0f req/s), %lld tokens received; client saw %lld OK, %lld cancelled, "
              "%lld deadline; kinds: stream %lld, unary %lld, cancel %lld, deadline %lld, slow reader %lld; "
              "RSS after warm-up %.1f MiB, at end %.1f MiB (%+.2f%%)\n",
              total, seconds, total / seconds, static_cast<long long>(t.tokens.load()),
              static_cast<long long>(t.ok.load()), static_cast<long long>(t.cancelled.load()),
              static_cast<long long>(t.deadline.load()), static_cast<long long>(t.by_kind[kStream].load()),
              static_cast<long long>(t.by_kind[kUnary].load()), static_cast<long long>(t.by_kind[kCancel].load()),
              static_cast<long long>(t.by_kind[kDeadline].load()), static_cast<long long>(t.by_kind[kSlowReader].load()),
              rss_after_warmup / 1048576.0, rss_end / 1048576.0, 100.0 * (rss_end - rss_after_warmup) / rss_after_warmup);
  std::printf("soak: server books: length %.0f, cancelled %.0f, deadline %.0f, error %.0f; preemptions %.0f\n",
              Metric(m, "relgen_requests_total{finish_reason=\"length\"}"),
              Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}"),
              Metric(m, "relgen_requests_total{finish_reason=\"deadline\"}"),
              Metric(m, "relgen_requests_total{finish_reason=\"error\"}"), Metric(m, "relgen_preemptions_total"));

  for (const auto& [k, v] : m) {
    if (k.rfind("relgen_request_errors_total", 0) == 0) std::printf("soak: %s %.0f\n", k.c_str(), v);
  }
  // Server side: every connection the clients opened was accepted by the server under test (its own
  // sockets, no other process on the port) and none was lost and reopened.
  const int port = std::stoi(server->address().substr(server->address().rfind(':') + 1));
  const std::vector<std::string> accepted = testing::EstablishedOnPort(port);
  const std::set<std::string> owned = testing::SocketInodesOf(server->pid());
  int by_server = 0;
  for (const std::string& inode : accepted) by_server += owned.count(inode) > 0 ? 1 : 0;
  std::printf("soak: %zu connections established on port %d, %d of them accepted by the server under test\n",
              accepted.size(), port, by_server);
  EXPECT_EQ(static_cast<int>(accepted.size()), kConcurrency / 4) << "one connection per channel";
  EXPECT_EQ(by_server, static_cast<int>(accepted.size())) << "connections accepted by another process";

  for (const std::string& f : t.failures) ADD_FAILURE() << f;
  EXPECT_EQ(t.issued.load(), total);
  EXPECT_EQ(t.other.load(), 0);
  EXPECT_GT(t.cancelled.load(), 0) << "some cancels should land mid-stream";
  EXPECT_GT(t.deadline.load(), 0) << "some deadlines should pass mid-stream";

  // Every request the server received is in the books exactly once, under one finish reason. A
  // request whose deadline passed on the way may be dropped by gRPC before it reaches the server.
  double finished = 0;
  for (const char* r : {"length", "stop", "eos", "cancelled", "deadline", "error"}) {
    finished += Metric(m, std::string("relgen_requests_total{finish_reason=\"") + r + "\"}");
  }
  const double received = Metric(m, "relgen_requests_received_total");
  std::printf("soak: received %.0f of %d (%.0f expired in transit)\n", received, total, total - received);
  EXPECT_EQ(Metric(m, "relgen_requests_rejected_total"), 0);
  EXPECT_EQ(finished + Metric(m, "relgen_requests_rejected_total"), received);
  EXPECT_EQ(Metric(m, "relgen_e2e_request_latency_seconds_count"), received);
  EXPECT_LE(total - received, t.deadline.load()) << "only requests past their deadline may go missing";
  EXPECT_GE(received, total * 0.95);
  EXPECT_EQ(Metric(m, "relgen_requests_total{finish_reason=\"error\"}"), 0);
  // A request the client saw finish OK finished "length" on the server; a cancel or deadline racing
  // the last token may still be booked "length".
  EXPECT_GE(Metric(m, "relgen_requests_total{finish_reason=\"length\"}"), t.ok.load());
  EXPECT_LE(Metric(m, "relgen_requests_total{finish_reason=\"cancelled\"}") +
                Metric(m, "relgen_requests_total{finish_reason=\"deadline\"}"),
            t.cancelled.load() + t.deadline.load());
  EXPECT_GE(Metric(m, "relgen_generation_tokens_total"), t.tokens.load());

  // Nothing leaked: every KV block is free or cached (a finished prompt's, free again on demand),
  // nothing runs or waits.
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(Metric(m, "relgen_kv_cache_blocks{state=\"free\"}") +
                Metric(m, "relgen_kv_cache_blocks{state=\"cached\"}"),
            blocks_total);
  EXPECT_EQ(Metric(m, "relgen_num_requests_running"), 0);
  EXPECT_EQ(Metric(m, "relgen_num_requests_waiting"), 0);

  // Memory is flat after warm-up (not checked under sanitizers: their quarantine and shadow grow).
  ASSERT_GT(rss_after_warmup, 0);
#ifndef RELGEN_SANITIZER
  EXPECT_LT(rss_end, rss_after_warmup * 1.05) << "RSS grew more than 5% after warm-up";
#endif

  // And it still drains and exits cleanly (under ASan, LeakSanitizer checks the exit).
  server->Signal(SIGTERM);
  std::string output;
  EXPECT_EQ(server->Wait(&output), 0) << output;
}

}  // namespace
}  // namespace relgen
