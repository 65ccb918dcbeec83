// The scheduling decision of one engine step, as a pure function of the sequences' sizes and the
// free KV blocks, so it can be tested on its own.
//
// Policy: running sequences first, oldest admission first, each taking its next chunk (the rest of
// its prompt up to the step's token budget, or one decode token). When the KV pool cannot hold a
// sequence's next chunk, the most recently admitted running sequence is preempted (its blocks are
// freed; the engine recomputes it later) until it fits, possibly the sequence itself. Waiting
// sequences are then admitted strictly first-come first-served while the budget, the running-seq
// limit and the free blocks allow (the head of the queue is never overtaken), and not at all in a
// step that had to preempt.
//
// A running sequence with nothing to compute (num_tokens == num_computed: a beam waiting for its
// siblings' answers) takes no chunk and holds its blocks; it may be preempted whatever its age,
// once the newer ones are, for a running sequence that needs blocks. When nothing computes in a
// step and the queue's head does not fit (blocks or max_num_seqs), such idle sequences are
// preempted, newest first, until it would, and the head is admitted the next step.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace relgen {

struct SchedulerConfig {
  int max_num_seqs = 64;        // running sequences at once
  int max_batch_tokens = 512;   // tokens computed per step (prompt chunks + decode tokens)
  // Encoder-decoder models: input tokens encoded per step, a budget of its own, so admitting
  // inputs never takes the running sequences' decode tokens. An input longer than it still
  // encodes, as the step's only one.
  int max_encoder_tokens = 2048;
  int block_size = 16;
  // LoRA: the most distinct adapters among running sequences (the backend's resident slots); a
  // waiting sequence of another adapter is not admitted while that many run. 0: no adapters.
  int max_loras = 0;
};

struct SchedSeq {
  int64_t id = 0;
  int num_tokens = 0;    // tokens that must be in the cache before the next sample
  int num_computed = 0;  // tokens already in the cache
  int num_blocks = 0;    // blocks held for those tokens
  // Encoder-decoder models: the input's length. A sequence is encoded whole in the step that
  // admits it (bidirectional attention cannot be split into chunks: every position needs every
  // other), which charges encoder_tokens to that step's encoder budget (max_encoder_tokens; a
  // longer input encodes alone) and its decoder's first token to the token budget, and allocates
  // the blocks of the input's cross-attention K/V; those are held (`encoder_blocks`) until the
  // sequence finishes or is preempted.
  int encoder_tokens = 0;
  int encoder_blocks = 0;  // held; 0 while waiting (unless shared from another sequence)
  // Shared KV blocks. `shared_blocks`: of the blocks held (num_blocks + encoder_blocks), those
  // another sequence also references; preempting this one frees only the rest. `cached_blocks`
  // (waiting only): prefix-cache hits counted in num_computed and num_blocks but not yet taken;
  // taking them removes them from the free count, like allocating.
  int shared_blocks = 0;
  int cached_blocks = 0;
  int adapter = 0;  // LoRA adapter (1..), 0 the base
};

struct ScheduledChunk {
  int64_t id = 0;
  int num_tokens = 0;  // tokens to compute this step, from num_computed on
  int new_blocks = 0;  // blocks to allocate first
  bool admitted = false;  // taken from the waiting queue this step
  int encoder_blocks = 0;  // admitted encoder-decoder sequence: blocks for its input's K/V (it is encoded)
};

struct Schedule {
  std::vector<ScheduledChunk> chunks;  // running (in order), then admitted
  std::vector<int64_t> preempted;      // most recently admitted first
};

// `running` in admission order (oldest first), `waiting` in arrival order.
Schedule ComputeSchedule(absl::Span<const SchedSeq> running, absl::Span<const SchedSeq> waiting,
                         int free_blocks, const SchedulerConfig& config);

}  // namespace relgen
