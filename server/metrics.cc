#include "server/metrics.h"

#include <unistd.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace relgen::server {
namespace {

using prometheus::Histogram;

const Histogram::BucketBoundaries kLatencyBuckets = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                                     0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
const Histogram::BucketBoundaries kTokenGapBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                                      0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0};
const Histogram::BucketBoundaries kRequestBuckets = {0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5,
                                                     5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0};
const Histogram::BucketBoundaries kTokenBuckets = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000};
const Histogram::BucketBoundaries kBatchBuckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
// An engine step's host phases: tens of microseconds (a GPU decode step's plan) to a second (a long
// prefill on the CPU).
const Histogram::BucketBoundaries kStepBuckets = {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                                                  0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0};

const char* const kFinishReasons[] = {"length", "stop", "eos", "cancelled", "deadline", "error"};
// Every status the server answers a Generate call with other than OK (docs/metrics.md), so each
// series exists at 0 from start-up and rate() and ratios have data on an idle server.
const char* const kErrorCodes[] = {"CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                                   "INTERNAL", "UNAVAILABLE", "UNAUTHENTICATED", "NOT_FOUND"};

prometheus::ClientMetric GaugeValue(double v, std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = v;
  return m;
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help, std::vector<prometheus::ClientMetric> metrics) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = prometheus::MetricType::Gauge;
  f.metric = std::move(metrics);
  return f;
}

double ResidentBytes() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return static_cast<double>(resident) * sysconf(_SC_PAGESIZE);
}

}  // namespace

// Gauges computed at scrape time from the engine's stats snapshot.
class Metrics::LiveGauges final : public prometheus::Collectable {
 public:
  explicit LiveGauges(const std::atomic<const Engine*>* engine) : engine_(engine) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    out.push_back(GaugeFamily("process_resident_memory_bytes", "Resident memory size in bytes.",
                              {GaugeValue(ResidentBytes())}));
    const Engine* e = engine_->load();
    EngineStats s;
    if (e != nullptr) s = e->Stats();
    out.push_back(GaugeFamily("relgen_num_requests_running", "Requests in the running batch.", {GaugeValue(s.num_running)}));
    out.push_back(GaugeFamily("relgen_num_requests_waiting", "Requests queued for admission.", {GaugeValue(s.num_waiting)}));
    out.push_back(GaugeFamily("relgen_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).",
                              {GaugeValue(s.kv_blocks_total > 0 ? double(s.kv_blocks_used) / s.kv_blocks_total : 0.0)}));
    // used + cached + free = total: a cached block holds a prefix no sequence references, and is
    // taken back when a free one is needed.
    out.push_back(GaugeFamily("relgen_kv_cache_blocks", "KV cache blocks by state.",
                              {GaugeValue(s.kv_blocks_used, {{"state", "used"}}),
                               GaugeValue(s.kv_blocks_cached, {{"state", "cached"}}),
                               GaugeValue(s.kv_blocks_total - s.kv_blocks_used - s.kv_blocks_cached,
                                          {{"state", "free"}})}));
    const std::string device = s.device.empty() ? "none" : s.device;
    out.push_back(GaugeFamily("relgen_device_memory_bytes", "Memory the engine holds on its device, by kind.",
                              {GaugeValue(double(s.memory.weights), {{"device", device}, {"kind", "weights"}}),
                               GaugeValue(double(s.memory.kv_cache), {{"device", device}, {"kind", "kv_cache"}}),
                               GaugeValue(double(s.memory.activations), {{"device", device}, {"kind", "activations"}})}));
    return out;
  }

 private:
  const std::atomic<const Engine*>* engine_;
};

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto hist = [&](const char* name, const char* help, const Histogram::BucketBoundaries& b) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_).Add({}, b);
  };
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
  };
  ttft_ = hist("relgen_time_to_first_token_seconds", "Time from submission to the first generated token.", kLatencyBuckets);
  tpot_ = hist("relgen_time_per_output_token_seconds", "Time between consecutive generated tokens of a request.", kTokenGapBuckets);
  e2e_ = hist("relgen_e2e_request_latency_seconds", "Time from submission to finish.", kRequestBuckets);
  queue_ = hist("relgen_request_queue_time_seconds", "Time from submission to first scheduled.", kRequestBuckets);
  prompt_tokens_hist_ = hist("relgen_request_prompt_tokens", "Prompt tokens per request.", kTokenBuckets);
  generation_tokens_hist_ = hist("relgen_request_generation_tokens", "Generated tokens per request.", kTokenBuckets);
  batch_size_ = hist("relgen_batch_size", "Sequences per engine step.", kBatchBuckets);
  step_plan_ = hist("relgen_engine_step_plan_seconds",
                    "Host time per engine step taking requests, scheduling, building the inputs and launching "
                    "(the CPU backend computes the step here).",
                    kStepBuckets);
  step_wait_ = hist("relgen_engine_step_wait_seconds",
                    "Time per engine step blocked waiting for the device's answers.", kStepBuckets);
  step_land_ = hist("relgen_engine_step_land_seconds",
                    "Host time per engine step turning answers into tokens, text and deliveries.", kStepBuckets);
  step_ = hist("relgen_engine_step_seconds", "Time per engine step: plan + wait + land.", kStepBuckets);
  prompt_tokens_ = counter("relgen_prompt_tokens_total", "Prompt tokens of finished requests.");
  encoder_tokens_ = counter("relgen_encoder_tokens_total",
                            "Input tokens encoded by an encoder-decoder model (again after a preemption too).");
  generation_tokens_ = counter("relgen_generation_tokens_total", "Generated tokens.");
  preemptions_ = counter("relgen_preemptions_total", "Sequences preempted for lack of KV cache (recomputed later).");
  prefix_cache_queries_ = counter("relgen_prefix_cache_queries_total",
                                  "Prompt tokens looked up in the prefix cache at admission.");
  prefix_cache_hits_ = counter("relgen_prefix_cache_hits_total",
                               "Prompt tokens found in the prefix cache at admission (not computed again).");
  auto& received = prometheus::BuildCounter()
                       .Name("relgen_requests_received_total")
                       .Help("Generate, GenerateStream, Score and completions calls that reached the server (refused "
                             "ones included), by API.")
                       .Register(*registry_);
  received_grpc_ = &received.Add({{"api", "grpc"}});
  received_http_ = &received.Add({{"api", "http"}});
  auto& rejected = prometheus::BuildCounter()
                       .Name("relgen_requests_rejected_total")
                       .Help("Generate, GenerateStream, Score and completions calls refused before the engine "
                             "(invalid, unauthenticated, queue full, loading, draining), by API.")
                       .Register(*registry_);
  rejected_grpc_ = &rejected.Add({{"api", "grpc"}});
  rejected_http_ = &rejected.Add({{"api", "http"}});
  stream_write_timeouts_ = counter("relgen_stream_write_timeouts_total",
                                   "Streams cancelled because the client left a write unread past --stream_write_timeout_seconds.");
  requests_ = &prometheus::BuildCounter()
                   .Name("relgen_requests_total")
                   .Help("Finished requests by finish reason and LoRA adapter (each sample of a call, and each "
                         "continuation it scores, is one; the base's requests have no adapter label).")
                   .Register(*registry_);
  for (const char* r : kFinishReasons) requests_->Add({{"finish_reason", r}});
  errors_ = &prometheus::BuildCounter().Name("relgen_request_errors_total")
                 .Help("Calls answered with an error status, by gRPC status code (an HTTP call's status mapped to "
                       "one) and API.").Register(*registry_);
  for (const char* api : {"grpc", "http"}) {
    for (const char* c : kErrorCodes) errors_->Add({{"api", api}, {"code", c}});
  }
  live_ = std::make_shared<LiveGauges>(&engine_);
}

Metrics::~Metrics() = default;

std::string Metrics::Text() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : live_->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

void Metrics::OnRefused(grpc::StatusCode code, Api api) {
  static const char* const kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                       "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                       "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  errors_->Add({{"api", api == Api::kGrpc ? "grpc" : "http"}, {"code", c >= 0 && c <= 16 ? kNames[c] : "UNKNOWN"}})
      .Increment();
}

void Metrics::OnStep(int num_seqs, int) { batch_size_->Observe(num_seqs); }

void Metrics::OnPreemptions(int count) { preemptions_->Increment(count); }

void Metrics::OnEncoded(int tokens) { encoder_tokens_->Increment(tokens); }

void Metrics::OnPrefixCache(int queried_tokens, int hit_tokens) {
  prefix_cache_queries_->Increment(queried_tokens);
  prefix_cache_hits_->Increment(hit_tokens);
}

void Metrics::OnStepHostTimes(const StepHostTimes& t) {
  step_plan_->Observe(absl::ToDoubleSeconds(t.plan));
  step_wait_->Observe(absl::ToDoubleSeconds(t.wait));
  step_land_->Observe(absl::ToDoubleSeconds(t.land));
  step_->Observe(absl::ToDoubleSeconds(t.step));
}

void Metrics::OnToken(absl::Duration since_previous) {
  generation_tokens_->Increment();
  if (since_previous > absl::ZeroDuration()) tpot_->Observe(absl::ToDoubleSeconds(since_previous));
}

void Metrics::OnFinished(const RequestSummary& s) {
  // A LoRA adapter's requests carry its name (bounded: only registered names reach the engine);
  // the base's carry no adapter label, as before adapters, which Prometheus reads as adapter="".
  if (s.adapter.empty()) {
    requests_->Add({{"finish_reason", std::string(FinishReasonName(s.reason))}}).Increment();
  } else {
    requests_->Add({{"finish_reason", std::string(FinishReasonName(s.reason))}, {"adapter", s.adapter}}).Increment();
  }
  // Errors are booked by code where the call is answered (OnRefused), engine errors included.
  prompt_tokens_->Increment(s.prompt_tokens);
  prompt_tokens_hist_->Observe(s.prompt_tokens);
  generation_tokens_hist_->Observe(s.generated_tokens);
  queue_->Observe(absl::ToDoubleSeconds(s.queue));
  if (s.generated_tokens > 0) ttft_->Observe(absl::ToDoubleSeconds(s.time_to_first_token));
  e2e_->Observe(absl::ToDoubleSeconds(s.e2e));
}

}  // namespace relgen::server
