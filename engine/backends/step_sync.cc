#include "engine/backends/step_sync.h"

#include "absl/strings/str_cat.h"

namespace relgen {

absl::Status ForwardLogits(Backend& backend, absl::Span<const SequenceStep> steps, std::vector<float>* logits) {
  auto* forward = dynamic_cast<LogitsForward*>(&backend);
  if (forward == nullptr) {
    return absl::UnimplementedError(absl::StrCat("the ", backend.Describe().name, " backend hands back no logits"));
  }
  return forward->Forward(steps, logits);
}

absl::Status RunStep(Backend& backend, absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries,
                     std::vector<SampleResult>* results) {
  if (absl::Status st = backend.Launch(steps, queries); !st.ok()) return st;
  return backend.Collect(results);
}

}  // namespace relgen
