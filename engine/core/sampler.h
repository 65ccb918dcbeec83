// Next-token selection for one sequence. Pure: the choice depends only on the logits, the
// parameters, the sequence's history and the index of the token being generated (the random draw
// is a hash of seed and index), so it is the same alone, in any batch, and after a preemption.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace relgen {

struct SamplingParams {
  float temperature = 1.0f;  // 0 selects greedy decoding
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float repetition_penalty = 1.0f;
  uint64_t seed = 0;
  int logprobs = -1;  // -1: none; 0: the chosen token's; n: also the n most likely alternatives
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0.0f;             // log-softmax of the raw logits (before penalty/temperature)
  std::vector<TokenLogprob> top;    // most likely first (ties: lower id first)
};

// `history`: the tokens the repetition penalty applies to (prompt and output so far); `index`: the
// 0-based index of the token being generated. `scratch` is reused between calls.
SampleResult Sample(absl::Span<const float> logits, const SamplingParams& params,
                    absl::Span<const int32_t> history, int index, std::vector<float>* scratch);

// `token`'s log-softmax under `logits` and the `top_n` most likely tokens' (ties: lower id first).
// `log_z`: the logits' log-sum-exp when the caller has it, NaN to compute it here.
SampleResult TokenLogprobs(absl::Span<const float> logits, int32_t token, int top_n, double log_z = NAN);

// The uniform draw in [0, 1) used for generated token `index` of a request with `seed`.
double SampleUniform(uint64_t seed, int index);

}  // namespace relgen
