// A request's end and the engine's books (queued_, stats_, the observer): kept apart from the
// step phases because every path that ends a request (a finish, a cancel, a deadline, a failed
// step, shutdown) goes through them, and they must agree with what clients have been sent.
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/core/engine.h"
#include "engine/core/sequence.h"

namespace relgen {

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

void Engine::Finish(Seq& s, FinishReason reason, absl::Status status, Output* last) {
  if (s.done) return;
  if (s.beam != nullptr) {
    if (last != nullptr) s.handle->Deliver(std::move(*last));
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
  if (last != nullptr) o = std::move(*last);
  o.finished = true;
  o.finish_reason = reason;
  o.status = std::move(status);
  o.prompt_tokens = static_cast<int>(s.req.prompt.size());
  o.generated_tokens = s.generated;
  if (s.score_from >= 0 && reason == FinishReason::kLength) o.logprobs = std::move(s.scores);
  if (s.prompt_only && reason == FinishReason::kLength) TakePromptLogprobs(s, &o);
  const absl::Time now = absl::Now();
  o.timing.queue = (s.scheduled == absl::InfinitePast() ? now : s.scheduled) - s.submitted;
  o.timing.time_to_first_token = s.first_token == absl::InfinitePast() ? absl::ZeroDuration() : s.first_token - s.submitted;
  o.timing.total = now - s.submitted;
  // A group's prompt counts once.
  Observe(reason, o.status.code(), s.follower ? 0 : o.prompt_tokens, o.generated_tokens, o.timing, s.adapter_id);
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
                     const RequestTiming& t, int adapter_id) {
  if (!config_.observer) return;
  RequestSummary sum;
  sum.reason = reason;
  sum.code = code;
  sum.prompt_tokens = prompt_tokens;
  sum.generated_tokens = generated;
  sum.queue = t.queue;
  sum.time_to_first_token = t.time_to_first_token;
  sum.e2e = t.total;
  if (adapter_id > 0) sum.adapter = Adapter(adapter_id)->name;
  config_.observer->OnFinished(sum);
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
  // Asked each step, and outside the lock: the activations' buffers grow with the steps.
  const BackendMemory memory = backend_->Describe().memory;
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
  stats_.memory = memory;
}

}  // namespace relgen
