#include "engine/core/request.h"

#include <utility>

namespace relgen {

absl::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kEos: return "eos";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kDeadline: return "deadline";
    case FinishReason::kError: return "error";
  }
  return "?";
}

// ---------------------------------------------------------------- RequestHandle

void RequestHandle::Deliver(Output&& delta) {
  std::function<void()> listener;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    Output& p = pending_;
    p.token_ids.insert(p.token_ids.end(), delta.token_ids.begin(), delta.token_ids.end());
    p.text += delta.text;
    for (std::string& t : delta.token_text) p.token_text.push_back(std::move(t));
    for (SampleResult& r : delta.logprobs) p.logprobs.push_back(std::move(r));
    for (SampleResult& r : delta.prompt_logprobs) p.prompt_logprobs.push_back(std::move(r));
    if (delta.finished) {
      p.finished = true;
      p.finish_reason = delta.finish_reason;
      p.status = delta.status;
      p.prompt_tokens = delta.prompt_tokens;
      p.generated_tokens = delta.generated_tokens;
      p.timing = delta.timing;
      p.beam_score = delta.beam_score;
      closed_ = true;
    }
    has_pending_ = true;
    listener = listener_;
  }
  readable_cv_.notify_all();
  if (listener) listener();
}

bool RequestHandle::Next(Output* out, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (drained_) return false;
  if (timeout == absl::InfiniteDuration()) {
    readable_cv_.wait(lock, [this] { return has_pending_; });
  } else if (!readable_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return has_pending_; })) {
    return false;
  }
  *out = std::move(pending_);
  pending_ = Output();
  has_pending_ = false;
  if (out->finished) drained_ = true;
  return true;
}

void RequestHandle::Cancel(FinishReason reason) {
  if (reason != FinishReason::kDeadline) reason = FinishReason::kCancelled;
  if (!cancel_.load(std::memory_order_acquire)) cancel_reason_.store(reason, std::memory_order_release);
  cancel_.store(true, std::memory_order_release);
  std::function<void()> listener;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    // Unread output is dropped: nothing reaches the reader after Cancel.
    pending_ = Output();
    pending_.finished = true;
    pending_.finish_reason = cancel_reason();
    if (pending_.finish_reason == FinishReason::kDeadline) pending_.status = absl::DeadlineExceededError("deadline passed");
    has_pending_ = true;
    closed_ = true;
    listener = listener_;
  }
  readable_cv_.notify_all();
  if (listener) listener();
}

void RequestHandle::SetListener(std::function<void()> listener) {
  bool readable;
  {
    std::unique_lock<std::mutex> lock(mu_);
    listener_ = listener;
    readable = has_pending_;
  }
  if (readable && listener) listener();
}

}  // namespace relgen
