#include "engine/core/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/core/sequence.h"

namespace relgen {

Engine::Engine(std::shared_ptr<const Model> model, std::unique_ptr<Backend> backend,
               std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config)
    : model_(std::move(model)),
      backend_(std::move(backend)),
      tokenizer_(std::move(tokenizer)),
      config_(config),
      allocator_(backend_->Describe().kv_cache.num_blocks, backend_->Describe().kv_cache.block_size) {
  const BackendInfo info = backend_->Describe();
  config_.scheduler.block_size = info.kv_cache.block_size;
  stats_.kv_blocks_total = allocator_.num_blocks();
  stats_.device = info.device;
  stats_.weights_dtype = info.weights_dtype;
  stats_.kv_cache_dtype = info.kv_cache_dtype;
  stats_.projections = info.projections;
  stats_.batch_invariant = info.batch_invariant;
  stats_.memory = info.memory;
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
  if (!config.adapters.empty() && config.scheduler.max_loras < 1) {
    return absl::InvalidArgumentError("LoRA adapters are registered but max_loras is 0; allowed: >= 1");
  }
  for (size_t i = 0; i < config.adapters.size(); ++i) {
    if (config.adapters[i]->name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("adapter ", i, " (", config.adapters[i]->dir,
                                                     ") has an empty name; a request names its adapter by it"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (config.adapters[i]->name == config.adapters[j]->name) {
        return absl::InvalidArgumentError(absl::StrCat("adapter name '", config.adapters[i]->name,
                                                       "' is registered twice; each name must be unique"));
      }
    }
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
  if (!r.adapter.empty() && AdapterId(r.adapter) == 0) {
    std::vector<std::string> names;
    for (const auto& a : config_.adapters) names.push_back(a->name);
    return absl::NotFoundError(absl::StrCat("adapter '", r.adapter, "' is not registered; ",
                                            names.empty() ? "this server has none (--lora_modules)"
                                                          : absl::StrCat("registered: ", absl::StrJoin(names, ", "))));
  }
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
    s->adapter_id = AdapterId(r.adapter);
    s->follower = i > 0;
    if (s->follower) s->req.prompt_logprobs = -1;
    s->tokens = c.encoder_decoder ? std::vector<int32_t>{c.decoder_start_token_id} : r.prompt;
    if (scoring) {
      s->score_from = static_cast<int>(s->tokens.size());
      s->tokens.insert(s->tokens.end(), continuations[i].begin(), continuations[i].end());
    } else if (r.stop.max_new_tokens == 0) {
      // A continuation of nothing: the prompt is computed (with its log-probabilities where asked,
      // on the rows generating computes them on) and nothing is drawn.
      s->prompt_only = true;
      s->score_from = static_cast<int>(s->tokens.size());
    } else {
      s->req.sampling.seed = r.sampling.seed + static_cast<uint64_t>(i);
    }
    s->text = std::make_unique<TextStream>(
        r.skip_special_tokens ? tokenizer_->NewStream() : tokenizer_->NewStreamWithSpecials(), r.stop,
        r.sampling.min_tokens, c.eos_token_id);
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
    g->adapter_id = group.front()->adapter_id;
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
  advance_ = 0;
  cv_.notify_all();
}

void Engine::Advance(int steps) {
  std::unique_lock<std::mutex> lock(mu_);
  advance_ += std::max(steps, 0);
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
               ((!paused_ || advance_ > 0) && (!inbox_.empty() || !running_.empty() || !waiting_.empty()));
      });
      if (stop_) break;
      in_step_ = true;
      const bool work = !inbox_.empty() || !running_.empty() || !waiting_.empty();
      plan = !paused_ || (advance_ > 0 && work);
      if (paused_ && plan) --advance_;  // only a step with work to do uses up an Advance
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

void Engine::EndBanned(Seq& s) {
  Output o;
  TakePromptLogprobs(s, &o);
  o.text = s.text->Flush();
  Finish(s, FinishReason::kStop, absl::OkStatus(), &o);
}

void Engine::TakePromptLogprobs(Seq& s, Output* o) {
  if (s.req.prompt_logprobs < 0 || s.prompt_lps_delivered) return;
  o->prompt_logprobs = std::move(s.prompt_lps);
  s.prompt_lps.clear();
  s.prompt_lps_delivered = true;
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
  TextDelta d = s.text->Append(r.token);
  Output o;
  o.token_ids.push_back(r.token);
  o.token_text.push_back(std::move(d.piece));
  o.text = std::move(d.text);
  if (s.req.sampling.logprobs >= 0) o.logprobs.push_back(r);
  TakePromptLogprobs(s, &o);
  if (d.finish != FinishReason::kNone) return Finish(s, d.finish, absl::OkStatus(), &o);
  s.handle->Deliver(std::move(o));
}

int Engine::AdapterId(const std::string& name) const {
  if (name.empty()) return 0;
  for (size_t i = 0; i < config_.adapters.size(); ++i) {
    if (config_.adapters[i]->name == name) return static_cast<int>(i) + 1;
  }
  return 0;
}

std::vector<int32_t> Engine::PrefixRoot(const Seq& s) const {
  // What the K/V depend on besides the tokens: the adapter (as a negative id, which no token is)
  // and an encoder-decoder model's input.
  std::vector<int32_t> root;
  if (s.adapter_id > 0) root.push_back(-s.adapter_id);
  if (model_->config().encoder_decoder) root.insert(root.end(), s.req.prompt.begin(), s.req.prompt.end());
  return root;
}

void Engine::LookupPrefix(Seq& s) {
  s.hits.clear();
  if (!s.blocks.empty()) return;  // a follower holds its shared blocks and their chain
  s.chain.clear();
  if (!config_.prefix_caching) return;
  const int bs = config_.scheduler.block_size;
  const std::vector<int32_t> root = PrefixRoot(s);
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
  const std::vector<int32_t> root = PrefixRoot(s);
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
    q.adapter = s.adapter_id;
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
  Enact(now, b);
  return true;
}

void Engine::Enact(absl::Time now, StepBatch* b) {
  const int bs = config_.scheduler.block_size;
  const relgen::Schedule& plan = b->plan;
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
    st.adapter = Adapter(s.adapter_id);
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

}  // namespace relgen
