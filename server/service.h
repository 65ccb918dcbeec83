// relgen.v1.GenerationService on gRPC's callback API. gRPC threads validate and submit; the engine
// thread signals readable output; each call keeps at most one write in flight and the engine merges
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

namespace relgen::server {

class GenerationService final : public v1::GenerationService::CallbackService {
 public:
  GenerationService(const Options& options, Metrics* metrics);
  ~GenerationService() override;

  // Requests are answered UNAVAILABLE until the engine is set (the model is loading).
  void SetEngine(Engine* engine) { engine_.store(engine); }
  // From now on new requests are answered UNAVAILABLE; calls already admitted go on.
  void StartDraining() { draining_.store(true); }
  // Generate/GenerateStream/Score calls admitted and not yet done.
  int in_flight() const { return in_flight_.load(); }

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req,
                                     v1::GenerateResponse* resp) override;
  grpc::ServerWriteReactor<v1::GenerateStreamResponse>* GenerateStream(
      grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx, const v1::ScoreRequest* req,
                                  v1::ScoreResponse* resp) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* info) override;

  // A call the engine took: one handle per sample or continuation.
  struct Admission {
    std::vector<std::shared_ptr<RequestHandle>> handles;
    std::string request_id;
    int prompt_tokens = 0;
    std::vector<int32_t> prompt;  // as tokenised (HTTP only: its echo)
    std::vector<std::vector<int32_t>> continuations;  // Score: as tokenised
  };
  // Shared by the call reactors. Admit books the call as received and, when it returns an error,
  // as rejected.
  grpc::Status Admit(grpc::CallbackServerContext* ctx, const v1::GenerateRequest& req, Admission* out);
  grpc::Status Admit(grpc::CallbackServerContext* ctx, const v1::ScoreRequest& req, Admission* out);
  void Refused(const grpc::Status& status) { metrics_->OnRefused(status.error_code(), Api::kGrpc); }
  // The HTTP API's way in (server/openai_api.h): a request `checked` by ToEngineRequest, as a
  // gRPC call's is, `auth` being the caller's verdict on the credentials, `deadline` the call's;
  // the same loading, draining and auth checks. Books nothing: the caller books its call, which may submit several
  // prompts. Each admission is one call in flight until CallDone.
  absl::Status SubmitFromHttp(Request checked, const grpc::Status& auth, absl::Time deadline, Admission* out);
  void CallDone() { in_flight_.fetch_sub(1); }
  Engine* engine() const { return engine_.load(); }
  const Options& options() const { return options_; }
  const Tokenizer& tokenizer() const { return engine_.load()->tokenizer(); }

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
  const Options& options_;
  Metrics* metrics_;
  std::atomic<Engine*> engine_{nullptr};
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};

  // Validates and submits to the engine (Req: GenerateRequest or ScoreRequest; defined in the .cc).
  template <typename Req>
  grpc::Status Submit(grpc::CallbackServerContext* ctx, const Req& req, Admission* out);
  template <typename Req>
  grpc::Status Submit(const Req& req, absl::Time deadline, const grpc::Status& auth, Admission* out);
  // OK when a request may be submitted now: the model loaded, not draining, `auth` OK.
  grpc::Status Open(Engine* engine, const grpc::Status& auth) const;
  // Submits a validated request to the engine; one call in flight when OK.
  absl::Status SubmitChecked(Engine* engine, Request r, absl::Time deadline, Admission* out);

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

// An engine or validation status as gRPC's (the message, which names the field, unchanged).
grpc::Status ToGrpcStatus(const absl::Status& s);

// The gRPC status a finished request ends with.
grpc::Status FinalStatus(const Output& final_output);
v1::FinishReason ToProto(FinishReason r);

}  // namespace relgen::server
