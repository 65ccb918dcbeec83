// gRPC helpers shared by the end-to-end tests: a server on loopback, streams collected whole,
// token requests and /metrics polling.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "relgen/v1/generation.grpc.pb.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

namespace relgen {

inline std::string ModelDir(const std::string& name) { return testing::GoldenDir() + "/engine/" + name; }

inline std::unique_ptr<testing::ServerProcess> StartServer(const std::vector<std::string>& args) {
  auto p = std::make_unique<testing::ServerProcess>();
  std::string error;
  EXPECT_TRUE(p->Start(args, &error)) << error;
  return p;
}

inline std::unique_ptr<v1::GenerationService::Stub> Stub(const testing::ServerProcess& p) {
  return v1::GenerationService::NewStub(grpc::CreateChannel(p.address(), grpc::InsecureChannelCredentials()));
}

struct Collected {
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  int chunks = 0;
  grpc::Status status;
  v1::Usage usage;
};

inline Collected Stream(v1::GenerationService::Stub& stub, const v1::GenerateRequest& req, int cancel_after = -1,
                 std::chrono::milliseconds deadline = std::chrono::milliseconds(0)) {
  grpc::ClientContext ctx;
  if (deadline.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  auto reader = stub.GenerateStream(&ctx, req);
  Collected c;
  v1::GenerateStreamResponse m;
  while (reader->Read(&m)) {
    ++c.chunks;
    c.tokens.insert(c.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    c.text += m.text_delta();
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      c.reason = m.finish_reason();
      c.usage = m.usage();
    }
    if (c.chunks == cancel_after) ctx.TryCancel();
  }
  c.status = reader->Finish();
  return c;
}

inline v1::GenerateRequest TokenRequest(std::vector<int32_t> ids, int max_new) {
  v1::GenerateRequest r;
  for (int32_t t : ids) r.mutable_token_ids()->add_ids(t);
  r.set_max_new_tokens(max_new);
  r.set_ignore_eos(true);
  return r;
}

inline double Metric(const std::map<std::string, double>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? -1 : it->second;
}

// Polls /metrics until `pred` holds (giving up after 2 minutes, a bound for failing tests only);
// returns the last sample.
inline std::map<std::string, double> WaitForMetrics(int port, const std::function<bool(const std::map<std::string, double>&)>& pred) {
  std::map<std::string, double> m;
  for (int i = 0; i < 2400; ++i) {
    m = testing::ParseMetrics(testing::Scrape(port));
    if (pred(m)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return m;
}

inline std::string Bytes(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (b.Dump(&slices).ok()) {
    for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// A unary call with raw request bytes through the generic stub: the status and the response bytes.
inline std::pair<grpc::Status, std::string> RawUnary(const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
                                                     const std::string& bytes) {
  grpc::GenericStub stub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) { done.set_value(s); });
  const grpc::Status s = done.get_future().get();
  return {s, s.ok() ? Bytes(resp) : std::string()};
}

}  // namespace relgen
