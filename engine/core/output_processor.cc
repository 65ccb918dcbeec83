#include "engine/core/output_processor.h"

#include <algorithm>
#include <utility>

namespace relgen {

TextStream::TextStream(std::unique_ptr<StreamDecoder> detok, StopCriteria stop, int min_tokens, int32_t eos_token_id)
    : detok_(std::move(detok)), stop_(std::move(stop)), min_tokens_(min_tokens), eos_(eos_token_id) {}

TextDelta TextStream::Append(int32_t token) {
  ++tokens_;
  TextDelta d;
  d.piece = detok_->Push(token);
  held_ += d.piece;

  size_t cut = std::string::npos;  // earliest stop string in the held text (from min_tokens on)
  if (tokens_ >= min_tokens_) {
    for (const std::string& stop : stop_.stop_strings) cut = std::min(cut, held_.find(stop));
  }
  if (cut != std::string::npos) {
    d.text = held_.substr(0, cut);
    held_.clear();
    d.finish = FinishReason::kStop;
    return d;
  }
  if (token == eos_ && !stop_.ignore_eos) {
    d.finish = FinishReason::kEos;
  } else if (std::find(stop_.stop_token_ids.begin(), stop_.stop_token_ids.end(), token) != stop_.stop_token_ids.end()) {
    d.finish = FinishReason::kStop;
  } else if (tokens_ >= stop_.max_new_tokens) {
    d.finish = FinishReason::kLength;
  }
  if (d.finish != FinishReason::kNone) {
    const std::string rest = detok_->Finish();
    d.piece += rest;
    d.text = std::move(held_) + rest;
    held_.clear();
    return d;
  }
  const size_t keep = Holdback();
  d.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return d;
}

std::string TextStream::Flush() {
  std::string text = std::move(held_) + detok_->Finish();
  held_.clear();
  return text;
}

size_t TextStream::Holdback() const {
  size_t keep = 0;
  for (const std::string& stop : stop_.stop_strings) {
    for (size_t k = std::min(stop.size() - 1, held_.size()); k > keep; --k) {
      if (held_.compare(held_.size() - k, k, stop, 0, k) == 0) {
        keep = k;
        break;
      }
    }
  }
  return keep;
}

}  // namespace relgen
