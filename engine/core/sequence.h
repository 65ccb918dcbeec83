// The engine's own records, shared by its source files: a sequence, a beam-search group and a
// step's batch. Engine-internal; clients see RequestHandle only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "engine/core/engine.h"
#include "engine/core/output_processor.h"

namespace relgen {

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
  std::unique_ptr<TextStream> text;  // generating: its text and stop rules
  bool done = false;
  absl::Time submitted, scheduled = absl::InfinitePast(), first_token = absl::InfinitePast();
  absl::Time last_token = absl::InfinitePast();

  bool follower = false;  // a later sample or continuation of a group (its prompt is the leader's)
  // Scoring: tokens[score_from..] are the continuation, scored and never sampled; -1 when generating.
  int score_from = -1;
  std::vector<SampleResult> scores;        // one per continuation token computed so far
  // max_new_tokens 0: the prompt alone (score_from past its end, so nothing is scored or drawn),
  // its log-probabilities delivered with the end.
  bool prompt_only = false;
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
  // LoRA: the adapter's EngineConfig::adapters index + 1, 0 for the base (Engine::Adapter).
  int adapter_id = 0;

  // First token whose logits are needed (its row predicts the next token): nothing before it may come
  // from the prefix cache, which holds K/V and no logits.
  int LogitsFrom() const {
    if (req.prompt_logprobs >= 0 && !prompt_lps_delivered) return 0;
    if (score_from >= 0) return score_from - 1;
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
  int adapter_id = 0;                            // the request's (for its books)
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

}  // namespace relgen
