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
#include "server/http_endpoint.h"

namespace relgen::server {

class Metrics final : public EngineObserver {
 public:
  Metrics();
  ~Metrics() override;

  // Serves the admin listener on `listen` (HOST:PORT; port 0 picks one): GET /metrics, /healthz
  // (200 while the process runs) and /readyz (200 while serving, 503 while loading or draining).
  // Returns the bound port. `extra` adds routes (HttpEndpoint's keys).
  absl::StatusOr<int> Serve(const std::string& listen, std::map<std::string, HttpEndpoint::Handler> extra = {});
  // What /readyz answers; mirrors the gRPC health status.
  void SetServing(bool serving) { serving_.store(serving); }
  // The Prometheus text exposition of every metric, as scraped.
  std::string Text() const;
  // The engine whose state the gauges report (null before the model is loaded).
  void SetEngine(const Engine* engine) { engine_.store(engine); }
  // A request answered with a non-OK status before or outside the engine's books.
  void OnRefused(grpc::StatusCode code);
  // A Generate, GenerateStream or Score call refused before the engine saw it (also an error).
  void OnRejected(grpc::StatusCode code) {
    OnRefused(code);
    rejected_->Increment();
  }
  // A Generate, GenerateStream or Score call reached the handler (before validation).
  void OnReceived() { received_->Increment(); }
  // A stream cancelled because its client left a write unread past --stream_write_timeout_seconds.
  void OnStreamWriteTimeout() { stream_write_timeouts_->Increment(); }

  void OnStep(int num_seqs, int num_tokens) override;
  void OnPreemptions(int count) override;
  void OnEncoded(int tokens) override;
  void OnToken(absl::Duration since_previous) override;
  void OnFinished(const RequestSummary& summary) override;
  void OnPrefixCache(int queried_tokens, int hit_tokens) override;

 private:
  class LiveGauges;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<LiveGauges> live_;
  HttpEndpoint http_;
  std::atomic<const Engine*> engine_{nullptr};
  std::atomic<bool> serving_{false};

  prometheus::Histogram* ttft_;
  prometheus::Histogram* tpot_;
  prometheus::Histogram* e2e_;
  prometheus::Histogram* queue_;
  prometheus::Histogram* prompt_tokens_hist_;
  prometheus::Histogram* generation_tokens_hist_;
  prometheus::Histogram* batch_size_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* encoder_tokens_;
  prometheus::Counter* generation_tokens_;
  prometheus::Counter* preemptions_;
  prometheus::Counter* prefix_cache_queries_;
  prometheus::Counter* prefix_cache_hits_;
  prometheus::Counter* stream_write_timeouts_;
  prometheus::Counter* received_;
  prometheus::Counter* rejected_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* errors_;
};

}  // namespace relgen::server
