#include "engine/backends/backend.h"

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

int RowsOf(absl::Span<const SequenceStep> steps) {
  int rows = 0;
  for (const SequenceStep& s : steps) rows += s.all_logits ? static_cast<int>(s.tokens.size()) : 1;
  return rows;
}

absl::StatusOr<std::vector<int>> LoraResidency::Assign(
    absl::Span<const SequenceStep> steps, const std::function<absl::Status(int, const LoraAdapter&)>& load) {
  ++step_;
  std::vector<int> slot(steps.size(), -1);
  for (size_t i = 0; i < steps.size(); ++i) {
    const LoraAdapter* a = steps[i].adapter;
    if (a == nullptr) continue;
    if (held_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("a step names LoRA adapter '", a->name, "', and this backend has no LoRA slots (ConfigureLora)"));
    }
    int s = -1;
    for (size_t j = 0; j < held_.size() && s < 0; ++j) s = held_[j].adapter == a ? static_cast<int>(j) : -1;
    if (s < 0) {
      for (size_t j = 0; j < held_.size(); ++j) {
        if (held_[j].used == step_) continue;  // another adapter of this step
        if (held_[j].adapter == nullptr) {
          s = static_cast<int>(j);
          break;
        }
        if (s < 0 || held_[j].used < held_[s].used) s = static_cast<int>(j);
      }
      if (s < 0) {
        return absl::InvalidArgumentError(absl::StrCat("a step names more LoRA adapters than the ", held_.size(),
                                                       " resident slots (max_loras)"));
      }
      held_[s].adapter = nullptr;
      if (absl::Status st = load(s, *a); !st.ok()) return st;
      held_[s].adapter = a;
    }
    held_[s].used = step_;
    slot[i] = s;
  }
  return slot;
}

}  // namespace relgen
