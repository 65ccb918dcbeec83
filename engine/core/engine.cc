#include "engine/core/engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace relgen {

absl::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kEos: return "eos";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kDeadline: return "deadline";
    case FinishReason::kError: return "error";
  }
  return "?";
}

// ---------------------------------------------------------------- RequestHandle

void RequestHandle::Deliver(Output&& delta) {
  std::function<void()> listener;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    Output& p = pending_;
    p.token_ids.insert(p.token_ids.end(), delta.token_ids.begin(), delta.token_ids.end());
    p.text += delta.text;
    for (SampleResult& r : delta.logprobs) p.logprobs.push_back(std::move(r));
    if (delta.finished) {
      p.finished = true;
      p.finish_reason = delta.finish_reason;
      p.status = delta.status;
      p.prompt_tokens = delta.prompt_tokens;
      p.generated_tokens = delta.generated_tokens;
      p.timing = delta.timing;
      closed_ = true;
    }
    has_pending_ = true;
    listener = listener_;
  }
  readable_cv_.notify_all();
  if (listener) listener();
}

bool RequestHandle::Next(Output* out, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (drained_) return false;
  if (timeout == absl::InfiniteDuration()) {
    readable_cv_.wait(lock, [this] { return has_pending_; });
  } else if (!readable_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return has_pending_; })) {
    return false;
  }
  *out = std::move(pending_);
  pending_ = Output();
  has_pending_ = false;
  if (out->finished) drained_ = true;
  return true;
}

void RequestHandle::Cancel(FinishReason reason) {
  if (reason != FinishReason::kDeadline) reason = FinishReason::kCancelled;
  if (!cancel_.load(std::memory_order_acquire)) cancel_reason_.store(reason, std::memory_order_release);
  cancel_.store(true, std::memory_order_release);
  std::function<void()> listener;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    // Unread output is dropped: nothing reaches the reader after Cancel.
    pending_ = Output();
    pending_.finished = true;
    pending_.finish_reason = cancel_reason();
    if (pending_.finish_reason == FinishReason::kDeadline) pending_.status = absl::DeadlineExceededError("deadline passed");
    has_pending_ = true;
    closed_ = true;
    listener = listener_;
  }
  readable_cv_.notify_all();
  if (listener) listener();
}

void RequestHandle::SetListener(std::function<void()> listener) {
  bool readable;
  {
    std::unique_lock<std::mutex> lock(mu_);
    listener_ = listener;
    readable = has_pending_;
  }
  if (readable && listener) listener();
}

// ---------------------------------------------------------------- Engine

struct Engine::Seq {
  int64_t id = 0;
  std::shared_ptr<RequestHandle> handle;
  Request req;
  std::vector<int32_t> tokens;  // prompt (encoder-decoder: decoder_start_token_id), then generated
  int num_computed = 0;         // tokens whose K/V are in `blocks`
  std::vector<int32_t> blocks;
  std::vector<int32_t> cross_blocks;  // encoder-decoder: the input's cross-attention K/V, once encoded
  int generated = 0;
  std::unique_ptr<StreamDecoder> detok;
  std::string held;  // decoded text held back while it may begin a stop string
  bool done = false;
  absl::Time submitted, scheduled = absl::InfinitePast(), first_token = absl::InfinitePast();
  absl::Time last_token = absl::InfinitePast();
};

Engine::Engine(std::shared_ptr<const Model> model, std::unique_ptr<Backend> backend,
               std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config)
    : model_(std::move(model)),
      backend_(std::move(backend)),
      tokenizer_(std::move(tokenizer)),
      config_(config),
      allocator_(backend_->kv_cache().num_blocks) {
  config_.scheduler.block_size = backend_->kv_cache().block_size;
  stats_.kv_blocks_total = allocator_.num_blocks();
  stats_.device = backend_->device();
  stats_.memory = backend_->memory();
  if (config_.background_thread) thread_ = std::thread([this] { Loop(); });
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<const Model> model,
                                                       std::unique_ptr<Backend> backend,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       EngineConfig config) {
  if (model == nullptr || backend == nullptr || tokenizer == nullptr) {
    return absl::InvalidArgumentError("engine needs a model, a backend and a tokenizer");
  }
  if (config.scheduler.max_num_seqs < 1 || config.scheduler.max_batch_tokens < 1 || config.max_waiting < 1) {
    return absl::InvalidArgumentError("max_num_seqs, max_batch_tokens and max_waiting must be >= 1");
  }
  return std::unique_ptr<Engine>(
      new Engine(std::move(model), std::move(backend), std::move(tokenizer), config));
}

Engine::~Engine() { Shutdown(); }

void Engine::Shutdown() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) {
    thread_.join();
  } else {
    Loop();  // no thread: finish what is outstanding here
  }
}

absl::StatusOr<std::shared_ptr<RequestHandle>> Engine::Submit(Request r) {
  const ModelConfig& c = model_->config();
  const int n = static_cast<int>(r.prompt.size());
  if (n == 0) return absl::InvalidArgumentError("prompt is empty");
  for (int32_t t : r.prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", t, " out of range; allowed 0..", c.vocab_size - 1));
    }
  }
  for (int32_t t : r.stop.stop_token_ids) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop token id ", t, " out of range; allowed 0..", c.vocab_size - 1));
    }
  }
  if (c.encoder_decoder) {
    // Input and output have a context each; the last output token is never fed back.
    if (n > c.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("the input is ", n, " tokens; allowed 1..", c.max_seq_len, " (max_seq_len)"));
    }
    if (r.stop.max_new_tokens < 1 || r.stop.max_new_tokens > c.max_seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("max_new_tokens ", r.stop.max_new_tokens, "; allowed 1..",
                                                     c.max_seq_len, " (max_seq_len)"));
    }
  } else if (r.stop.max_new_tokens < 1 || n + r.stop.max_new_tokens > c.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens ", r.stop.max_new_tokens, " with a prompt of ", n,
                                                   " tokens; allowed 1..", std::max(0, c.max_seq_len - n),
                                                   " (max_seq_len ", c.max_seq_len, ")"));
  }
  const SamplingParams& p = r.sampling;
  if (!(p.temperature >= 0.0f) || !(p.top_p > 0.0f && p.top_p <= 1.0f) || p.top_k < 0 ||
      !(p.repetition_penalty > 0.0f)) {
    return absl::InvalidArgumentError("sampling parameters out of range (temperature >= 0, 0 < top_p <= 1, top_k >= 0, repetition_penalty > 0)");
  }
  const int bs = config_.scheduler.block_size;
  const int need = c.encoder_decoder ? BlocksForTokens(n, bs) + BlocksForTokens(r.stop.max_new_tokens, bs)
                                     : BlocksForTokens(n + r.stop.max_new_tokens, bs);
  if (need > allocator_.num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat(c.encoder_decoder ? "input + max_new_tokens" : "prompt + max_new_tokens",
                                                   " = ", n + r.stop.max_new_tokens,
                                                   " tokens can never fit the KV cache of ",
                                                   int64_t{allocator_.num_blocks()} * bs, " tokens"));
  }
  auto s = std::make_unique<Seq>();
  s->handle = std::make_shared<RequestHandle>();
  s->handle->id_ = r.id;
  s->tokens = c.encoder_decoder ? std::vector<int32_t>{c.decoder_start_token_id} : r.prompt;
  s->req = std::move(r);
  s->detok = tokenizer_->NewStream();
  s->submitted = absl::Now();
  std::shared_ptr<RequestHandle> handle = s->handle;
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) return absl::UnavailableError("the engine is shut down");
  if (!failure_.ok()) return failure_;
  if (queued_ >= config_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat("the queue is full (", config_.max_waiting, " requests waiting)"));
  }
  s->id = next_seq_id_++;
  ++queued_;
  stats_.num_waiting = queued_;
  inbox_.push_back(std::move(s));
  cv_.notify_all();
  return handle;
}

absl::Status Engine::Failure() const {
  std::unique_lock<std::mutex> lock(mu_);
  return failure_;
}

EngineStats Engine::Stats() const {
  std::unique_lock<std::mutex> lock(mu_);
  return stats_;
}

void Engine::TakeInbox() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!inbox_.empty()) {
    waiting_.push_back(std::move(inbox_.front()));
    inbox_.pop_front();
  }
}

void Engine::RunOnce() {
  if (config_.background_thread) std::abort();  // the engine thread owns the loop
  TakeInbox();
  Step();
}

void Engine::Pause() {
  std::unique_lock<std::mutex> lock(mu_);
  paused_ = true;
  cv_.wait(lock, [this] { return !in_step_; });
}

void Engine::Resume() {
  std::unique_lock<std::mutex> lock(mu_);
  paused_ = false;
  cv_.notify_all();
}

void Engine::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        return stop_ || (!paused_ && (!inbox_.empty() || !running_.empty() || !waiting_.empty()));
      });
      if (stop_) break;
      in_step_ = true;
    }
    TakeInbox();
    Step();
    std::unique_lock<std::mutex> lock(mu_);
    in_step_ = false;
    cv_.notify_all();
  }
  // Shut down: nothing outstanding survives.
  std::deque<std::unique_ptr<Seq>> inbox;
  {
    std::unique_lock<std::mutex> lock(mu_);
    inbox.swap(inbox_);
  }
  for (auto* q : {&inbox, &waiting_}) {
    for (auto& s : *q) Finish(*s, FinishReason::kCancelled, absl::UnavailableError("the engine shut down"));
    q->clear();
  }
  for (auto& s : running_) Finish(*s, FinishReason::kCancelled, absl::UnavailableError("the engine shut down"));
  running_.clear();
}

void Engine::Finish(Seq& s, FinishReason reason, absl::Status status) {
  if (s.done) return;
  s.done = true;
  allocator_.Free(&s.blocks);
  allocator_.Free(&s.cross_blocks);
  {
    // Books first, so nothing a client has received is missing from them.
    // The running and waiting gauges too: a client that got its final output must not still be
    // counted as running (the step's own refresh comes later).
    // (Finish may run inside a remove_if over these queues: skip moved-from entries.)
    int running = 0, waiting = 0;
    for (const auto& r : running_) running += r != nullptr && !r->done ? 1 : 0;
    for (const auto& w : waiting_) waiting += w != nullptr && !w->done ? 1 : 0;
    std::unique_lock<std::mutex> lock(mu_);
    ++stats_.finished;
    stats_.kv_blocks_used = allocator_.num_used();
    stats_.num_running = running;
    stats_.num_waiting = waiting + static_cast<int>(inbox_.size());
  }
  Output o;
  o.finished = true;
  o.finish_reason = reason;
  o.status = std::move(status);
  o.prompt_tokens = static_cast<int>(s.req.prompt.size());
  o.generated_tokens = s.generated;
  const absl::Time now = absl::Now();
  o.timing.queue = (s.scheduled == absl::InfinitePast() ? now : s.scheduled) - s.submitted;
  o.timing.time_to_first_token = s.first_token == absl::InfinitePast() ? absl::ZeroDuration() : s.first_token - s.submitted;
  o.timing.total = now - s.submitted;
  if (config_.observer) {
    RequestSummary sum;
    sum.reason = reason;
    sum.code = o.status.code();
    sum.prompt_tokens = o.prompt_tokens;
    sum.generated_tokens = o.generated_tokens;
    sum.queue = o.timing.queue;
    sum.time_to_first_token = o.timing.time_to_first_token;
    sum.e2e = o.timing.total;
    config_.observer->OnFinished(sum);
  }
  s.handle->Deliver(std::move(o));
}

void Engine::EmitToken(Seq& s, const SampleResult& r) {
  s.tokens.push_back(r.token);
  ++s.generated;
  const absl::Time now = absl::Now();
  if (s.generated == 1) s.first_token = now;
  if (config_.observer) {
    config_.observer->OnToken(s.generated == 1 ? absl::ZeroDuration() : now - s.last_token);
  }
  s.last_token = now;
  {
    std::unique_lock<std::mutex> lock(mu_);
    ++stats_.generation_tokens;
  }
  Output o;
  o.token_ids.push_back(r.token);
  if (s.req.sampling.logprobs >= 0) o.logprobs.push_back(r);
  s.held += s.detok->Push(r.token);

  FinishReason reason = FinishReason::kNone;
  const std::vector<std::string>& stops = s.req.stop.stop_strings;
  size_t cut = std::string::npos;  // earliest stop string in the held text
  for (const std::string& stop : stops) cut = std::min(cut, s.held.find(stop));
  if (cut != std::string::npos) {
    o.text = s.held.substr(0, cut);
    s.held.clear();
    reason = FinishReason::kStop;
  } else {
    if (r.token == model_->config().eos_token_id && !s.req.stop.ignore_eos) {
      reason = FinishReason::kEos;
    } else if (std::find(s.req.stop.stop_token_ids.begin(), s.req.stop.stop_token_ids.end(), r.token) !=
               s.req.stop.stop_token_ids.end()) {
      reason = FinishReason::kStop;
    } else if (s.generated >= s.req.stop.max_new_tokens) {
      reason = FinishReason::kLength;
    }
    if (reason != FinishReason::kNone) {
      o.text = s.held + s.detok->Finish();
      s.held.clear();
    } else {
      // Hold back the longest tail that could still grow into a stop string.
      size_t keep = 0;
      for (const std::string& stop : stops) {
        for (size_t k = std::min(stop.size() - 1, s.held.size()); k > keep; --k) {
          if (s.held.compare(s.held.size() - k, k, stop, 0, k) == 0) {
            keep = k;
            break;
          }
        }
      }
      o.text = s.held.substr(0, s.held.size() - keep);
      s.held.erase(0, s.held.size() - keep);
    }
  }
  s.handle->Deliver(std::move(o));
  if (reason != FinishReason::kNone) Finish(s, reason);
}

void Engine::Step() {
  const absl::Time now = absl::Now();
  // Cancelled and expired requests leave first; their blocks are free for this step.
  // A passed deadline wins over a cancel: the client's own deadline also cancels its call, and how
  // that cancel is told apart from the client's choice depends on timing (service.cc).
  auto reap = [&](Seq& s) {
    if (now >= s.req.deadline) {
      Finish(s, FinishReason::kDeadline, absl::DeadlineExceededError("deadline passed"));
    } else if (s.handle->cancel_requested()) {
      const FinishReason why = s.handle->cancel_reason();
      Finish(s, why, why == FinishReason::kDeadline ? absl::DeadlineExceededError("deadline passed") : absl::OkStatus());
    }
    return s.done;
  };
  running_.erase(std::remove_if(running_.begin(), running_.end(), [&](auto& s) { return reap(*s); }),
                 running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), [&](auto& s) { return reap(*s); }),
                 waiting_.end());

  const bool enc_dec = model_->config().encoder_decoder;
  auto sched = [&](const Seq& s) {
    return SchedSeq{s.id, static_cast<int>(s.tokens.size()), s.num_computed, static_cast<int>(s.blocks.size()),
                    enc_dec ? static_cast<int>(s.req.prompt.size()) : 0, static_cast<int>(s.cross_blocks.size())};
  };
  std::vector<SchedSeq> run, wait;
  for (const auto& s : running_) run.push_back(sched(*s));
  for (const auto& s : waiting_) wait.push_back(sched(*s));
  const Schedule plan = ComputeSchedule(run, wait, allocator_.num_free(), config_.scheduler);

  // Preempted sequences (newest first) go back to the front of the queue, oldest first, and will
  // recompute their prompt and output so far.
  for (int64_t id : plan.preempted) {
    std::unique_ptr<Seq> s = std::move(running_.back());
    running_.pop_back();
    if (s->id != id) std::abort();  // the scheduler preempts from the newest end
    allocator_.Free(&s->blocks);
    allocator_.Free(&s->cross_blocks);  // the input is encoded again on readmission
    s->num_computed = 0;
    waiting_.push_front(std::move(s));
  }
  std::vector<Seq*> batch;
  for (const ScheduledChunk& c : plan.chunks) {
    if (c.admitted) {
      std::unique_ptr<Seq> s = std::move(waiting_.front());
      waiting_.pop_front();
      if (s->id != c.id) std::abort();  // admission is first-come first-served
      if (s->scheduled == absl::InfinitePast()) s->scheduled = now;
      running_.push_back(std::move(s));
      batch.push_back(running_.back().get());
    } else {
      for (auto& s : running_) {
        if (s->id == c.id) batch.push_back(s.get());
      }
    }
    if (!allocator_.Allocate(c.new_blocks, &batch.back()->blocks)) std::abort();  // planned
    if (!allocator_.Allocate(c.encoder_blocks, &batch.back()->cross_blocks)) std::abort();
  }

  std::vector<SequenceStep> steps;
  int step_tokens = 0, prefill_tokens = 0, encoder_tokens = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Seq& s = *batch[i];
    const int n = plan.chunks[i].num_tokens;
    SequenceStep st;
    st.tokens = absl::MakeConstSpan(s.tokens).subspan(s.num_computed, n);
    st.start_pos = s.num_computed;
    st.block_table = s.blocks;
    if (enc_dec) {
      st.encoder_len = static_cast<int>(s.req.prompt.size());
      st.cross_block_table = s.cross_blocks;
      if (plan.chunks[i].encoder_blocks > 0) {
        st.encoder_tokens = s.req.prompt;
        encoder_tokens += st.encoder_len;
      }
    }
    steps.push_back(st);
    step_tokens += n;
    if (s.num_computed + n < static_cast<int>(s.tokens.size()) || n > 1 || s.generated == 0) prefill_tokens += n;
  }
  absl::Status broken;
  if (!steps.empty()) {
    absl::Status st = backend_->Forward(steps, &logits_);
    if (!st.ok()) broken = backend_->Broken();
    if (!st.ok()) {
      std::fprintf(stderr, "relgen: forward failed: %s%s\n", std::string(st.message()).c_str(),
                   broken.ok() ? "" : " (the device is broken)");
    }
    if (!broken.ok()) {
      // Failed before anyone hears of it: a client that sees its request fail finds Failure() set.
      st = absl::UnavailableError(absl::StrCat("the device failed (", broken.message(), "); the server must restart"));
      std::unique_lock<std::mutex> lock(mu_);
      failure_ = st;
    }
    const int vocab = model_->config().vocab_size;
    for (size_t i = 0; i < batch.size(); ++i) {
      Seq& s = *batch[i];
      if (!st.ok()) {
        Finish(s, FinishReason::kError, st);
        continue;
      }
      s.num_computed += plan.chunks[i].num_tokens;
      if (s.num_computed < static_cast<int>(s.tokens.size())) continue;  // prompt not done yet
      const SampleResult r = Sample(absl::MakeConstSpan(logits_).subspan(i * vocab, vocab), s.req.sampling,
                                    s.tokens, s.generated, &sample_scratch_);
      EmitToken(s, r);
    }
  }
  if (!broken.ok()) {
    // Nothing can run any more: everything outstanding fails now, and Submit refuses from here on.
    std::deque<std::unique_ptr<Seq>> inbox;
    absl::Status failure;
    {
      std::unique_lock<std::mutex> lock(mu_);
      failure = failure_;
      inbox.swap(inbox_);
    }
    for (auto* q : {&inbox, &waiting_}) {
      for (auto& s : *q) Finish(*s, FinishReason::kError, failure);
      q->clear();
    }
    for (auto& s : running_) Finish(*s, FinishReason::kError, failure);
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](auto& s) { return s->done; }),
                 running_.end());

  if (config_.observer) {
    if (!steps.empty()) config_.observer->OnStep(static_cast<int>(steps.size()), step_tokens);
    if (encoder_tokens > 0) config_.observer->OnEncoded(encoder_tokens);
    if (!plan.preempted.empty()) config_.observer->OnPreemptions(static_cast<int>(plan.preempted.size()));
  }
  std::unique_lock<std::mutex> lock(mu_);
  queued_ = static_cast<int>(inbox_.size() + waiting_.size());
  stats_.num_running = static_cast<int>(running_.size());
  stats_.num_waiting = queued_;
  stats_.kv_blocks_used = allocator_.num_used();
  if (!steps.empty()) {
    ++stats_.steps;
    stats_.last_step_seqs = static_cast<int>(steps.size());
    stats_.last_step_tokens = step_tokens;
  }
  stats_.prompt_tokens += prefill_tokens;
  stats_.encoder_tokens += encoder_tokens;
  stats_.preemptions += static_cast<int64_t>(plan.preempted.size());
  stats_.memory = backend_->memory();
}

}  // namespace relgen
