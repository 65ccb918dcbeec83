// relgen.v1.GenerationService on gRPC's callback API. gRPC threads admit calls through the request
// path (server/request_path.h); the engine thread signals readable output; each call keeps at most one write in flight and the engine merges
// output while a write is pending, so a slow reader neither stalls the engine nor grows memory
// beyond its own output. A call holds one engine handle per sample (Generate with n > 1) or per
// continuation (Score); it ends with the first non-OK status any of them ends with, cancelling the
// rest. Client cancel or disconnect, and a passed deadline, cancel every handle of the call in the
// engine at its next step. A stream whose client leaves a write unread for
// --stream_write_timeout_seconds is cancelled (a watchdog thread), so a reader that never reads holds
// its KV blocks and buffered output for a bounded time only.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "engine/core/engine.h"
#include "relgen/v1/generation.grpc.pb.h"
#include "server/metrics.h"
#include "server/options.h"
#include "server/request_path.h"

namespace relgen::server {

class GenerationService final : public v1::GenerationService::CallbackService {
 public:
  // Calls enter the engine through `path` (server/request_path.h), as the HTTP API's do.
  GenerationService(RequestPath* path, Metrics* metrics);
  ~GenerationService() override;

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req,
                                     v1::GenerateResponse* resp) override;
  grpc::ServerWriteReactor<v1::GenerateStreamResponse>* GenerateStream(
      grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx, const v1::ScoreRequest* req,
                                  v1::ScoreResponse* resp) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* info) override;

  // Shared by the call reactors.
  void Refused(const grpc::Status& status) { metrics_->OnRefused(status.error_code(), Api::kGrpc); }
  void CallDone() { path_->Done(); }
  const Tokenizer& tokenizer() const { return path_->engine()->tokenizer(); }

  // When a stream's pending write started (steady clock, ns; 0: none pending), watched by the
  // watchdog from Watch until Unwatch.
  struct WriteClock {
    grpc::CallbackServerContext* ctx = nullptr;
    std::atomic<int64_t> pending_since_ns{0};
    bool timed_out = false;  // guarded by watch_mu_
  };
  void Watch(WriteClock* clock);
  void Unwatch(WriteClock* clock);

 private:
  // The call as the request path sees it: its credentials' verdict and its deadline.
  RequestPath::Caller CallerOf(grpc::CallbackServerContext* ctx) const;

  RequestPath* path_;
  const Options& options_;
  Metrics* metrics_;

  void WatchdogLoop();
  // Recursive: TryCancel may run the call's callbacks, Unwatch included, on the watchdog's thread.
  std::recursive_mutex watch_mu_;
  std::condition_variable_any watch_cv_;
  std::set<WriteClock*> watched_;
  bool stop_watchdog_ = false;
  std::thread watchdog_;
};

// Steady-clock nanoseconds (never 0).
int64_t SteadyNanos();

v1::FinishReason ToProto(FinishReason r);

}  // namespace relgen::server
