#include "engine/core/scheduler.h"

#include <algorithm>
#include <vector>

#include "engine/core/kv_cache.h"

namespace relgen {

Schedule ComputeSchedule(absl::Span<const SchedSeq> running, absl::Span<const SchedSeq> waiting,
                         int free_blocks, const SchedulerConfig& config) {
  Schedule out;
  int budget = config.max_batch_tokens;
  int free = free_blocks;
  int last = static_cast<int>(running.size()) - 1;  // newest running sequence not yet preempted
  auto idle = [](const SchedSeq& s) { return s.num_tokens == s.num_computed; };
  auto frees = [](const SchedSeq& s) { return s.num_blocks + s.encoder_blocks - s.shared_blocks; };
  std::vector<bool> gone(running.size(), false);  // idle ones preempted from before `last`
  for (int i = 0; i <= last && budget > 0; ++i) {
    const SchedSeq& s = running[i];
    if (idle(s) || gone[i]) continue;
    const int chunk = std::min(s.num_tokens - s.num_computed, budget);
    const int need = BlocksForTokens(s.num_computed + chunk, config.block_size) - s.num_blocks;
    while (need > free && last > i) {
      if (!gone[last]) {
        out.preempted.push_back(running[last].id);
        free += frees(running[last]);
      }
      --last;
    }
    for (int j = i - 1; need > free && j >= 0; --j) {  // idle older ones
      if (!idle(running[j]) || gone[j]) continue;
      gone[j] = true;
      out.preempted.push_back(running[j].id);
      free += frees(running[j]);
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
  if (out.chunks.empty() && !waiting.empty()) {
    // Nothing computes: idle sequences make room for the queue's head (admitted next step).
    const SchedSeq& w = waiting.front();
    const int chunk = std::min(w.num_tokens - w.num_computed, budget);
    const int need = BlocksForTokens(w.num_computed + chunk, config.block_size) - w.num_blocks + w.cached_blocks +
                     (w.encoder_blocks > 0 ? 0 : BlocksForTokens(w.encoder_tokens, config.block_size));
    int slots = static_cast<int>(running.size());
    std::vector<int64_t> make_room;
    for (int j = static_cast<int>(running.size()) - 1; j >= 0 && (need > free || slots >= config.max_num_seqs); --j) {
      if (!idle(running[j])) continue;
      make_room.push_back(running[j].id);
      free += frees(running[j]);
      --slots;
    }
    if (!make_room.empty() && need <= free && slots < config.max_num_seqs) {
      out.preempted = std::move(make_room);
      return out;
    }
    free = free_blocks;
  }

  int num_running = static_cast<int>(running.size());
  int encoder_budget = config.max_encoder_tokens;
  std::vector<int> adapters;  // distinct, of the running sequences and those admitted
  for (const SchedSeq& s : running) {
    if (s.adapter != 0 && std::find(adapters.begin(), adapters.end(), s.adapter) == adapters.end()) {
      adapters.push_back(s.adapter);
    }
  }
  for (const SchedSeq& w : waiting) {
    if (budget <= 0 || num_running >= config.max_num_seqs) break;
    // Another adapter than those running waits for a slot (first come, first served still).
    const bool new_adapter = w.adapter != 0 && std::find(adapters.begin(), adapters.end(), w.adapter) == adapters.end();
    if (new_adapter && static_cast<int>(adapters.size()) >= config.max_loras) break;
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
    if (new_adapter) adapters.push_back(w.adapter);
    out.chunks.push_back({w.id, chunk, need, true, cross});
  }
  return out;
}

}  // namespace relgen
