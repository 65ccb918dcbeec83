#include "server/service.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/auth.h"

namespace relgen::server {
namespace {

void FillInfos(const std::vector<SampleResult>& results, const Tokenizer& tok,
               google::protobuf::RepeatedPtrField<v1::TokenInfo>* infos) {
  for (const SampleResult& r : results) {
    v1::TokenInfo* info = infos->Add();
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

void FillTokens(const Output& o, const Tokenizer& tok, google::protobuf::RepeatedField<int32_t>* ids,
                google::protobuf::RepeatedPtrField<v1::TokenInfo>* logprobs) {
  for (int32_t t : o.token_ids) ids->Add(t);
  FillInfos(o.logprobs, tok, logprobs);
}

void FillTiming(const RequestTiming& t, v1::Timing* m) {
  m->set_queue_seconds(absl::ToDoubleSeconds(t.queue));
  m->set_time_to_first_token_seconds(absl::ToDoubleSeconds(t.time_to_first_token));
  m->set_total_seconds(absl::ToDoubleSeconds(t.total));
}

template <typename Msg>
void FillFinal(const Output& o, Msg* m) {
  m->set_finish_reason(ToProto(o.finish_reason));
  m->mutable_usage()->set_prompt_tokens(o.prompt_tokens);
  m->mutable_usage()->set_generated_tokens(o.generated_tokens);
  FillTiming(o.timing, m->mutable_timing());
}

// A call's timing over its samples or continuations: the first scheduled, the first token of any,
// the last finished (one of them: its own).
class CallTiming {
 public:
  void Add(const Output& final_output) {
    const RequestTiming& t = final_output.timing;
    if (count_++ == 0) {
      t_ = t;
      has_token_ = final_output.generated_tokens > 0;
      return;
    }
    t_.queue = std::min(t_.queue, t.queue);
    t_.total = std::max(t_.total, t.total);
    if (final_output.generated_tokens > 0) {
      t_.time_to_first_token = has_token_ ? std::min(t_.time_to_first_token, t.time_to_first_token)
                                          : t.time_to_first_token;
      has_token_ = true;
    }
  }
  const RequestTiming& get() const { return t_; }

 private:
  int count_ = 0;
  bool has_token_ = false;
  RequestTiming t_;
};

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

using Handles = std::vector<std::shared_ptr<RequestHandle>>;

// What every call kind shares. Lifetime: the engine may signal a call (from its thread) until the
// final output of each of its handles is delivered; the signal reaches the reactor only through the
// guard, which OnDone disarms before the reactor is deleted. Derived::Pump runs with the guard held.
// `handles_` is fixed at construction, so OnCancel may read it from any thread.
template <typename Derived, typename Reactor>
class Call : public Reactor {
 public:
  Call(GenerationService* service, grpc::CallbackServerContext* ctx, Handles handles)
      : service_(service),
        ctx_(ctx),
        handles_(std::move(handles)),
        done_(handles_.size(), false),
        guard_(std::make_shared<Guard>()) {}

  void OnCancel() override {
    Handoff h(this);
    CancelAll(DeadlinePassed(ctx_) ? FinishReason::kDeadline : FinishReason::kCancelled);
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
    for (const auto& handle : handles_) {
      handle->SetListener([g = guard_] {
        std::lock_guard<std::recursive_mutex> lock(g->mu);
        if (g->call != nullptr) {
          Handoff h(g->call);
          g->call->Pump();
        }
      });
    }
  }
  void CancelAll(FinishReason reason = FinishReason::kCancelled) {
    for (const auto& handle : handles_) handle->Cancel(reason);
  }
  // Marks handle i's final output read; true once every handle's is.
  bool MarkDone(size_t i) {
    done_[i] = true;
    return ++num_done_ == handles_.size();
  }
  // Ends a unary call with a handle's error: the others are cancelled (their output is dropped).
  void FailUnary(const grpc::Status& status) {
    finished_ = true;
    CancelAll();
    service_->Refused(status);
    this->Finish(status);
  }

  GenerationService* service_;
  grpc::CallbackServerContext* ctx_;
  const Handles handles_;
  std::vector<bool> done_;  // handle i's final output was read
  size_t num_done_ = 0;
  std::shared_ptr<Guard> guard_;
  bool finished_ = false;
};

class UnaryCall final : public Call<UnaryCall, grpc::ServerUnaryReactor> {
 public:
  UnaryCall(GenerationService* service, grpc::CallbackServerContext* ctx, Handles handles, v1::GenerateResponse* resp)
      : Call(service, ctx, std::move(handles)), resp_(resp), samples_(handles_.size()) {
    Arm();
  }

  // Collects everything readable; answers once every sample's final output is in.
  void Pump() {
    if (finished_) return;
    const Tokenizer& tok = service_->tokenizer();
    for (size_t i = 0; i < handles_.size(); ++i) {
      if (done_[i]) continue;
      v1::Sample& s = samples_[i];
      Output o;
      while (handles_[i]->Next(&o, absl::ZeroDuration())) {
        s.mutable_text()->append(o.text);
        FillTokens(o, tok, s.mutable_token_ids(), s.mutable_logprobs());
        FillInfos(o.prompt_logprobs, tok, resp_->mutable_prompt_logprobs());
        if (!o.finished) continue;
        const grpc::Status status = FinalStatus(o);
        if (!status.ok()) return FailUnary(status);
        s.set_index(static_cast<int>(i));
        s.set_finish_reason(ToProto(o.finish_reason));
        s.set_generated_tokens(o.generated_tokens);
        s.set_beam_score(o.beam_score);
        prompt_tokens_ = o.prompt_tokens;
        generated_tokens_ += o.generated_tokens;
        timing_.Add(o);
        if (MarkDone(i)) return Answer();
        break;
      }
    }
  }

 private:
  void Answer() {
    finished_ = true;
    // Sample 0 in the fields every client knows; all of them in `samples` when there are several.
    v1::Sample& first = samples_[0];
    resp_->set_finish_reason(first.finish_reason());
    resp_->set_beam_score(first.beam_score());
    resp_->mutable_usage()->set_prompt_tokens(prompt_tokens_);
    resp_->mutable_usage()->set_generated_tokens(generated_tokens_);
    FillTiming(timing_.get(), resp_->mutable_timing());
    if (samples_.size() == 1) {  // moved, not copied: the output may be long
      resp_->set_text(std::move(*first.mutable_text()));
      resp_->mutable_token_ids()->Swap(first.mutable_token_ids());
      resp_->mutable_logprobs()->Swap(first.mutable_logprobs());
    } else {
      resp_->set_text(first.text());
      *resp_->mutable_token_ids() = first.token_ids();
      *resp_->mutable_logprobs() = first.logprobs();
      for (v1::Sample& s : samples_) resp_->mutable_samples()->Add(std::move(s));
    }
    Finish(grpc::Status::OK);
  }

  v1::GenerateResponse* resp_;
  std::vector<v1::Sample> samples_;
  int prompt_tokens_ = 0;
  int generated_tokens_ = 0;
  CallTiming timing_;
};

class StreamCall final : public Call<StreamCall, grpc::ServerWriteReactor<v1::GenerateStreamResponse>> {
 public:
  StreamCall(GenerationService* service, grpc::CallbackServerContext* ctx, Handles handles, std::string request_id)
      : Call(service, ctx, std::move(handles)), request_id_(std::move(request_id)) {
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
      // A request still open ends here, its cancelled output pumped and booked (Pump, from the
      // listener). One already closed (finished, or cancelled before this write broke) has output
      // no write will carry: the call is booked here, once, with the status it ends with.
      CancelAll();
      if (!finished_) {
        finished_ = true;
        const grpc::Status status = DeadlinePassed(ctx_)
                                        ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed")
                                        : grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed");
        service_->Refused(status);
        Finish(status);
      }
      return;
    }
    Pump();
  }

  // Writes what is readable, one message (one sample's output) at a time. The samples take turns,
  // so a fast one cannot starve the others' readers.
  void Pump() {
    if (writing_ || finished_) return;
    const size_t k = handles_.size();
    for (size_t step = 0; step < k; ++step) {
      const size_t i = (next_ + step) % k;
      if (done_[i]) continue;
      Output o;
      if (!handles_[i]->Next(&o, absl::ZeroDuration())) continue;
      next_ = i + 1;
      msg_.Clear();
      msg_.set_request_id(request_id_);
      msg_.set_sample_index(static_cast<int>(i));
      msg_.set_text_delta(o.text);
      FillTokens(o, service_->tokenizer(), msg_.mutable_token_ids(), msg_.mutable_logprobs());
      FillInfos(o.prompt_logprobs, service_->tokenizer(), msg_.mutable_prompt_logprobs());
      clock_.pending_since_ns.store(SteadyNanos());
      if (!o.finished) {
        writing_ = true;
        StartWrite(&msg_);
        return;
      }
      const bool last = MarkDone(i);
      const grpc::Status status = FinalStatus(o);
      if (!status.ok()) {
        finished_ = true;
        clock_.pending_since_ns.store(0);
        CancelAll();
        service_->Refused(status);
        Finish(status);
        return;
      }
      FillFinal(o, &msg_);
      msg_.set_beam_score(o.beam_score);
      if (last) {
        finished_ = true;
        StartWriteAndFinish(&msg_, grpc::WriteOptions(), status);
      } else {
        writing_ = true;
        StartWrite(&msg_);
      }
      return;
    }
  }

 private:
  std::string request_id_;
  v1::GenerateStreamResponse msg_;
  bool writing_ = false;
  size_t next_ = 0;  // the sample whose turn it is
  GenerationService::WriteClock clock_;
};

class ScoreCall final : public Call<ScoreCall, grpc::ServerUnaryReactor> {
 public:
  ScoreCall(GenerationService* service, grpc::CallbackServerContext* ctx, RequestPath::Admission admission,
            v1::ScoreResponse* resp)
      : Call(service, ctx, std::move(admission.handles)),
        resp_(resp),
        prompt_tokens_(static_cast<int>(admission.prompt.size())),
        continuations_(std::move(admission.continuations)),
        scores_(handles_.size()) {
    Arm();
  }

  // Collects every continuation's log-probabilities; answers once all are in.
  void Pump() {
    if (finished_) return;
    for (size_t i = 0; i < handles_.size(); ++i) {
      if (done_[i]) continue;
      Output o;
      while (handles_[i]->Next(&o, absl::ZeroDuration())) {
        FillInfos(o.logprobs, service_->tokenizer(), scores_[i].mutable_logprobs());
        if (!o.finished) continue;
        const grpc::Status status = FinalStatus(o);
        if (!status.ok()) return FailUnary(status);
        if (scores_[i].logprobs_size() != static_cast<int>(continuations_[i].size())) {
          return FailUnary(grpc::Status(
              grpc::StatusCode::INTERNAL,
              absl::StrCat("the engine scored ", scores_[i].logprobs_size(), " tokens of continuations[", i,
                           "], which has ", continuations_[i].size())));
        }
        timing_.Add(o);
        if (MarkDone(i)) return Answer();
        break;
      }
    }
  }

 private:
  void Answer() {
    finished_ = true;
    int total = 0;
    for (size_t i = 0; i < scores_.size(); ++i) {
      v1::ContinuationScore& s = scores_[i];
      s.mutable_token_ids()->Add(continuations_[i].begin(), continuations_[i].end());
      double sum = 0;
      for (const v1::TokenInfo& t : s.logprobs()) sum += t.logprob();
      s.set_sum_logprob(sum);
      total += static_cast<int>(continuations_[i].size());
      resp_->mutable_scores()->Add(std::move(s));
    }
    resp_->mutable_usage()->set_prompt_tokens(prompt_tokens_);
    resp_->mutable_usage()->set_continuation_tokens(total);
    FillTiming(timing_.get(), resp_->mutable_timing());
    Finish(grpc::Status::OK);
  }

  v1::ScoreResponse* resp_;
  const int prompt_tokens_;
  const std::vector<std::vector<int32_t>> continuations_;
  std::vector<v1::ContinuationScore> scores_;
  CallTiming timing_;
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

int64_t SteadyNanos() {
  const int64_t t = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch()).count();
  return t == 0 ? 1 : t;
}

GenerationService::GenerationService(RequestPath* path, Metrics* metrics)
    : path_(path), options_(path->options()), metrics_(metrics) {
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

RequestPath::Caller GenerationService::CallerOf(grpc::CallbackServerContext* ctx) const {
  RequestPath::Caller caller;
  caller.api = Api::kGrpc;
  caller.auth = CheckBearerToken(ctx->client_metadata(), options_.auth_token);
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) caller.deadline = absl::FromChrono(ctx->deadline());
  return caller;
}

grpc::ServerUnaryReactor* GenerationService::Generate(grpc::CallbackServerContext* ctx,
                                                      const v1::GenerateRequest* req, v1::GenerateResponse* resp) {
  RequestPath::Admission a;
  const grpc::Status s = ToGrpcStatus(path_->Admit(*req, CallerOf(ctx), &a));
  if (!s.ok()) {
    auto* r = ctx->DefaultReactor();
    r->Finish(s);
    return r;
  }
  resp->set_request_id(a.request_id);
  return new UnaryCall(this, ctx, std::move(a.handles), resp);
}

grpc::ServerWriteReactor<v1::GenerateStreamResponse>* GenerationService::GenerateStream(
    grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req) {
  RequestPath::Admission a;
  const grpc::Status s = ToGrpcStatus(path_->Admit(*req, CallerOf(ctx), &a));
  if (!s.ok()) {
    class Refuse final : public grpc::ServerWriteReactor<v1::GenerateStreamResponse> {
     public:
      explicit Refuse(const grpc::Status& s) { Finish(s); }
      void OnDone() override { delete this; }
    };
    return new Refuse(s);
  }
  return new StreamCall(this, ctx, std::move(a.handles), std::move(a.request_id));
}

grpc::ServerUnaryReactor* GenerationService::Score(grpc::CallbackServerContext* ctx, const v1::ScoreRequest* req,
                                                   v1::ScoreResponse* resp) {
  RequestPath::Admission a;
  const grpc::Status s = ToGrpcStatus(path_->Admit(*req, CallerOf(ctx), &a));
  if (!s.ok()) {
    auto* r = ctx->DefaultReactor();
    r->Finish(s);
    return r;
  }
  resp->set_request_id(a.request_id);
  return new ScoreCall(this, ctx, std::move(a), resp);
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetModelInfoRequest*, v1::ModelInfo* info) {
  auto* r = ctx->DefaultReactor();
  Engine* engine = path_->engine();
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
                      : c.tokenizer == TokenizerKind::kWord          ? "word"
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
  info->set_compute_weights_dtype(st.weights_dtype);
  info->set_kv_cache_dtype(st.kv_cache_dtype);
  info->set_projections(st.projections);
  info->set_batch_invariant(st.batch_invariant);
  info->set_max_new_tokens_limit(options_.max_new_tokens);
  info->set_kv_cache_tokens(int64_t{st.kv_blocks_total} * engine->config().scheduler.block_size);
  r->Finish(grpc::Status::OK);
  return r;
}

}  // namespace relgen::server
