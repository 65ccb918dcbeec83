#include "engine/core/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
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
    for (SampleResult& r : delta.prompt_logprobs) p.prompt_logprobs.push_back(std::move(r));
    if (delta.finished) {
      p.finished = true;
      p.finish_reason = delta.finish_reason;
      p.status = delta.status;
      p.prompt_tokens = delta.prompt_tokens;
      p.generated_tokens = delta.generated_tokens;
      p.timing = delta.timing;
      p.beam_score = delta.beam_score;
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
  int generated = 0;             // tokens delivered
  int drawn = 0;                 // draws launched: generated, and the one of a step in flight
  // tokens[pending_pos] is a placeholder for the draw of the latest launched step, not yet landed
  // (its query there: pending_query); -1 when none.
  int pending_pos = -1, pending_query = -1;
  int in_flight = 0;  // launched steps holding the sequence, not yet landed: it outlives them
  std::unique_ptr<StreamDecoder> detok;
  std::string held;  // decoded text held back while it may begin a stop string
  bool done = false;
  absl::Time submitted, scheduled = absl::InfinitePast(), first_token = absl::InfinitePast();
  absl::Time last_token = absl::InfinitePast();

  bool follower = false;  // a later sample or continuation of a group (its prompt is the leader's)
  // Scoring: tokens[score_from..] are the continuation, scored and never sampled; -1 when generating.
  int score_from = -1;
  std::vector<SampleResult> scores;        // one per continuation token computed so far
  std::vector<SampleResult> prompt_lps;    // prompt tokens 1.. computed so far (prompt_logprobs)
  bool prompt_lps_delivered = false;
  // Prefix chain of the registered (or hit) blocks: chain[b] is the cursor past blocks[b].
  std::vector<PrefixCursor> chain;
  std::vector<int32_t> hits;  // waiting: prefix-cache hits planned for admission
  // The group's later members, started when this one has computed fork_tokens tokens (whole
  // blocks): each takes references to those blocks (and the input's K/V of an encoder-decoder model).
  std::vector<std::unique_ptr<Seq>> followers;
  int fork_tokens = 0;
  // Beam search: the group, this beam's place in it, and whether its candidates for the group's
  // step are in (it then waits for its siblings', computing nothing).
  std::shared_ptr<BeamGroup> beam;
  int beam_index = -1;
  bool beam_answered = false;

  // First token whose logits are needed (its row predicts the next token): nothing before it may come
  // from the prefix cache, which holds K/V and no logits.
  int LogitsFrom() const {
    if (score_from >= 0) return score_from - 1;
    if (req.prompt_logprobs >= 0 && !prompt_lps_delivered) return 0;
    return static_cast<int>(tokens.size()) - 1;
  }
  // Something to compute in the next step: not finished, tokens not yet in the cache, and not
  // waiting only for a draw that ends it (max_new_tokens).
  bool Runnable() const {
    return !done && num_computed < static_cast<int>(tokens.size()) && !beam_answered &&
           (score_from >= 0 || drawn < req.stop.max_new_tokens);
  }
  // A beam whose candidates are in, holding its blocks while its siblings compute.
  bool Idle() const { return !done && beam_answered && in_flight == 0; }
};

struct Engine::BeamGroup {
  explicit BeamGroup(const BeamConfig& c) : search(c) {}
  BeamSearch search;
  std::vector<std::shared_ptr<RequestHandle>> handles;  // one per returned sequence
  std::vector<Seq*> members;  // the live beams, in the search's order
  std::vector<std::vector<TokenLogprob>> candidates;  // per member, for the step under way
  bool ended = false;
  int prompt_tokens = 0;
  bool skip_special_tokens = true;
  absl::Time submitted;
  absl::Time scheduled = absl::InfinitePast();  // its first admission
};

// One step, from the plan to what the backend answered.
struct Engine::StepBatch {
  // Where an answer goes: a prompt token's log-probabilities, a continuation token's score, or
  // the sequence's next token.
  enum class Use { kPromptLogprob, kScore, kDraw, kBeam };
  Schedule plan;
  std::vector<Seq*> seqs;  // the plan's chunks, in order
  std::vector<SequenceStep> steps;
  std::vector<RowQuery> queries;
  std::vector<Use> uses;           // per query
  std::vector<int> first_query;    // per sequence, then one past the last
  std::vector<int> lengths;        // per sequence: its tokens when the step was built
  std::vector<int> ends;           // per sequence: tokens in the cache once the step has run
  std::vector<int> placeholders;   // per sequence: the position its draw fills, or -1 (Launch)
  std::vector<SampleResult> answers;
  int step_tokens = 0, prefill_tokens = 0, encoder_tokens = 0;
  int64_t queried = 0, hit_tokens = 0;  // prefix cache, admissions of this step
};

Engine::Engine(std::shared_ptr<const Model> model, std::unique_ptr<Backend> backend,
               std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config)
    : model_(std::move(model)),
      backend_(std::move(backend)),
      tokenizer_(std::move(tokenizer)),
      config_(config),
      allocator_(backend_->kv_cache().num_blocks, backend_->kv_cache().block_size) {
  config_.scheduler.block_size = backend_->kv_cache().block_size;
  stats_.kv_blocks_total = allocator_.num_blocks();
  stats_.device = backend_->device();
  stats_.weights_dtype = backend_->weights_dtype();
  stats_.kv_cache_dtype = backend_->kv_cache_dtype();
  stats_.projections = backend_->projections();
  stats_.batch_invariant = backend_->batch_invariant();
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
  if (r.n != 1 || !r.continuations.empty() || r.num_return_sequences != 1) {
    return absl::InvalidArgumentError("Submit takes one sample or sequence and no continuations; use SubmitGroup");
  }
  auto group = SubmitGroup(std::move(r));
  if (!group.ok()) return group.status();
  return std::move(group->front());
}

absl::Status Engine::Check(const Request& r) const {
  return CheckRequest(r, model_->config(), config_.limits, KvCapacity{allocator_.num_blocks(), config_.scheduler.block_size});
}

absl::StatusOr<std::vector<std::shared_ptr<RequestHandle>>> Engine::SubmitGroup(Request r) {
  if (absl::Status st = Check(r); !st.ok()) return st;
  TruncatePrompt(&r);
  PrepareControls(&r, model_->config().eos_token_id);
  const int members = r.continuations.empty() ? r.n : static_cast<int>(r.continuations.size());
  std::vector<std::shared_ptr<RequestHandle>> handles;
  if (absl::Status st = Enqueue(MakeGroup(std::move(r), &handles), members); !st.ok()) return st;
  return handles;
}

std::unique_ptr<Engine::Seq> Engine::MakeGroup(Request r, std::vector<std::shared_ptr<RequestHandle>>* out) {
  const ModelConfig& c = model_->config();
  const int bs = config_.scheduler.block_size;
  const int n = static_cast<int>(r.prompt.size());
  const bool scoring = !r.continuations.empty();
  std::vector<std::shared_ptr<RequestHandle>>& handles = *out;
  // The group: one sequence per sample or continuation; the first leads, the rest follow it. A beam
  // search starts as one sequence (its prompt) and forks as it goes.
  const int members = scoring ? static_cast<int>(r.continuations.size()) : r.n;
  std::vector<std::vector<int32_t>> continuations = std::move(r.continuations);
  r.continuations.clear();
  const absl::Time now = absl::Now();
  std::vector<std::unique_ptr<Seq>> group;
  for (int i = 0; i < members; ++i) {
    auto s = std::make_unique<Seq>();
    s->handle = std::make_shared<RequestHandle>();
    s->handle->id_ = r.id;
    s->req = r;
    s->follower = i > 0;
    if (s->follower) s->req.prompt_logprobs = -1;
    s->tokens = c.encoder_decoder ? std::vector<int32_t>{c.decoder_start_token_id} : r.prompt;
    if (scoring) {
      s->score_from = static_cast<int>(s->tokens.size());
      s->tokens.insert(s->tokens.end(), continuations[i].begin(), continuations[i].end());
    } else {
      s->req.sampling.seed = r.sampling.seed + static_cast<uint64_t>(i);
    }
    s->detok = r.skip_special_tokens ? tokenizer_->NewStream() : tokenizer_->NewStreamWithSpecials();
    s->submitted = now;
    handles.push_back(s->handle);
    group.push_back(std::move(s));
  }
  if (r.num_beams > 1) {
    BeamConfig bc;
    bc.num_beams = r.num_beams;
    bc.length_penalty = r.length_penalty;
    bc.early_stopping = r.early_stopping;
    bc.num_return = r.num_return_sequences;
    bc.max_new_tokens = r.stop.max_new_tokens;
    bc.end_token = r.stop.ignore_eos ? -1 : c.eos_token_id;
    auto g = std::make_shared<BeamGroup>(bc);
    g->handles.push_back(handles.front());
    for (int i = 1; i < r.num_return_sequences; ++i) {
      g->handles.push_back(std::make_shared<RequestHandle>());
      g->handles.back()->id_ = r.id;
      handles.push_back(g->handles.back());
    }
    g->members = {group.front().get()};
    g->candidates.resize(1);
    g->submitted = now;
    g->prompt_tokens = n;
    g->skip_special_tokens = r.skip_special_tokens;
    group.front()->beam = g;
    group.front()->beam_index = 0;
  }
  Seq& leader = *group.front();
  // Followers share the leader's blocks before the first token whose logits they need.
  const int follower_logits_from = scoring ? leader.score_from - 1 : static_cast<int>(leader.tokens.size()) - 1;
  leader.fork_tokens = follower_logits_from / bs * bs;
  for (int i = 1; i < members; ++i) leader.followers.push_back(std::move(group[i]));
  return std::move(group.front());
}

absl::Status Engine::Enqueue(std::unique_ptr<Seq> s, int members) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) return absl::UnavailableError("the engine is shut down");
  if (!failure_.ok()) return failure_;
  if (queued_ + members > config_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat("the queue is full: ", queued_, " sequences waiting and this request adds ",
                                                     members, ", over the limit of ", config_.max_waiting,
                                                     " (--max_waiting); retry later"));
  }
  s->id = next_seq_id_++;
  for (auto& f : s->followers) f->id = next_seq_id_++;
  queued_ += members;
  stats_.num_waiting = queued_;
  inbox_.push_back(std::move(s));
  cv_.notify_all();
  return absl::OkStatus();
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
  Step(true);
}

void Engine::Pause() {
  std::unique_lock<std::mutex> lock(mu_);
  paused_ = true;
  cv_.wait(lock, [this] { return !in_step_ && !has_in_flight_; });
}

bool Engine::PauseRequested() {
  std::unique_lock<std::mutex> lock(mu_);
  return paused_;
}

void Engine::Resume() {
  std::unique_lock<std::mutex> lock(mu_);
  paused_ = false;
  cv_.notify_all();
}

void Engine::Loop() {
  while (true) {
    bool plan;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A step in flight lands even while paused.
      cv_.wait(lock, [this] {
        return stop_ || in_flight_ != nullptr ||
               (!paused_ && (!inbox_.empty() || !running_.empty() || !waiting_.empty()));
      });
      if (stop_) break;
      in_step_ = true;
      plan = !paused_;
    }
    Step(plan);
    std::unique_lock<std::mutex> lock(mu_);
    in_step_ = false;
    has_in_flight_ = in_flight_ != nullptr;
    cv_.notify_all();
  }
  // Shut down: what is in flight lands, then nothing outstanding survives.
  if (in_flight_ != nullptr) {
    std::unique_ptr<StepBatch> b = std::move(in_flight_);
    Land(*b);
  }
  FinishAll(FinishReason::kCancelled, absl::UnavailableError("the engine shut down"));
}

void Engine::FinishAll(FinishReason reason, const absl::Status& status) {
  std::deque<std::unique_ptr<Seq>> inbox;
  {
    std::unique_lock<std::mutex> lock(mu_);
    inbox.swap(inbox_);
  }
  for (auto* q : {&inbox, &waiting_}) {
    for (auto& s : *q) Finish(*s, reason, status);
    q->clear();
  }
  for (auto& s : running_) Finish(*s, reason, status);
  running_.clear();
  // Finishing a leader orphans its followers; they have none of their own.
  std::vector<std::unique_ptr<Seq>> orphans;
  orphans.swap(orphans_);
  for (auto& s : orphans) Finish(*s, reason, status);
}

void Engine::Finish(Seq& s, FinishReason reason, absl::Status status) {
  if (s.done) return;
  if (s.beam != nullptr) {
    EndBeams(*s.beam, reason, status);
    return;
  }
  s.done = true;
  allocator_.Free(&s.blocks);
  allocator_.Free(&s.cross_blocks);
  s.chain.clear();
  for (auto& f : s.followers) orphans_.push_back(std::move(f));
  s.followers.clear();
  BookFinished(0);  // the steps booked its tokens
  Output o;
  o.finished = true;
  o.finish_reason = reason;
  o.status = std::move(status);
  o.prompt_tokens = static_cast<int>(s.req.prompt.size());
  o.generated_tokens = s.generated;
  if (s.score_from >= 0 && reason == FinishReason::kLength) o.logprobs = std::move(s.scores);
  const absl::Time now = absl::Now();
  o.timing.queue = (s.scheduled == absl::InfinitePast() ? now : s.scheduled) - s.submitted;
  o.timing.time_to_first_token = s.first_token == absl::InfinitePast() ? absl::ZeroDuration() : s.first_token - s.submitted;
  o.timing.total = now - s.submitted;
  // A group's prompt counts once.
  Observe(reason, o.status.code(), s.follower ? 0 : o.prompt_tokens, o.generated_tokens, o.timing);
  s.handle->Deliver(std::move(o));
}

void Engine::BookFinished(int generated) {
  // (Finish may run inside a remove_if over these queues: skip moved-from entries.)
  int running = 0, waiting = 0;
  for (const auto& r : running_) running += r != nullptr && !r->done ? 1 : 0;
  for (const auto& w : waiting_) waiting += w != nullptr && !w->done ? 1 : 0;
  std::unique_lock<std::mutex> lock(mu_);
  ++stats_.finished;
  stats_.generation_tokens += generated;
  stats_.kv_blocks_used = allocator_.num_used();
  stats_.kv_blocks_cached = allocator_.num_cached();
  stats_.num_running = running;
  stats_.num_waiting = waiting + static_cast<int>(inbox_.size());
}

void Engine::Observe(FinishReason reason, absl::StatusCode code, int prompt_tokens, int generated,
                     const RequestTiming& t) {
  if (!config_.observer) return;
  RequestSummary sum;
  sum.reason = reason;
  sum.code = code;
  sum.prompt_tokens = prompt_tokens;
  sum.generated_tokens = generated;
  sum.queue = t.queue;
  sum.time_to_first_token = t.time_to_first_token;
  sum.e2e = t.total;
  config_.observer->OnFinished(sum);
}

void Engine::DropBeam(Seq& s) {
  s.done = true;
  allocator_.Free(&s.blocks);
  allocator_.Free(&s.cross_blocks);
  s.chain.clear();
}

void Engine::AnswerBeam(Seq& s, const SampleResult& candidates) {
  BeamGroup& g = *s.beam;
  g.candidates[s.beam_index] = candidates.top;
  s.beam_answered = true;
  for (const Seq* m : g.members) {
    if (!m->beam_answered) return;
  }
  SelectBeams(g);
}

void Engine::SelectBeams(BeamGroup& g) {
  const std::vector<int> parents = g.search.Step(g.candidates);
  if (g.search.finished()) {
    EndBeams(g, FinishReason::kNone, absl::OkStatus());
    return;
  }
  const int bs = config_.scheduler.block_size;
  const int n = static_cast<int>(parents.size());
  std::vector<Seq*> next(n, nullptr);
  std::vector<bool> continued(g.members.size(), false);
  // A parent's first child continues it in place; the others fork from it, sharing its full blocks
  // (immutable) and recomputing the partial last one, which is never copied: a recompute is at most
  // block_size - 1 tokens in a step's batch, where a copy would be a device copy per layer.
  for (int j = 0; j < n; ++j) {
    if (!continued[parents[j]]) {
      continued[parents[j]] = true;
      next[j] = g.members[parents[j]];
    }
  }
  for (int j = 0; j < n; ++j) {
    if (next[j] != nullptr) continue;
    const Seq& par = *g.members[parents[j]];
    auto f = std::make_unique<Seq>();
    f->handle = par.handle;
    f->req = par.req;
    f->tokens = par.tokens;
    f->submitted = par.submitted;
    f->scheduled = par.scheduled;
    f->beam = par.beam;
    const int shared =
        config_.share_beam_blocks ? std::min<int>(par.num_computed, static_cast<int>(par.tokens.size())) / bs : 0;
    allocator_.Share(absl::MakeConstSpan(par.blocks).first(shared), &f->blocks);
    if (config_.share_beam_blocks) allocator_.Share(par.cross_blocks, &f->cross_blocks);
    f->num_computed = shared * bs;
    f->chain.assign(par.chain.begin(), par.chain.begin() + std::min<size_t>(shared, par.chain.size()));
    {
      std::unique_lock<std::mutex> lock(mu_);
      f->id = next_seq_id_++;
    }
    next[j] = f.get();
    forks_.push_back(std::move(f));
  }
  for (size_t p = 0; p < g.members.size(); ++p) {
    if (!continued[p]) DropBeam(*g.members[p]);
  }
  for (int j = 0; j < n; ++j) {
    next[j]->tokens.push_back(g.search.tokens(j).back());
    next[j]->beam_index = j;
    next[j]->beam_answered = false;
  }
  g.members = std::move(next);
  g.candidates.assign(n, {});
}

void Engine::EndBeams(BeamGroup& g, FinishReason reason, const absl::Status& status) {
  if (g.ended) return;
  g.ended = true;
  std::vector<BeamHypothesis> results;
  if (reason == FinishReason::kNone) results = g.search.Result();
  const int prompt_tokens = g.prompt_tokens;
  for (Seq* m : g.members) DropBeam(*m);
  g.members.clear();
  g.candidates.clear();
  int generated = 0;
  for (const BeamHypothesis& h : results) generated += static_cast<int>(h.tokens.size());
  BookFinished(generated);
  const absl::Time now = absl::Now();
  RequestTiming timing;
  timing.queue = (g.scheduled == absl::InfinitePast() ? now : g.scheduled) - g.submitted;
  timing.time_to_first_token = results.empty() ? absl::ZeroDuration() : now - g.submitted;
  timing.total = now - g.submitted;
  for (size_t j = 0; j < g.handles.size(); ++j) {
    Output o;
    o.finished = true;
    o.finish_reason = reason;
    o.status = status;
    o.prompt_tokens = prompt_tokens;
    o.timing = timing;
    if (j < results.size()) {
      const BeamHypothesis& h = results[j];
      o.token_ids = h.tokens;
      o.text = tokenizer_->Decode(h.tokens, g.skip_special_tokens);
      o.finish_reason = h.ended ? FinishReason::kEos : FinishReason::kLength;
      o.generated_tokens = static_cast<int>(h.tokens.size());
      o.beam_score = h.score;
    } else if (reason == FinishReason::kNone) {
      o.finish_reason = FinishReason::kStop;  // fewer hypotheses than asked for (every token banned)
    }
    if (j == 0) Observe(o.finish_reason, o.status.code(), prompt_tokens, generated, timing);
    g.handles[j]->Deliver(std::move(o));
  }
}

void Engine::EndBanned(Seq& s) {
  Output o;
  if (s.req.prompt_logprobs >= 0 && !s.prompt_lps_delivered) {
    o.prompt_logprobs = std::move(s.prompt_lps);
    s.prompt_lps.clear();
    s.prompt_lps_delivered = true;
  }
  o.text = s.held + s.detok->Finish();
  s.held.clear();
  s.handle->Deliver(std::move(o));
  Finish(s, FinishReason::kStop);
}

void Engine::EmitToken(Seq& s, const SampleResult& r) {
  ++s.generated;  // the token is in s.tokens already (Land)
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
  if (s.req.prompt_logprobs >= 0 && !s.prompt_lps_delivered) {
    o.prompt_logprobs = std::move(s.prompt_lps);
    s.prompt_lps.clear();
    s.prompt_lps_delivered = true;
  }
  s.held += s.detok->Push(r.token);

  FinishReason reason = FinishReason::kNone;
  const std::vector<std::string>& stops = s.req.stop.stop_strings;
  size_t cut = std::string::npos;  // earliest stop string in the held text (from min_tokens on)
  if (s.generated >= s.req.sampling.min_tokens) {
    for (const std::string& stop : stops) cut = std::min(cut, s.held.find(stop));
  }
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

void Engine::LookupPrefix(Seq& s) {
  s.hits.clear();
  if (!s.blocks.empty()) return;  // a follower holds its shared blocks and their chain
  s.chain.clear();
  if (!config_.prefix_caching) return;
  const int bs = config_.scheduler.block_size;
  const absl::Span<const int32_t> root =
      model_->config().encoder_decoder ? absl::MakeConstSpan(s.req.prompt) : absl::Span<const int32_t>();
  PrefixCursor at = BlockAllocator::Root(root);
  const absl::Span<const int32_t> tokens(s.tokens);
  for (int b = 0; b < s.LogitsFrom() / bs; ++b) {
    const absl::Span<const int32_t> block = tokens.subspan(b * bs, bs);
    const int32_t hit = allocator_.Lookup(at, block, root);
    if (hit < 0) break;
    at = allocator_.Advance(at, hit, block);
    s.hits.push_back(hit);
    s.chain.push_back(at);
  }
}

void Engine::RegisterBlocks(Seq& s, int computed) {
  if (!config_.prefix_caching) return;
  const int bs = config_.scheduler.block_size;
  const absl::Span<const int32_t> root =
      model_->config().encoder_decoder ? absl::MakeConstSpan(s.req.prompt) : absl::Span<const int32_t>();
  const absl::Span<const int32_t> tokens(s.tokens);
  for (int b = static_cast<int>(s.chain.size()); b < computed / bs; ++b) {
    const PrefixCursor at = b == 0 ? BlockAllocator::Root(root) : s.chain.back();
    s.chain.push_back(allocator_.Register(at, s.blocks[b], tokens.subspan(b * bs, bs), root));
  }
}

int Engine::SharedBlocks(const Seq& s) const {
  int shared = 0;
  for (int32_t b : s.blocks) shared += allocator_.ref_count(b) > 1 ? 1 : 0;
  for (int32_t b : s.cross_blocks) shared += allocator_.ref_count(b) > 1 ? 1 : 0;
  return shared;
}

void Engine::Reap(absl::Time now) {
  // Followers orphaned by a finished leader queue first; they recompute what they would have shared.
  for (auto it = orphans_.rbegin(); it != orphans_.rend(); ++it) waiting_.push_front(std::move(*it));
  orphans_.clear();
  // Cancelled and expired requests leave first; their blocks are free for this step.
  // A passed deadline wins over a cancel: the client's own deadline also cancels its call, and how
  // that cancel is told apart from the client's choice depends on timing (service.cc).
  auto reap = [&](Seq& s) {
    const RequestHandle* cancelled = s.handle->cancel_requested() ? s.handle.get() : nullptr;
    if (s.beam != nullptr && !s.done) {
      for (const auto& h : s.beam->handles) {
        if (cancelled == nullptr && h->cancel_requested()) cancelled = h.get();
      }
    }
    if (now >= s.req.deadline) {
      Finish(s, FinishReason::kDeadline, absl::DeadlineExceededError("deadline passed"));
    } else if (cancelled != nullptr) {
      const FinishReason why = cancelled->cancel_reason();
      Finish(s, why, why == FinishReason::kDeadline ? absl::DeadlineExceededError("deadline passed") : absl::OkStatus());
    }
    // A sequence of the step in flight stays until it lands (its row there is then ignored).
    return s.done && s.in_flight == 0;
  };
  running_.erase(std::remove_if(running_.begin(), running_.end(), [&](auto& s) { return reap(*s); }),
                 running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), [&](auto& s) { return reap(*s); }),
                 waiting_.end());
  // Reaped leaders orphaned their followers just now: they wait at the front (reaped next step if
  // cancelled too).
  for (auto it = orphans_.rbegin(); it != orphans_.rend(); ++it) waiting_.push_front(std::move(*it));
  orphans_.clear();
}

bool Engine::Plan(absl::Time now, StepBatch* b) {
  const bool enc_dec = model_->config().encoder_decoder;
  const int bs = config_.scheduler.block_size;
  auto sched = [&](const Seq& s) {
    SchedSeq q{s.id, static_cast<int>(s.tokens.size()), s.num_computed, static_cast<int>(s.blocks.size()),
               enc_dec ? static_cast<int>(s.req.prompt.size()) : 0, static_cast<int>(s.cross_blocks.size())};
    q.shared_blocks = SharedBlocks(s);
    return q;
  };
  std::vector<SchedSeq> run, wait;
  // With a step in flight, the sequences that end when it lands (finished, scored, at
  // max_new_tokens) have nothing to run; with none in flight, every running sequence is runnable.
  for (const auto& s : running_) {
    if (s->Runnable() || s->Idle()) run.push_back(sched(*s));
  }
  // Only the queue's head can be admitted this step (at most max_num_seqs - running of it): only
  // those look their prompt up in the prefix cache.
  // (At least the head: when idle beams fill every place, the scheduler may preempt them for it.)
  const size_t window = std::max<int>(1, config_.scheduler.max_num_seqs - static_cast<int>(run.size()));
  for (size_t i = 0; i < waiting_.size() && wait.size() < window; ++i) {
    Seq& s = *waiting_[i];
    if (!s.Runnable()) continue;  // a beam waiting for its siblings (after a preemption)
    LookupPrefix(s);
    SchedSeq q = sched(s);
    if (s.blocks.empty()) {
      q.num_computed = static_cast<int>(s.hits.size()) * bs;
      q.num_blocks = static_cast<int>(s.hits.size());
      for (int32_t h : s.hits) q.cached_blocks += allocator_.ref_count(h) == 0 ? 1 : 0;
    }
    wait.push_back(q);
  }
  b->plan = ComputeSchedule(run, wait, allocator_.num_free(), config_.scheduler);
  const relgen::Schedule& plan = b->plan;
  // Preemption frees blocks and rewinds sequences: never under a step in flight.
  if (!plan.preempted.empty() && in_flight_ != nullptr) return false;

  // Preempted sequences (newest first) go back to the front of the queue, oldest first, and will
  // recompute their prompt and output so far (from the prefix cache where it still holds them).
  for (int64_t id : plan.preempted) {
    auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r->id == id; });
    if (it == running_.end() || (*it)->in_flight > 0) std::abort();  // nothing is in flight (above)
    std::unique_ptr<Seq> s = std::move(*it);
    running_.erase(it);
    allocator_.Free(&s->blocks);
    allocator_.Free(&s->cross_blocks);  // the input is encoded again on readmission
    s->chain.clear();
    s->num_computed = 0;
    s->scores.clear();
    if (!s->prompt_lps_delivered) s->prompt_lps.clear();
    waiting_.push_front(std::move(s));
  }
  for (const ScheduledChunk& c : plan.chunks) {
    if (c.admitted) {
      // First come, first served among the runnable (beams waiting for their siblings are passed over).
      auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const auto& w) { return w->id == c.id; });
      if (it == waiting_.end()) std::abort();
      std::unique_ptr<Seq> s = std::move(*it);
      waiting_.erase(it);
      if (s->scheduled == absl::InfinitePast()) s->scheduled = now;
      if (s->beam != nullptr && s->beam->scheduled == absl::InfinitePast()) s->beam->scheduled = now;
      running_.push_back(std::move(s));
      b->seqs.push_back(running_.back().get());
    } else {
      for (auto& s : running_) {
        if (s->id == c.id) b->seqs.push_back(s.get());
      }
    }
  }
  // Admitted sequences take their prefix-cache hits before anything is allocated, so no allocation
  // evicts a block a later admission counted on.
  for (size_t i = 0; i < b->seqs.size(); ++i) {
    Seq& s = *b->seqs[i];
    if (!plan.chunks[i].admitted) continue;
    if (config_.prefix_caching && s.blocks.empty()) {
      const int hit = static_cast<int>(s.hits.size()) * bs;
      b->queried += static_cast<int64_t>(s.tokens.size());
      b->hit_tokens += hit;
      if (config_.observer) config_.observer->OnPrefixCache(static_cast<int>(s.tokens.size()), hit);
      allocator_.Share(s.hits, &s.blocks);
      s.num_computed = hit;
    }
    s.hits.clear();
  }
  for (size_t i = 0; i < b->seqs.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    if (!allocator_.Allocate(c.new_blocks, &b->seqs[i]->blocks)) std::abort();  // planned
    if (!allocator_.Allocate(c.encoder_blocks, &b->seqs[i]->cross_blocks)) std::abort();
  }
  return true;
}

void Engine::BuildInputs(StepBatch* b) {
  const bool enc_dec = model_->config().encoder_decoder;
  int rows = 0;
  for (size_t i = 0; i < b->seqs.size(); ++i) {
    Seq& s = *b->seqs[i];
    const int n = b->plan.chunks[i].num_tokens;
    SequenceStep st;
    st.tokens = absl::MakeConstSpan(s.tokens).subspan(s.num_computed, n);
    st.start_pos = s.num_computed;
    st.block_table = s.blocks;
    if (s.pending_pos >= 0) {
      // The last token is the draw of the step in flight (the only placeholder, always last).
      if (s.pending_pos != s.num_computed + n - 1) std::abort();
      st.fed_query = s.pending_query;
    }
    // Rows before the chunk's last are needed for prompt log-probabilities and scores.
    st.all_logits = s.LogitsFrom() < s.num_computed + n - 1;
    if (enc_dec) {
      st.encoder_len = static_cast<int>(s.req.prompt.size());
      st.cross_block_table = s.cross_blocks;
      if (b->plan.chunks[i].encoder_blocks > 0) {
        st.encoder_tokens = s.req.prompt;
        b->encoder_tokens += st.encoder_len;
      }
    }
    b->steps.push_back(st);
    b->step_tokens += n;
    const int drawn = s.beam != nullptr ? s.beam->search.generated() : s.drawn;
    if (s.num_computed + n < static_cast<int>(s.tokens.size()) || n > 1 || drawn == 0) b->prefill_tokens += n;
    b->lengths.push_back(static_cast<int>(s.tokens.size()));
    b->ends.push_back(s.num_computed + n);

    // What the sequence wants of its rows: row k predicts token first + k + 1.
    b->first_query.push_back(static_cast<int>(b->queries.size()));
    const int first = st.all_logits ? s.num_computed : s.num_computed + n - 1;
    const int count = st.all_logits ? n : 1;
    const int prompt = static_cast<int>(s.req.prompt.size());
    const bool want_prompt_lps = s.req.prompt_logprobs >= 0 && !s.prompt_lps_delivered;
    int prompt_lps = static_cast<int>(s.prompt_lps.size()), scores = static_cast<int>(s.scores.size());
    for (int k = 0; k < count; ++k) {
      const int next = first + k + 1;
      RowQuery q;
      q.row = rows + k;
      if (want_prompt_lps && next < prompt && next == prompt_lps + 1) {
        q.token = s.tokens[next];
        q.top_n = s.req.prompt_logprobs;
        b->queries.push_back(q);
        b->uses.push_back(StepBatch::Use::kPromptLogprob);
        ++prompt_lps;
      }
      if (s.score_from >= 0 && next >= s.score_from && next < static_cast<int>(s.tokens.size()) &&
          next - s.score_from == scores) {
        q.token = s.tokens[next];
        q.top_n = std::max(s.req.sampling.logprobs, 0);
        b->queries.push_back(q);
        b->uses.push_back(StepBatch::Use::kScore);
        ++scores;
      }
    }
    if (s.num_computed + n >= static_cast<int>(s.tokens.size()) && s.score_from < 0) {
      RowQuery q;
      q.row = rows + count - 1;
      q.params = &s.req.sampling;
      q.history = s.tokens;
      q.index = s.drawn;
      if (s.pending_pos >= 0) q.fed_query = s.pending_query;
      if (s.beam != nullptr) {
        q.index = s.beam->search.generated();
        q.beam = s.beam->search.candidates_per_beam();
      }
      b->queries.push_back(q);
      b->uses.push_back(s.beam != nullptr ? StepBatch::Use::kBeam : StepBatch::Use::kDraw);
    }
    rows += count;
  }
  b->first_query.push_back(static_cast<int>(b->queries.size()));
}

absl::Status Engine::Failed(const absl::Status& st) {
  const absl::Status broken = backend_->Broken();
  std::fprintf(stderr, "relgen: forward failed: %s%s\n", std::string(st.message()).c_str(),
               broken.ok() ? "" : " (the device is broken)");
  if (broken.ok()) return st;
  // Failed before anyone hears of it: a client that sees its request fail finds Failure() set.
  absl::Status failure =
      absl::UnavailableError(absl::StrCat("the device failed (", broken.message(), "); the server must restart"));
  std::unique_lock<std::mutex> lock(mu_);
  failure_ = failure;
  return failure;
}

absl::Status Engine::Launch(StepBatch* b) {
  if (absl::Status st = backend_->Launch(b->steps, b->queries); !st.ok()) return Failed(st);
  // The step's K/V count as computed from here, and its draws hold placeholders until it lands.
  b->placeholders.assign(b->seqs.size(), -1);
  for (size_t i = 0; i < b->seqs.size(); ++i) {
    Seq& s = *b->seqs[i];
    s.num_computed = b->ends[i];
    ++s.in_flight;
    for (int q = b->first_query[i]; q < b->first_query[i + 1]; ++q) {
      if (b->uses[q] != StepBatch::Use::kDraw) continue;
      s.tokens.push_back(0);
      s.pending_pos = b->placeholders[i] = static_cast<int>(s.tokens.size()) - 1;
      s.pending_query = q;
      ++s.drawn;
    }
  }
  return absl::OkStatus();
}

absl::Duration Engine::Land(StepBatch& b) {
  const auto asked = std::chrono::steady_clock::now();
  absl::Status st = backend_->Collect(&b.answers);
  const absl::Duration waited = absl::FromChrono(std::chrono::steady_clock::now() - asked);
  if (st.ok() && b.answers.size() != b.queries.size()) {
    st = absl::InternalError(absl::StrCat("the backend answered ", b.answers.size(), " of ", b.queries.size(), " rows"));
  }
  if (!st.ok()) st = Failed(st);
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    Seq& s = *b.seqs[i];
    --s.in_flight;
    const int at = b.placeholders[i];
    if (at < 0) continue;
    for (int q = b.first_query[i]; st.ok() && q < b.first_query[i + 1]; ++q) {
      if (b.uses[q] == StepBatch::Use::kDraw) s.tokens[at] = b.answers[q].token;
    }
    if (s.pending_pos == at) s.pending_pos = s.pending_query = -1;  // no later step launched it
  }
  Commit(b, st);
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](auto& s) { return s->done && s->in_flight == 0; }),
                 running_.end());
  Account(&b);
  return waited;
}

void Engine::Commit(StepBatch& b, const absl::Status& st) {
  const int bs = config_.scheduler.block_size;
  std::vector<std::unique_ptr<Seq>> started;  // followers starting this step
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    Seq& s = *b.seqs[i];
    if (s.done) continue;  // finished while the step was in flight: its rows are moot
    if (!st.ok()) {
      Finish(s, FinishReason::kError, st);
      continue;
    }
    const SampleResult* draw = nullptr;
    for (int q = b.first_query[i]; q < b.first_query[i + 1]; ++q) {
      switch (b.uses[q]) {
        case StepBatch::Use::kPromptLogprob: s.prompt_lps.push_back(std::move(b.answers[q])); break;
        case StepBatch::Use::kScore: s.scores.push_back(std::move(b.answers[q])); break;
        case StepBatch::Use::kDraw:
        case StepBatch::Use::kBeam: draw = &b.answers[q]; break;
      }
    }
    const int end = b.ends[i];
    RegisterBlocks(s, end);
    if (!s.followers.empty() && end >= s.fork_tokens) {
      // The group's other members start now, holding the leader's blocks before fork_tokens.
      const int shared = s.fork_tokens / bs;
      for (auto& f : s.followers) {
        allocator_.Share(absl::MakeConstSpan(s.blocks).first(shared), &f->blocks);
        allocator_.Share(s.cross_blocks, &f->cross_blocks);
        f->num_computed = s.fork_tokens;
        f->chain.assign(s.chain.begin(), s.chain.begin() + std::min<size_t>(shared, s.chain.size()));
        started.push_back(std::move(f));
      }
      s.followers.clear();
    }
    if (end < b.lengths[i]) continue;  // prompt not done yet
    if (s.score_from >= 0) {
      Finish(s, FinishReason::kLength);
      continue;
    }
    if (draw == nullptr) std::abort();  // BuildInputs asks for a draw exactly here
    if (s.beam != nullptr) {
      AnswerBeam(s, *draw);
      continue;
    }
    if (draw->token < 0) {
      EndBanned(s);
      continue;
    }
    EmitToken(s, *draw);
  }
  for (auto it = started.rbegin(); it != started.rend(); ++it) waiting_.push_front(std::move(*it));
  for (auto it = forks_.rbegin(); it != forks_.rend(); ++it) waiting_.push_front(std::move(*it));
  forks_.clear();
}

void Engine::Step(bool plan) {
  // Host time is read on a monotonic clock; absl::Now() (wall time) is for deadlines and the
  // requests' timings.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  absl::Duration wait;   // blocked in the landings' Collect calls
  bool landed = false;
  absl::Duration landed_in_plan;  // a landing forced by a preemption, not part of the plan's time
  // Taken in before `now` is read, so that no request is scheduled before it was submitted.
  if (plan) TakeInbox();
  const absl::Time now = absl::Now();
  auto next = std::make_unique<StepBatch>();
  if (plan) {
    Reap(now);
    if (!Plan(now, next.get())) {
      // It would preempt: the step in flight lands first, then the plan is made again.
      std::unique_ptr<StepBatch> b = std::move(in_flight_);
      const Clock::time_point landing = Clock::now();
      wait += Land(*b);
      landed = true;
      landed_in_plan = absl::FromChrono(Clock::now() - landing);
      Reap(now);
      next = std::make_unique<StepBatch>();
      if (!Plan(now, next.get())) std::abort();  // nothing is in flight now
    }
    BuildInputs(next.get());
    AccountPlan(*next);
  }
  absl::Status st;
  const bool launching = !next->steps.empty();
  if (launching) st = Launch(next.get());
  const Clock::time_point launched = Clock::now();
  // The step in flight lands while the one just launched runs.
  if (in_flight_ != nullptr && backend_->Broken().ok()) {
    std::unique_ptr<StepBatch> b = std::move(in_flight_);
    wait += Land(*b);
    landed = true;
  }
  if (launching && !st.ok()) {
    Commit(*next, st);
  } else if (launching && config_.overlap_steps && config_.background_thread && backend_->asynchronous()) {
    in_flight_ = std::move(next);
  } else if (launching) {
    wait += Land(*next);
    landed = true;
  }
  if (!backend_->Broken().ok()) {
    // Nothing can run any more: everything outstanding fails now, and Submit refuses from here on.
    in_flight_.reset();
    absl::Status failure;
    {
      std::unique_lock<std::mutex> lock(mu_);
      failure = failure_;
    }
    if (failure.ok()) failure = absl::UnavailableError(absl::StrCat("the device failed (", backend_->Broken().message(), ")"));
    FinishAll(FinishReason::kError, failure);
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](auto& s) { return s->done && s->in_flight == 0; }),
                 running_.end());
  Account(nullptr);
  if (!launching && !landed) return;  // nothing ran: no step to time
  StepHostTimes t;
  t.step = absl::FromChrono(Clock::now() - start);
  t.plan = absl::FromChrono(launched - start) - landed_in_plan;
  t.wait = wait;
  t.land = t.step - t.plan - t.wait;  // every Collect lies within the landings, so never negative
  if (config_.observer) config_.observer->OnStepHostTimes(t);
  std::unique_lock<std::mutex> lock(mu_);
  ++stats_.host_timed_steps;
  stats_.host_times.plan += t.plan;
  stats_.host_times.wait += t.wait;
  stats_.host_times.land += t.land;
  stats_.host_times.step += t.step;
}

void Engine::AccountPlan(const StepBatch& planned) {
  if (config_.observer && !planned.plan.preempted.empty()) {
    config_.observer->OnPreemptions(static_cast<int>(planned.plan.preempted.size()));
  }
  std::unique_lock<std::mutex> lock(mu_);
  stats_.prefix_cache_queries += planned.queried;
  stats_.prefix_cache_hits += planned.hit_tokens;
  stats_.preemptions += static_cast<int64_t>(planned.plan.preempted.size());
}

void Engine::Account(const StepBatch* landed) {
  if (config_.observer && landed != nullptr) {
    if (!landed->steps.empty()) config_.observer->OnStep(static_cast<int>(landed->steps.size()), landed->step_tokens);
    if (landed->encoder_tokens > 0) config_.observer->OnEncoded(landed->encoder_tokens);
  }
  if (config_.check_invariants) {
    allocator_.CheckConsistency();
    // Every reference is held by a sequence the engine knows.
    int64_t refs = 0, held = 0;
    for (int32_t blk = 0; blk < allocator_.num_blocks(); ++blk) refs += allocator_.ref_count(blk);
    auto count = [&](const Seq& s) { held += static_cast<int64_t>(s.blocks.size() + s.cross_blocks.size()); };
    for (const auto& s : running_) count(*s);
    for (const auto& s : waiting_) count(*s);
    for (const auto& s : orphans_) count(*s);
    if (refs != held) {
      std::fprintf(stderr, "relgen: %lld KV block references, %lld held by sequences\n",
                   static_cast<long long>(refs), static_cast<long long>(held));
      std::abort();
    }
  }
  int parked = static_cast<int>(orphans_.size());
  for (const auto& s : running_) parked += static_cast<int>(s->followers.size());
  for (const auto& s : waiting_) parked += static_cast<int>(s->followers.size());
  std::unique_lock<std::mutex> lock(mu_);
  for (const auto& s : inbox_) parked += static_cast<int>(s->followers.size());
  queued_ = static_cast<int>(inbox_.size() + waiting_.size()) + parked;
  int running = 0;
  for (const auto& s : running_) running += s->done ? 0 : 1;
  stats_.num_running = running;
  stats_.num_waiting = queued_;
  stats_.kv_blocks_used = allocator_.num_used();
  stats_.kv_blocks_cached = allocator_.num_cached();
  stats_.kv_blocks_evicted = allocator_.num_evicted();
  if (landed != nullptr) {
    if (!landed->steps.empty()) {
      ++stats_.steps;
      stats_.last_step_seqs = static_cast<int>(landed->steps.size());
      stats_.last_step_tokens = landed->step_tokens;
    }
    stats_.prompt_tokens += landed->prefill_tokens;
    stats_.encoder_tokens += landed->encoder_tokens;
  }
  stats_.memory = backend_->memory();
}

}  // namespace relgen
