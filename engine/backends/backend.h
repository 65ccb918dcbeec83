// The device-independent interface the engine drives. One Backend per model; it is owned and
// called by a single thread (the engine thread); it is not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backends/kv_pool.h"
#include "engine/backends/sampler.h"
#include "engine/model/lora.h"

namespace relgen {

// New tokens of one sequence for one forward call, at positions start_pos.. of the sequence.
// `block_table` lists the pool blocks holding positions 0.. (enough for start_pos + tokens);
// positions 0..start_pos-1 must already be there from earlier calls.
struct SequenceStep {
  absl::Span<const int32_t> tokens;
  int start_pos = 0;
  absl::Span<const int32_t> block_table;
  bool all_logits = false;  // logits for every new token, else for the last one only
  // Encoder-decoder models. The input's encoder output has encoder_len tokens, whose cross-attention
  // K/V (every decoder layer's) live in the pool blocks of `cross_block_table`, positions 0.. as in
  // `block_table`. `encoder_tokens` is the input when this step must encode it (the step that admits
  // the sequence): its K/V are written before the decoder tokens attend to them. Empty otherwise.
  absl::Span<const int32_t> encoder_tokens;
  int encoder_len = 0;
  absl::Span<const int32_t> cross_block_table;
  // >= 0: the last token is the one the previous Launch drew for its query `fed_query`, and its
  // value in `tokens` is a placeholder. The backend takes it where that answer is, so a step can be
  // launched before the previous step's answers reach the host.
  int fed_query = -1;
  // The LoRA adapter the sequence runs under (its decoder and, encoder-decoder, its encoder), or
  // null for the base alone. The caller keeps it alive while the step may run.
  const LoraAdapter* adapter = nullptr;
};

// Bytes a backend holds, by kind.
struct BackendMemory {
  int64_t weights = 0;
  int64_t kv_cache = 0;
  int64_t activations = 0;
};

// Checks what every backend requires of a step: tokens present and in the vocabulary, positions
// inside the sequence's blocks and the model's context, blocks inside the pool.
absl::Status ValidateSteps(absl::Span<const SequenceStep> steps, int vocab_size, int max_seq_len,
                           const KvCacheConfig& kv, bool encoder_decoder = false);

// Logits rows a step over `steps` computes (the rows its queries name).
int RowsOf(absl::Span<const SequenceStep> steps);

// What a backend is and holds, for the startup line, the stats and the metrics.
struct BackendInfo {
  std::string name;    // "cpu" or "cuda"
  std::string device;  // "cpu", or "cuda:N"
  // The paged KV pool the backend allocated at creation.
  KvCacheConfig kv_cache;
  // As of the call: the activations' buffers grow with the largest step so far.
  BackendMemory memory;
  // What the backend computes from: "f32", "bf16" or "int8" weights; "f32" or "bf16" K/V.
  std::string weights_dtype;
  std::string kv_cache_dtype;
  // How the projections multiply, for the startup line: e.g. "avx512-vnni int8 dot products",
  // "invariant projections".
  std::string projections;
  // Whether a row's logits are the same bits whatever rows share its step (every backend but cuBLAS's
  // projections, which pick their algorithm by the problem's shape).
  bool batch_invariant = true;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendInfo Describe() const = 0;
  // Runs the decoder over every step's tokens (one batch), writes their K/V into the pool and
  // answers `queries` from the logits rows, rows in step order (all tokens or last only; RowsOf):
  // drawn tokens, given tokens' log-probabilities (sampler.h); Collect returns the answers, in query
  // order. A prompt, a chunk of a prompt and a single decode token are all steps. Only the answers
  // leave the backend. Launch reads `steps` and `queries` only before it returns. A step may be
  // launched before the previous one is collected (at most two outstanding; its fed tokens come
  // from that one); Collect answers the oldest outstanding launch.
  virtual absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) = 0;
  virtual absl::Status Collect(std::vector<SampleResult>* results) = 0;
  // Whether Launch returns before its work is done (a device's stream). A synchronous backend's
  // Launch does it all, so launching the next step before collecting gains nothing.
  virtual bool asynchronous() const { return false; }
  // Non-OK once the device can run nothing more (a GPU's asynchronous fault leaves its context
  // broken until the process ends): every later Launch would fail. Asked after a failed Launch or Collect.
  virtual absl::Status Broken() const { return absl::OkStatus(); }
  // LoRA: at most `max_loras` adapters resident at once (a step never names more), none of rank over
  // `max_rank`. Called once, before the first Launch; a backend that applies none refuses.
  virtual absl::Status ConfigureLora(int max_loras, int max_rank) {
    return absl::UnimplementedError("this backend does not apply LoRA adapters");
  }
};

// Which LoRA adapter each of a backend's resident slots holds and the step that last used it: the
// least-recently-used choice both backends make.
class LoraResidency {
 public:
  void Reset(int slots) { held_.assign(slots, Held{}); }
  // Starts a step: the slot of each step's adapter (-1: none). An adapter not resident takes a free
  // slot, else the least recently used one that no adapter of this step holds, and `load(slot,
  // adapter)` fills it (the slot is empty if that fails). A step naming more adapters than there
  // are slots is refused.
  absl::StatusOr<std::vector<int>> Assign(absl::Span<const SequenceStep> steps,
                                          const std::function<absl::Status(int, const LoraAdapter&)>& load);
  // Whether slot `s` serves the step Assign last started.
  bool InStep(int s) const { return held_[s].used == step_; }

 private:
  struct Held {
    const LoraAdapter* adapter = nullptr;
    uint64_t used = 0;  // the step that last used it
  };
  std::vector<Held> held_;
  uint64_t step_ = 0;
};

}  // namespace relgen
