// Beam search's bookkeeping in the engine: a group's beams answer one at a time; once all have,
// the search steps and the engine forks, continues and drops beams (their KV blocks) as it says,
// or delivers the search's result. The search itself (scores, hypotheses) is BeamSearch's.
#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/core/engine.h"
#include "engine/core/sequence.h"

namespace relgen {

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
    f->adapter_id = par.adapter_id;
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
      // Decode()'s text, a piece per token (Decode is the concatenation of a stream's pieces).
      std::unique_ptr<StreamDecoder> detok =
          g.skip_special_tokens ? tokenizer_->NewStream() : tokenizer_->NewStreamWithSpecials();
      for (int32_t t : h.tokens) o.token_text.push_back(detok->Push(t));
      if (!o.token_text.empty()) o.token_text.back() += detok->Finish();
      for (const std::string& piece : o.token_text) o.text += piece;
      o.finish_reason = h.ended ? FinishReason::kEos : FinishReason::kLength;
      o.generated_tokens = static_cast<int>(h.tokens.size());
      o.beam_score = h.score;
    } else if (reason == FinishReason::kNone) {
      o.finish_reason = FinishReason::kStop;  // fewer hypotheses than asked for (every token banned)
    }
    if (j == 0) Observe(o.finish_reason, o.status.code(), prompt_tokens, generated, timing, g.adapter_id);
    g.handles[j]->Deliver(std::move(o));
  }
}

}  // namespace relgen
