// The device-independent interface the engine drives. One Backend per model; it is owned and
// called by a single thread (the engine thread); it is not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace relgen {

// Per-sequence key/value storage of a backend. Contents are only meaningful to that backend.
class KvCache {
 public:
  virtual ~KvCache() = default;
  virtual int capacity() const = 0;  // tokens
};

// New tokens of one sequence for one forward call. Their positions are start_pos.. in the cache;
// positions 0..start_pos-1 must already be in `cache` from earlier calls.
struct SequenceStep {
  absl::Span<const int32_t> tokens;
  int start_pos = 0;
  KvCache* cache = nullptr;
  bool all_logits = false;  // logits for every new token, else for the last one only
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::string_view name() const = 0;
  virtual absl::StatusOr<std::unique_ptr<KvCache>> NewCache(int capacity_tokens) = 0;
  // Runs the decoder over every step's tokens (one batch), appends their K/V to the caches and
  // writes logits [rows, vocab_size] to `logits`, rows in step order (all tokens or last only).
  // A prompt, a chunk of a prompt and a single decode token are all steps.
  virtual absl::Status Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) = 0;
};

}  // namespace relgen
