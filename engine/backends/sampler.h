// Next-token selection and log-probabilities from one row of logits. Pure: a choice depends only
// on the row, the parameters, the sequence's history and the index of the token being generated
// (the draw is Philox keyed by the seed, counted by the index), never on the rows beside it, so it
// is the same alone, in any batch, on any thread and after a preemption.
//
// Definitions (shared by every backend):
// - The repetition penalty divides a positive logit, multiplies a negative one, once per distinct
//   token of the history. Greedy (temperature 0) takes the largest penalised logit, lowest id on
//   ties.
// - Otherwise w_i = exp((x_i - max x) / temperature) in float. Candidates are ordered by w
//   descending, lower id first on ties; top_k keeps the first k, then top_p keeps the shortest
//   prefix of those whose mass reaches top_p of theirs. The draw u * (kept mass) walks the kept
//   tokens in id order and takes the first whose running mass exceeds it.
// - Reported log-probabilities are of the raw logits (before penalty and temperature).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
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

// Buffers reused between rows by one thread.
struct SamplerScratch {
  std::vector<float> x, w;
  std::vector<double> mass, chunk;
  std::vector<int32_t> ids;
};

// `history`: the tokens the repetition penalty applies to (prompt and output so far); `index`: the
// 0-based index of the token being generated.
SampleResult Sample(absl::Span<const float> logits, const SamplingParams& params,
                    absl::Span<const int32_t> history, int index, SamplerScratch* scratch);

// The token the draw `u` in [0, 1) selects (temperature > 0), by the definitions above.
int32_t DrawToken(absl::Span<const float> logits, const SamplingParams& params,
                  absl::Span<const int32_t> history, double u, SamplerScratch* scratch);

// `token`'s log-softmax under `logits` and the `top_n` most likely tokens' (ties: lower id first).
SampleResult TokenLogprobs(absl::Span<const float> logits, int32_t token, int top_n);

// The uniform draw in [0, 1) used for generated token `index` of a request with `seed`.
double SampleUniform(uint64_t seed, int index);

// What is wanted of one row of a step's logits: a drawn token (`params` set), or the
// log-probabilities of a given token (`params` null).
struct RowQuery {
  int row = 0;
  const SamplingParams* params = nullptr;
  absl::Span<const int32_t> history;  // draws: the repetition penalty's tokens
  int index = 0;                      // draws: the generated token's index
  int32_t token = 0;                  // scores: the token
  int top_n = 0;                      // scores: alternatives reported
  // Draws: >= 0 when the history's last token is the one the previous launch drew for its query
  // `fed_query` (backend.h, SequenceStep::fed_query); its value in `history` is a placeholder.
  int fed_query = -1;
};

// Answers `queries` from `logits` (rows of `vocab`), results in query order. `parallel_for(n, fn)`
// runs fn over ranges of [0, n), possibly at once; null runs them here in order.
using ParallelFor = std::function<void(int n, const std::function<void(int begin, int end)>& fn)>;
void AnswerQueries(const float* logits, int vocab, absl::Span<const RowQuery> queries,
                   std::vector<SampleResult>* results, const ParallelFor& parallel_for = nullptr);

}  // namespace relgen
