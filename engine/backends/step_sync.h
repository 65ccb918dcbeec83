// Synchronous steps for tests and tools/bench: the engine drives Launch and Collect only, and only
// the answers leave a backend that way, so comparing logits with a reference needs a way past them.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/backends/backend.h"
#include "engine/backends/sampler.h"

namespace relgen {

// A backend whose step's logits rows can be had whole (every backend relgen builds).
class LogitsForward {
 public:
  virtual ~LogitsForward() = default;
  // Runs the step as Launch does (K/V written into the pool) and writes its logits rows,
  // [RowsOf(steps), vocab_size] in step order, to `logits` once they are there.
  virtual absl::Status Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) = 0;
};

// `backend`'s LogitsForward::Forward; Unimplemented where it has none.
absl::Status ForwardLogits(Backend& backend, absl::Span<const SequenceStep> steps, std::vector<float>* logits);

// Launch, then Collect.
absl::Status RunStep(Backend& backend, absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries,
                     std::vector<SampleResult>* results);

}  // namespace relgen
