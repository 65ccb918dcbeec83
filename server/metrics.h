// Prometheus metrics (names and semantics in docs/metrics.md; they mirror vLLM's). Counters and
// histograms are fed by the engine (as its EngineObserver) and by the service (refused requests);
// gauges are read from the engine when scraped, so they are never stale.
// Thread-safety: every method may be called from any thread.
#pragma once

#include <grpcpp/support/status.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "engine/core/engine.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace relgen::server {

// The API a call came by (the `api` label).
enum class Api { kGrpc, kHttp };

class Metrics final : public EngineObserver {
 public:
  Metrics();
  ~Metrics() override;

  // What /readyz answers (200 while serving, 503 while loading or draining); mirrors the gRPC
  // health status.
  void SetServing(bool serving) { serving_.store(serving); }
  bool serving() const { return serving_.load(); }
  // The Prometheus text exposition of every metric, as scraped.
  std::string Text() const;
  // The engine whose state the gauges report (null before the model is loaded).
  void SetEngine(const Engine* engine) { engine_.store(engine); }
  // A request answered with a non-OK status before or outside the engine's books.
  void OnRefused(grpc::StatusCode code, Api api);
  // A Generate, GenerateStream, Score or completions call refused before the engine saw it (also an
  // error).
  void OnRejected(grpc::StatusCode code, Api api) {
    OnRefused(code, api);
    (api == Api::kGrpc ? rejected_grpc_ : rejected_http_)->Increment();
  }
  // A Generate, GenerateStream, Score or completions call reached its handler (before validation).
  void OnReceived(Api api) { (api == Api::kGrpc ? received_grpc_ : received_http_)->Increment(); }
  // A stream cancelled because its client left a write unread past --stream_write_timeout_seconds.
  void OnStreamWriteTimeout() { stream_write_timeouts_->Increment(); }

  void OnStep(int num_seqs, int num_tokens) override;
  void OnPreemptions(int count) override;
  void OnEncoded(int tokens) override;
  void OnToken(absl::Duration since_previous) override;
  void OnFinished(const RequestSummary& summary) override;
  void OnPrefixCache(int queried_tokens, int hit_tokens) override;
  void OnStepHostTimes(const StepHostTimes& times) override;

 private:
  class LiveGauges;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<LiveGauges> live_;
  std::atomic<const Engine*> engine_{nullptr};
  std::atomic<bool> serving_{false};

  prometheus::Histogram* ttft_;
  prometheus::Histogram* tpot_;
  prometheus::Histogram* e2e_;
  prometheus::Histogram* queue_;
  prometheus::Histogram* prompt_tokens_hist_;
  prometheus::Histogram* generation_tokens_hist_;
  prometheus::Histogram* batch_size_;
  prometheus::Histogram* step_plan_;
  prometheus::Histogram* step_wait_;
  prometheus::Histogram* step_land_;
  prometheus::Histogram* step_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* encoder_tokens_;
  prometheus::Counter* generation_tokens_;
  prometheus::Counter* preemptions_;
  prometheus::Counter* prefix_cache_queries_;
  prometheus::Counter* prefix_cache_hits_;
  prometheus::Counter* stream_write_timeouts_;
  prometheus::Counter* received_grpc_;
  prometheus::Counter* received_http_;
  prometheus::Counter* rejected_grpc_;
  prometheus::Counter* rejected_http_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* errors_;
};

}  // namespace relgen::server
