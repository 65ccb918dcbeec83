#include "engine/core/scheduler.h"

#include <algorithm>

#include "engine/core/kv_cache.h"

namespace relgen {

Schedule ComputeSchedule(absl::Span<const SchedSeq> running, absl::Span<const SchedSeq> waiting,
                         int free_blocks, const SchedulerConfig& config) {
  Schedule out;
  int budget = config.max_batch_tokens;
  int free = free_blocks;
  int last = static_cast<int>(running.size()) - 1;  // newest running sequence not yet preempted
  for (int i = 0; i <= last && budget > 0; ++i) {
    const SchedSeq& s = running[i];
    const int chunk = std::min(s.num_tokens - s.num_computed, budget);
    const int need = BlocksForTokens(s.num_computed + chunk, config.block_size) - s.num_blocks;
    while (need > free && last > i) {
      out.preempted.push_back(running[last].id);
      free += running[last].num_blocks + running[last].encoder_blocks - running[last].shared_blocks;
      --last;
    }
    if (need > free) {  // even alone it cannot grow: it yields its own blocks
      out.preempted.push_back(s.id);
      --last;
      break;
    }
    free -= std::max(need, 0);
    budget -= chunk;
    out.chunks.push_back({s.id, chunk, std::max(need, 0), false});
  }
  if (!out.preempted.empty()) return out;

  int num_running = static_cast<int>(running.size());
  int encoder_budget = config.max_encoder_tokens;
  for (const SchedSeq& w : waiting) {
    if (budget <= 0 || num_running >= config.max_num_seqs) break;
    // A sequence that already holds its input's K/V (shared by the sequence it was forked from) is not
    // encoded again.
    const bool encoded = w.encoder_blocks > 0;
    const int encode = encoded ? 0 : w.encoder_tokens;
    // Within the encoder budget, or alone: a longer input waits for a step that encodes nothing else.
    if (encode > encoder_budget && encoder_budget < config.max_encoder_tokens) break;
    const int chunk = std::min(w.num_tokens - w.num_computed, budget);
    const int need = BlocksForTokens(w.num_computed + chunk, config.block_size) - w.num_blocks;
    const int cross = encoded ? 0 : BlocksForTokens(w.encoder_tokens, config.block_size);
    if (need + cross + w.cached_blocks > free) break;
    free -= need + cross + w.cached_blocks;
    budget -= chunk;
    encoder_budget -= encode;
    ++num_running;
    out.chunks.push_back({w.id, chunk, need, true, cross});
  }
  return out;
}

}  // namespace relgen
