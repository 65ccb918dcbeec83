#include "engine/backends/host_launch.h"

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace relgen {

absl::Status HostLaunch::Launch(const Forward& forward, absl::Span<const SequenceStep> steps,
                                absl::Span<const RowQuery> queries, const ParallelFor& row_parallel) {
  if (outstanding_.size() >= 2) return absl::FailedPreconditionError("two launches are outstanding; collect one first");
  const std::vector<int32_t>& draws = last_draws_;  // of the previous launch that succeeded
  auto fed = [&](int q) -> absl::StatusOr<int32_t> {
    if (q < 0 || q >= static_cast<int>(draws.size()) || draws[q] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("a token fed from query ", q, " of the previous launch, which had ",
                                                     draws.size(), " queries; a fed token must be one of their draws"));
    }
    return draws[q];
  };
  // The inputs with their fed tokens in place.
  std::vector<SequenceStep> in(steps.begin(), steps.end());
  std::vector<RowQuery> qs(queries.begin(), queries.end());
  fed_tokens_.clear();
  auto substitute = [&](absl::Span<const int32_t>* span, int q) -> absl::Status {
    absl::StatusOr<int32_t> t = fed(q);
    if (!t.ok()) return t.status();
    if (span->empty()) return absl::InvalidArgumentError("a fed token with nothing to replace");
    std::vector<int32_t>& copy = fed_tokens_.emplace_back(span->begin(), span->end());
    copy.back() = *t;
    *span = copy;
    return absl::OkStatus();
  };
  for (SequenceStep& s : in) {
    if (s.fed_query >= 0) {
      if (absl::Status st = substitute(&s.tokens, s.fed_query); !st.ok()) return st;
    }
  }
  for (RowQuery& q : qs) {
    if (q.fed_query >= 0) {
      if (absl::Status st = substitute(&q.history, q.fed_query); !st.ok()) return st;
    }
  }
  absl::Status st = forward(in, &logits_);
  if (!st.ok()) return st;
  const int rows = RowsOf(in);
  const int vocab = rows > 0 ? static_cast<int>(logits_.size() / rows) : 0;
  std::vector<SampleResult> results;
  AnswerQueries(logits_.data(), vocab, qs, &results, row_parallel);
  last_draws_.assign(qs.size(), -1);
  for (size_t i = 0; i < qs.size(); ++i) {
    // A draw whose controls banned every token (-1) ends its sequence: what is fed in its place
    // to a step launched meanwhile is moot (0, as on the device).
    if (qs[i].params != nullptr) last_draws_[i] = std::max(results[i].token, 0);
  }
  outstanding_.push_back(std::move(results));
  return absl::OkStatus();
}

absl::Status HostLaunch::Collect(std::vector<SampleResult>* results) {
  if (outstanding_.empty()) return absl::FailedPreconditionError("nothing launched to collect");
  *results = std::move(outstanding_.front());
  outstanding_.pop_front();
  return absl::OkStatus();
}

}  // namespace relgen
