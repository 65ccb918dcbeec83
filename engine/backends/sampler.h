// Next-token selection and log-probabilities from one row of logits. Pure: a choice depends only
// on the row, the parameters, the sequence's history and the index of the token being generated
// (the draw is Philox keyed by the seed, counted by the index), never on the rows beside it, so it
// is the same alone, in any batch, on any thread and after a preemption.
//
// Definitions (shared by every backend). The history is the sequence's tokens so far (a decoder's
// prompt and output; an encoder-decoder's decoder_start_token_id and output); its last `index`
// tokens are the output. The row's logits x are processed in float, in this order:
// 1. The repetition penalty divides a positive logit, multiplies a negative one, once per distinct
//    token of the history.
// 2. A token the output holds c > 0 times: x = (x - frequency_penalty * c) - presence_penalty
//    (OpenAI's definition; each operation rounded on its own).
// 3. x += logit_bias[token].
// 4. -inf for: tokens outside allowed_token_ids (when given); a bad word's last token when the
//    history ends with the word's other tokens (a one-token word always); while index < min_tokens,
//    min_tokens_banned (the end-of-sequence token and the stop token ids); with
//    no_repeat_ngram_size n, the last token of every n-gram of the history whose first n - 1 tokens
//    are the history's last n - 1 (transformers' NoRepeatNGramLogitsProcessor).
// If every logit is then -inf, nothing is drawn (the token is -1: the sequence ends, reason stop).
// - Greedy (temperature 0) takes the largest processed logit, lowest id on ties.
// - Otherwise w_i = exp((x_i - max x) / temperature) in float. Candidates are ordered by w
//   descending, lower id first on ties; top_k keeps the first k, then top_p keeps the shortest
//   prefix of those whose mass reaches top_p of theirs, then min_p keeps those with w >= min_p
//   (probability at least min_p times the largest). The draw u * (kept mass) walks the kept
//   tokens in id order and takes the first whose running mass exceeds it.
// - Reported log-probabilities are of the raw logits (before any processing and temperature).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
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
  float presence_penalty = 0.0f;   // 0: off
  float frequency_penalty = 0.0f;  // 0: off
  float min_p = 0.0f;              // 0: off
  int min_tokens = 0;
  std::vector<int32_t> min_tokens_banned;  // sorted, unique (the engine sets it)
  std::vector<std::pair<int32_t, float>> logit_bias;  // by id, unique
  std::vector<int32_t> allowed_token_ids;  // sorted, unique; empty: every token
  std::vector<std::vector<int32_t>> bad_words;  // each non-empty
  int no_repeat_ngram_size = 0;  // 0: off

  // Whether steps 2-4 of the definitions can change the row at generated token `index`.
  bool ProcessesRow(int index) const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || !logit_bias.empty() ||
           !allowed_token_ids.empty() || !bad_words.empty() || no_repeat_ngram_size > 0 ||
           (index < min_tokens && !min_tokens_banned.empty());
  }
  // Whether the device needs the history (steps 1, 2 and words of more than one token).
  bool NeedsHistory() const {
    if (repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f ||
        no_repeat_ngram_size > 0) {
      return true;
    }
    for (const auto& w : bad_words) {
      if (w.size() > 1) return true;
    }
    return false;
  }
};

// Bounds on a request's controls (the device's sampling area is sized by them).
inline constexpr int kMaxLogitBias = 1024;
inline constexpr int kMaxAllowedTokens = 4096;
inline constexpr int kMaxBadWords = 128;
inline constexpr int kMaxBadWordTokens = 1024;  // all words together
inline constexpr int kMaxMinTokensBanned = 65;   // the end-of-sequence token and 64 stop token ids
inline constexpr int kMaxNoRepeatNgram = 64;
// int32 words one query's controls take on the device at most (see the CUDA backend's layout).
inline constexpr int kMaxControlWords =
    4 + 2 * kMaxLogitBias + kMaxAllowedTokens + kMaxMinTokensBanned + kMaxBadWords + kMaxBadWordTokens;

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct SampleResult {
  int32_t token = 0;  // -1: every token was banned (nothing drawn)
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

// The token the draw `u` in [0, 1) selects (temperature > 0) for generated token `index`, by the
// definitions above; -1 when every token is banned.
int32_t DrawToken(absl::Span<const float> logits, const SamplingParams& params,
                  absl::Span<const int32_t> history, double u, SamplerScratch* scratch, int index = 0);

// `token`'s log-softmax under `logits` and the `top_n` most likely tokens' (ties: lower id first).
SampleResult TokenLogprobs(absl::Span<const float> logits, int32_t token, int top_n);

// Beam search's candidates from one beam's row: the `n` best tokens by processed logit (steps 1-4
// above; larger first, lower id first on ties), none banned, each with its processed logit minus
// the raw logits' log-normaliser, i.e. log_softmax(raw) with the controls applied to it as
// transformers' beam search applies its logits processors (bans: -inf; a bias: added). `token` is
// the best candidate, -1 when every token is banned; fewer than n when fewer are left.
SampleResult BeamCandidates(absl::Span<const float> logits, const SamplingParams& params,
                            absl::Span<const int32_t> history, int index, int n, SamplerScratch* scratch);

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
  // Draws: > 0 answers BeamCandidates(.., beam) instead of drawing (not fed to a later launch).
  int beam = 0;
};

// Answers `queries` from `logits` (rows of `vocab`), results in query order. `parallel_for(n, fn)`
// runs fn over ranges of [0, n), possibly at once; null runs them here in order.
using ParallelFor = std::function<void(int n, const std::function<void(int begin, int end)>& fn)>;
void AnswerQueries(const float* logits, int vocab, absl::Span<const RowQuery> queries,
                   std::vector<SampleResult>* results, const ParallelFor& parallel_for = nullptr);

}  // namespace relgen
