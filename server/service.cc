#include "server/service.h"

#include <algorithm>
#include <mutex>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/auth.h"
#include "server/validation.h"

namespace relgen::server {
namespace {

grpc::StatusCode ToGrpc(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kInvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
    case absl::StatusCode::kResourceExhausted: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case absl::StatusCode::kUnavailable: return grpc::StatusCode::UNAVAILABLE;
    case absl::StatusCode::kDeadlineExceeded: return grpc::StatusCode::DEADLINE_EXCEEDED;
    case absl::StatusCode::kCancelled: return grpc::StatusCode::CANCELLED;
    default: return grpc::StatusCode::INTERNAL;
  }
}

std::string NewRequestId() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("%016x", rng());
}

void FillTokens(const Output& o, const Tokenizer& tok, google::protobuf::RepeatedField<int32_t>* ids,
                google::protobuf::RepeatedPtrField<v1::TokenInfo>* logprobs) {
  for (int32_t t : o.token_ids) ids->Add(t);
  for (const SampleResult& r : o.logprobs) {
    v1::TokenInfo* info = logprobs->Add();
    info->set_token_id(r.token);
    info->set_logprob(r.logprob);
    for (const TokenLogprob& alt : r.top) {
      v1::TokenLogprob* a = info->add_top_logprobs();
      a->set_token_id(alt.token);
      a->set_logprob(alt.logprob);
      a->set_text(tok.TokenText(alt.token));
    }
  }
}

template <typename Msg>
void FillFinal(const Output& o, Msg* m) {
  m->set_finish_reason(ToProto(o.finish_reason));
  m->mutable_usage()->set_prompt_tokens(o.prompt_tokens);
  m->mutable_usage()->set_generated_tokens(o.generated_tokens);
  m->mutable_timing()->set_queue_seconds(absl::ToDoubleSeconds(o.timing.queue));
  m->mutable_timing()->set_time_to_first_token_seconds(absl::ToDoubleSeconds(o.timing.time_to_first_token));
  m->mutable_timing()->set_total_seconds(absl::ToDoubleSeconds(o.timing.total));
}

// Whether a cancelled call is the client's deadline passing. The client gives up at its own
// deadline, which this server sees slightly later (the deadline travels as a timeout), so the
// cancellation arrives just before the server's copy of the deadline: allow a small margin.
bool DeadlinePassed(grpc::CallbackServerContext* ctx) {
  constexpr auto kMargin = std::chrono::milliseconds(250);
  return ctx->deadline() != std::chrono::system_clock::time_point::max() &&
         std::chrono::system_clock::now() + kMargin >= ctx->deadline();
}

#ifdef RELGEN_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

// gRPC orders a reactor's callbacks through its core, which the TSan tree cannot see (Debian's gRPC
// is not instrumented); this tells TSan about that order. No code outside the TSan tree.
class Handoff {
 public:
  explicit Handoff(void* reactor) : reactor_(reactor) {
#ifdef RELGEN_TSAN
    __tsan_acquire(reactor_);
#endif
  }
  ~Handoff() {
#ifdef RELGEN_TSAN
    if (reactor_ != nullptr) __tsan_release(reactor_);
#endif
  }
  void Forget() { reactor_ = nullptr; }  // the reactor is about to be deleted

 private:
  void* reactor_;
};

// What both call kinds share. Lifetime: the engine may signal a call (from its thread) until the
// call's final output is delivered; the signal reaches the reactor only through the guard, which
// OnDone disarms before the reactor is deleted. Derived::Pump runs with the guard held.
template <typename Derived, typename Reactor>
class Call : public Reactor {
 public:
  Call(GenerationService* service, grpc::CallbackServerContext* ctx, std::shared_ptr<RequestHandle> handle)
      : service_(service), ctx_(ctx), handle_(std::move(handle)), guard_(std::make_shared<Guard>()) {}

  void OnCancel() override {
    Handoff h(this);
    handle_->Cancel(DeadlinePassed(ctx_) ? FinishReason::kDeadline : FinishReason::kCancelled);
  }
  void OnDone() override {
    Handoff h(this);
    h.Forget();
    {
      std::lock_guard<std::recursive_mutex> lock(guard_->mu);
      guard_->call = nullptr;
    }
    service_->CallDone();
    delete this;
  }

 protected:
  struct Guard {
    std::recursive_mutex mu;
    Derived* call = nullptr;
  };
  // Called by Derived's constructor once it is complete: output may be readable already.
  void Arm() {
    Handoff h(this);
    guard_->call = static_cast<Derived*>(this);
    handle_->SetListener([g = guard_] {
      std::lock_guard<std::recursive_mutex> lock(g->mu);
      if (g->call != nullptr) {
        Handoff h(g->call);
        g->call->Pump();
      }
    });
  }

  GenerationService* service_;
  grpc::CallbackServerContext* ctx_;
  std::shared_ptr<RequestHandle> handle_;
  std::shared_ptr<Guard> guard_;
  bool finished_ = false;
};

class UnaryCall final : public Call<UnaryCall, grpc::ServerUnaryReactor> {
 public:
  UnaryCall(GenerationService* service, grpc::CallbackServerContext* ctx, std::shared_ptr<RequestHandle> handle,
            v1::GenerateResponse* resp)
      : Call(service, ctx, std::move(handle)), resp_(resp) {
    Arm();
  }

  // Collects everything readable; answers once the final output is in.
  void Pump() {
    if (finished_) return;
    Output o;
    while (handle_->Next(&o, absl::ZeroDuration())) {
      resp_->mutable_text()->append(o.text);
      FillTokens(o, service_->tokenizer(), resp_->mutable_token_ids(), resp_->mutable_logprobs());
      if (o.finished) {
        finished_ = true;
        FillFinal(o, resp_);
        const grpc::Status status = FinalStatus(o);
        if (!status.ok()) service_->Refused(status);
        Finish(status);
        return;
      }
    }
  }

 private:
  v1::GenerateResponse* resp_;
};

class StreamCall final : public Call<StreamCall, grpc::ServerWriteReactor<v1::GenerateStreamResponse>> {
 public:
  StreamCall(GenerationService* service, grpc::CallbackServerContext* ctx, std::shared_ptr<RequestHandle> handle,
             std::string request_id)
      : Call(service, ctx, std::move(handle)), request_id_(std::move(request_id)) {
    clock_.ctx = ctx;
    service->Watch(&clock_);
    Arm();
  }

  void OnDone() override {
    Handoff h(this);
    h.Forget();
    service_->Unwatch(&clock_);
    Call::OnDone();
  }

  void OnWriteDone(bool ok) override {
    Handoff h(this);
    std::lock_guard<std::recursive_mutex> lock(guard_->mu);
    clock_.pending_since_ns.store(0);
    writing_ = false;
    if (!ok) {  // the stream is broken: the client is gone or the call was cancelled
      handle_->Cancel();
      if (!finished_) {
        finished_ = true;
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed"));
      }
      return;
    }
    Pump();
  }

  // Writes what is readable, one message at a time.
  void Pump() {
    if (writing_ || finished_) return;
    Output o;
    if (!handle_->Next(&o, absl::ZeroDuration())) return;
    msg_.Clear();
    msg_.set_request_id(request_id_);
    msg_.set_text_delta(o.text);
    FillTokens(o, service_->tokenizer(), msg_.mutable_token_ids(), msg_.mutable_logprobs());
    clock_.pending_since_ns.store(SteadyNanos());
    if (!o.finished) {
      writing_ = true;
      StartWrite(&msg_);
      return;
    }
    finished_ = true;
    const grpc::Status status = FinalStatus(o);
    if (!status.ok()) {
      clock_.pending_since_ns.store(0);
      service_->Refused(status);
      Finish(status);
      return;
    }
    FillFinal(o, &msg_);
    StartWriteAndFinish(&msg_, grpc::WriteOptions(), status);
  }

 private:
  std::string request_id_;
  v1::GenerateStreamResponse msg_;
  bool writing_ = false;
  GenerationService::WriteClock clock_;
};

}  // namespace

v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    case FinishReason::kEos: return v1::FINISH_REASON_EOS;
    default: return v1::FINISH_REASON_UNSPECIFIED;
  }
}

grpc::Status FinalStatus(const Output& o) {
  switch (o.finish_reason) {
    case FinishReason::kLength:
    case FinishReason::kStop:
    case FinishReason::kEos:
      return grpc::Status::OK;
    case FinishReason::kDeadline:
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed");
    case FinishReason::kCancelled:
      if (o.status.code() == absl::StatusCode::kUnavailable) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(o.status.message()));
      }
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    default:  // kError: INTERNAL, or UNAVAILABLE once the device failed
      return grpc::Status(ToGrpc(o.status.code()), std::string(o.status.message()));
  }
}

int64_t SteadyNanos() {
  const int64_t t = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch()).count();
  return t == 0 ? 1 : t;
}

GenerationService::GenerationService(const Options& options, Metrics* metrics)
    : options_(options), metrics_(metrics) {
  if (options_.stream_write_timeout_seconds > 0) watchdog_ = std::thread([this] { WatchdogLoop(); });
}

GenerationService::~GenerationService() {
  {
    std::lock_guard<std::recursive_mutex> lock(watch_mu_);
    stop_watchdog_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void GenerationService::Watch(WriteClock* clock) {
  std::lock_guard<std::recursive_mutex> lock(watch_mu_);
  watched_.insert(clock);
}

void GenerationService::Unwatch(WriteClock* clock) {
  std::lock_guard<std::recursive_mutex> lock(watch_mu_);
  watched_.erase(clock);
}

// Cancels streams whose pending write has waited past the timeout. The context stays valid while
// its clock is watched: Unwatch (in OnDone) takes the same lock.
void GenerationService::WatchdogLoop() {
  const int64_t timeout_ns = static_cast<int64_t>(options_.stream_write_timeout_seconds * 1e9);
  const auto period = std::chrono::milliseconds(
      std::clamp<int64_t>(static_cast<int64_t>(options_.stream_write_timeout_seconds * 100), 10, 1000));
  std::unique_lock<std::recursive_mutex> lock(watch_mu_);
  while (!stop_watchdog_) {
    watch_cv_.wait_for(lock, period);
    const int64_t now = SteadyNanos();
    std::vector<WriteClock*> due;
    for (WriteClock* c : watched_) {
      const int64_t since = c->pending_since_ns.load();
      if (since != 0 && !c->timed_out && now - since > timeout_ns) due.push_back(c);
    }
    for (WriteClock* c : due) {
      if (!watched_.contains(c)) continue;  // ended by an earlier TryCancel's callbacks
      c->timed_out = true;
      metrics_->OnStreamWriteTimeout();
      c->ctx->TryCancel();  // may end the call (and free `c`) right here
    }
  }
}

grpc::Status GenerationService::Admit(grpc::CallbackServerContext* ctx, const v1::GenerateRequest& req,
                                      std::shared_ptr<RequestHandle>* handle, std::string* request_id) {
  metrics_->OnReceived();
  const grpc::Status s = Submit(ctx, req, handle, request_id);
  if (!s.ok()) metrics_->OnRejected(s.error_code());
  return s;
}

grpc::Status GenerationService::Submit(grpc::CallbackServerContext* ctx, const v1::GenerateRequest& req,
                                       std::shared_ptr<RequestHandle>* handle, std::string* request_id) {
  Engine* engine = engine_.load();
  if (engine == nullptr) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the model is loading");
  if (draining_.load()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is draining");
  grpc::Status auth = CheckBearerToken(ctx->client_metadata(), options_.auth_token);
  if (!auth.ok()) return auth;
  Request r;
  grpc::Status s = ToEngineRequest(req, engine->model().config(), engine->tokenizer(), options_, &r);
  if (!s.ok()) return s;
  if (r.id.empty()) r.id = NewRequestId();
  *request_id = r.id;
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) r.deadline = absl::FromChrono(ctx->deadline());
  auto h = engine->Submit(std::move(r));
  if (!h.ok()) return grpc::Status(ToGrpc(h.status().code()), std::string(h.status().message()));
  *handle = *std::move(h);
  in_flight_.fetch_add(1);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* GenerationService::Generate(grpc::CallbackServerContext* ctx,
                                                      const v1::GenerateRequest* req, v1::GenerateResponse* resp) {
  std::shared_ptr<RequestHandle> handle;
  std::string id;
  const grpc::Status s = Admit(ctx, *req, &handle, &id);
  if (!s.ok()) {
    auto* r = ctx->DefaultReactor();
    r->Finish(s);
    return r;
  }
  resp->set_request_id(id);
  return new UnaryCall(this, ctx, std::move(handle), resp);
}

grpc::ServerWriteReactor<v1::GenerateStreamResponse>* GenerationService::GenerateStream(
    grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req) {
  std::shared_ptr<RequestHandle> handle;
  std::string id;
  const grpc::Status s = Admit(ctx, *req, &handle, &id);
  if (!s.ok()) {
    class Refuse final : public grpc::ServerWriteReactor<v1::GenerateStreamResponse> {
     public:
      explicit Refuse(const grpc::Status& s) { Finish(s); }
      void OnDone() override { delete this; }
    };
    return new Refuse(s);
  }
  return new StreamCall(this, ctx, std::move(handle), std::move(id));
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetModelInfoRequest*, v1::ModelInfo* info) {
  auto* r = ctx->DefaultReactor();
  Engine* engine = engine_.load();
  if (engine == nullptr) {
    r->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the model is loading"));
    return r;
  }
  grpc::Status auth = CheckBearerToken(ctx->client_metadata(), options_.auth_token);
  if (!auth.ok()) {
    Refused(auth);
    r->Finish(auth);
    return r;
  }
  const ModelConfig& c = engine->model().config();
  info->set_name(c.name);
  info->set_vocab_size(c.vocab_size);
  info->set_d_model(c.d_model);
  info->set_n_layers(c.n_layers);
  info->set_n_heads(c.n_heads);
  info->set_head_dim(c.head_dim);
  info->set_ffn_dim(c.ffn_dim);
  info->set_max_seq_len(c.max_seq_len);
  v1::RelativeAttentionInfo* rel = info->mutable_relative_attention();
  rel->set_scheme(std::string(SchemeName(c.rel.scheme)));
  rel->set_max_relative_position(c.rel.max_relative_position);
  rel->set_block_length(c.rel.block_length);
  rel->set_clip(c.rel.clip);
  rel->set_relative_values(c.rel.relative_values);
  if (c.rel.scheme == relpos::Scheme::kT5) {
    rel->set_num_buckets(c.rel.num_buckets);
    rel->set_max_distance(c.rel.max_distance);
    rel->set_bidirectional(c.rel.bidirectional);
  }
  rel->set_heads_share_table(c.rel.heads_share_table);
  rel->set_share_across_layers(c.rel.share_across_layers);
  rel->set_scale_with_qk(c.rel.scale_with_qk);
  if (c.rel.scheme == relpos::Scheme::kAlibi) rel->set_alibi_bias_max(c.rel.alibi_bias_max);
  info->set_tokenizer(c.tokenizer == TokenizerKind::kByte            ? "byte"
                      : c.tokenizer == TokenizerKind::kSentencePiece ? "sentencepiece"
                                                                     : "bpe");
  info->set_architecture(c.architecture);
  info->set_source(c.source);
  info->set_encoder_decoder(c.encoder_decoder);
  info->set_n_encoder_layers(c.n_encoder_layers);
  info->set_decoder_start_token_id(c.decoder_start_token_id);
  info->set_bos_token_id(c.bos_token_id);
  info->set_eos_token_id(c.eos_token_id);
  info->set_num_parameters(engine->model().num_parameters());
  info->set_weights_dtype(std::string(DTypeName(engine->model().file_dtype())));
  const EngineStats st = engine->Stats();
  info->set_device(st.device);
  info->set_max_new_tokens_limit(options_.max_new_tokens);
  info->set_kv_cache_tokens(int64_t{st.kv_blocks_total} * engine->config().scheduler.block_size);
  r->Finish(grpc::Status::OK);
  return r;
}

}  // namespace relgen::server
