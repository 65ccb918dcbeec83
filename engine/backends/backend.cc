#include "engine/backends/backend.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace relgen {

absl::Status ValidateSteps(absl::Span<const SequenceStep> steps, int vocab_size, int max_seq_len,
                           const KvCacheConfig& kv, bool encoder_decoder) {
  for (const SequenceStep& s : steps) {
    const int64_t cross_capacity = int64_t{kv.block_size} * static_cast<int64_t>(s.cross_block_table.size());
    if (!encoder_decoder && (s.encoder_len != 0 || !s.encoder_tokens.empty() || !s.cross_block_table.empty())) {
      return absl::InvalidArgumentError("a decoder-only model's step carries an encoder input");
    }
    if (encoder_decoder) {
      if (s.encoder_len < 1 || s.encoder_len > max_seq_len || s.encoder_len > cross_capacity ||
          (!s.encoder_tokens.empty() && static_cast<int>(s.encoder_tokens.size()) != s.encoder_len)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "encoder input of ", s.encoder_len, " tokens (", s.encoder_tokens.size(), " given) with ", cross_capacity,
            " cross-attention cache slots; allowed 1..", max_seq_len, " tokens, all given or none"));
      }
      for (int32_t b : s.cross_block_table) {
        if (b < 0 || b >= kv.num_blocks) {
          return absl::InvalidArgumentError(absl::StrCat("KV block ", b, " outside the pool of ", kv.num_blocks));
        }
      }
      for (int32_t t : s.encoder_tokens) {
        if (t < 0 || t >= vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("encoder token id ", t, " out of range; allowed 0..", vocab_size - 1));
        }
      }
    }
    const int n = static_cast<int>(s.tokens.size());
    if (n == 0) return absl::InvalidArgumentError("a sequence step has no tokens");
    const int64_t capacity = int64_t{kv.block_size} * static_cast<int64_t>(s.block_table.size());
    if (s.start_pos < 0 || s.start_pos + n > capacity || s.start_pos + n > max_seq_len) {
      return absl::OutOfRangeError(absl::StrCat("positions ", s.start_pos, "..", s.start_pos + n - 1,
                                                " exceed the sequence's ", capacity,
                                                " cached tokens or max_seq_len ", max_seq_len));
    }
    for (int32_t b : s.block_table) {
      if (b < 0 || b >= kv.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("KV block ", b, " outside the pool of ", kv.num_blocks));
      }
    }
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " out of range; allowed 0..", vocab_size - 1));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Backend::Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) {
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
  absl::Status st = Forward(in, &answer_logits_);
  if (!st.ok()) return st;
  const int rows = RowsOf(in);
  const int vocab = rows > 0 ? static_cast<int>(answer_logits_.size() / rows) : 0;
  std::vector<SampleResult> results;
  AnswerQueries(answer_logits_.data(), vocab, qs, &results, row_parallel());
  last_draws_.assign(qs.size(), -1);
  for (size_t i = 0; i < qs.size(); ++i) {
    // A draw whose controls banned every token (-1) ends its sequence: what is fed in its place
    // to a step launched meanwhile is moot (0, as on the device).
    if (qs[i].params != nullptr) last_draws_[i] = std::max(results[i].token, 0);
  }
  outstanding_.push_back(std::move(results));
  return absl::OkStatus();
}

absl::Status Backend::Collect(std::vector<SampleResult>* results) {
  if (outstanding_.empty()) return absl::FailedPreconditionError("nothing launched to collect");
  *results = std::move(outstanding_.front());
  outstanding_.pop_front();
  return absl::OkStatus();
}

absl::Status Backend::ForwardSample(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries,
                                    std::vector<SampleResult>* results) {
  if (absl::Status st = Launch(steps, queries); !st.ok()) return st;
  return Collect(results);
}

int RowsOf(absl::Span<const SequenceStep> steps) {
  int rows = 0;
  for (const SequenceStep& s : steps) rows += s.all_logits ? static_cast<int>(s.tokens.size()) : 1;
  return rows;
}

}  // namespace relgen
