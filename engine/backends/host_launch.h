// Launch and Collect for a backend whose forward is synchronous and whose answers are drawn on the
// host (the CPU backend): the whole step runs in Launch, and Collect hands back what it answered.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/backends/backend.h"
#include "engine/backends/sampler.h"

namespace relgen {

class HostLaunch {
 public:
  // Writes the logits rows of `steps` (RowsOf) to `logits`, [rows, vocab].
  using Forward = std::function<absl::Status(absl::Span<const SequenceStep> steps, std::vector<float>* logits)>;

  // Backend::Launch over `forward`; `row_parallel` spreads the answering over rows (null: in order
  // on the calling thread).
  absl::Status Launch(const Forward& forward, absl::Span<const SequenceStep> steps,
                      absl::Span<const RowQuery> queries, const ParallelFor& row_parallel = nullptr);
  absl::Status Collect(std::vector<SampleResult>* results);

 private:
  // The logits rows, the answers not yet collected (oldest first), the last launch's drawn tokens
  // (what the next one's fed tokens are), and fed copies of the inputs.
  std::vector<float> logits_;
  std::deque<std::vector<SampleResult>> outstanding_;
  std::vector<int32_t> last_draws_;
  std::deque<std::vector<int32_t>> fed_tokens_;  // stable: spans point into them
};

}  // namespace relgen
