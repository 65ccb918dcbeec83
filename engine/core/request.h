// What a caller hands the engine and gets back: the request, its stop criteria, and the handle it
// reads its output from. engine.h includes this; a client of the engine needs nothing more.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/backends/sampler.h"
#include "engine/core/beam_search.h"

namespace relgen {

enum class FinishReason { kNone, kLength, kStop, kEos, kCancelled, kDeadline, kError };
absl::string_view FinishReasonName(FinishReason r);  // "length", "stop", ...

struct StopCriteria {
  int max_new_tokens = 128;  // (SamplingParams::min_tokens: the fewest, before EOS, stop ids and strings)
  std::vector<int32_t> stop_token_ids;  // finish after one of these (it is part of the output ids)
  std::vector<std::string> stop_strings;  // finish before one of these would appear in the text
  bool ignore_eos = false;
};

inline constexpr int kMaxSamples = 16;
inline constexpr int kMaxContinuations = 64;

struct Request {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopCriteria stop;
  absl::Time deadline = absl::InfiniteFuture();
  // Samples of the prompt (1..kMaxSamples), one handle each. Sample i draws with seed + i (mod
  // 2^64), so it equals a request of its own with that seed; every sample after the first starts
  // once the first has computed the prompt, sharing its full KV blocks.
  int n = 1;
  // Log-probabilities of the prompt's tokens from the second on (the first has no context): -1
  // none; k (0..RequestLimits::max_logprobs) with the k most likely alternatives. Sample 0 delivers them,
  // before its first token (with its end where stop.max_new_tokens is 0: the prompt alone). Decoder models only. Such a request computes its whole prompt (no
  // prefix-cache hit: a cached block has no logits).
  int prompt_logprobs = -1;
  // Scoring instead of generating (1..kMaxContinuations of them, each non-empty): one handle per
  // continuation, whose Output.logprobs holds each continuation token's log-probability after the
  // prompt and the continuation's tokens before it (with sampling.logprobs alternatives);
  // nothing is sampled; finish_reason kLength, generated_tokens 0. The continuations share the
  // prompt's full KV blocks. An encoder-decoder model scores each as its decoder's output for the
  // prompt as input (after decoder_start_token_id). `n`, `stop` and sampling other than logprobs
  // do not apply.
  std::vector<std::vector<int32_t>> continuations;
  // Keep only the prompt's last N tokens (an encoder-decoder model: the input's); 0: off.
  int truncate_prompt_tokens = 0;
  // false: special tokens' text is part of the output text (transformers' skip_special_tokens).
  bool skip_special_tokens = true;
  // Beam search (num_beams 2..kMaxBeams; engine/core/beam_search.h): one handle per returned
  // sequence (num_return_sequences <= num_beams), the best first, each delivered whole when the
  // search ends (nothing streams before) with Output.beam_score. The beams share the prompt's KV
  // blocks; a beam that forks takes its parent's full blocks and recomputes the partial last one.
  // The group is one request (max_waiting, metrics); cancelling any handle or the deadline ends
  // it. Of the sampling parameters only the controls that ban or bias tokens apply
  // (no_repeat_ngram_size, min_tokens, bad_words, allowed_token_ids, logit_bias); temperature,
  // top_k, top_p, min_p and the seed are ignored, as transformers' beam search without sampling does.
  int num_beams = 1;
  float length_penalty = 1.0f;
  EarlyStopping early_stopping = EarlyStopping::kFalse;
  int num_return_sequences = 1;
  // The registered LoRA adapter to run under (EngineConfig::adapters, by name); empty: the base.
  std::string adapter;
};

struct RequestTiming {
  absl::Duration queue;              // submit -> first scheduled
  absl::Duration time_to_first_token;
  absl::Duration total;
};

// Output of a request since the previous read (chunks merge while unread, so memory is bounded
// by the request's own output). The last one has `finished` set.
struct Output {
  std::vector<int32_t> token_ids;
  std::string text;
  std::vector<SampleResult> logprobs;  // one per token when the request asked for logprobs (Score: always)
  std::vector<SampleResult> prompt_logprobs;  // prompt tokens 1.. when asked (token = the prompt's)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  absl::Status status;  // why, for kError
  int prompt_tokens = 0;
  int generated_tokens = 0;
  RequestTiming timing;
  double beam_score = 0;  // beam search: the sequence's score (its log-probability / length^length_penalty)
  // Per token of token_ids, the text it added (the detokeniser's output for it, special tokens'
  // text as skip_special_tokens says): the pieces concatenate to `text`, except that a stop string
  // cuts `text` and not the pieces. Clients that index the text per token (OpenAI's text_offset)
  // read these rather than decoding again, so the two cannot disagree.
  std::vector<std::string> token_text;
};

class RequestHandle {
 public:
  const std::string& id() const { return id_; }
  // Waits up to `timeout` for output. False on timeout and once the final output was read.
  bool Next(Output* out, absl::Duration timeout = absl::InfiniteDuration());
  // Stops the request: nothing more is delivered but the final output (`reason`: kCancelled, or
  // kDeadline when the caller's deadline passed); the engine frees its KV blocks at its next step.
  // Idempotent; a finished request stays as it finished.
  void Cancel(FinishReason reason = FinishReason::kCancelled);
  // Called (from the engine thread, without locks held) whenever output becomes readable.
  void SetListener(std::function<void()> listener);

 private:
  friend class Engine;
  void Deliver(Output&& delta);  // merges; ignored after the final output
  bool cancel_requested() const { return cancel_.load(std::memory_order_acquire); }
  FinishReason cancel_reason() const { return cancel_reason_.load(std::memory_order_acquire); }

  std::string id_;
  std::atomic<bool> cancel_{false};
  std::atomic<FinishReason> cancel_reason_{FinishReason::kCancelled};
  // std::mutex rather than absl::Mutex: TSan sees only the former in Debian's uninstrumented Abseil.
  // Guards the members below.
  std::mutex mu_;
  std::condition_variable readable_cv_;
  Output pending_;
  bool has_pending_ = false;
  bool closed_ = false;    // final output delivered to the handle
  bool drained_ = false;   // final output read
  std::function<void()> listener_;
};

}  // namespace relgen
