// Sampling on the device: a step's row queries (engine/backends/sampler.h's RowQuery) answered
// from the logits where they are, so only the answers cross to the host. One block per query; a
// query's answer depends on its row, its parameters and history alone (Philox keyed by the seed,
// counted by the index), never on the queries beside it.
//
// The definitions are sampler.h's, with the weights' masses in integers: w_i = expf((x_i - max x)
// / temperature) is counted as q_i = floor(w_i * 2^40), so every sum is exact and the same in any
// order (the block's reductions need no fixed order to stay deterministic). top_k keeps the first
// k by (w descending, lower id first); top_p then the shortest prefix of those whose q reaches
// ceil(top_p * their q); the draw floor(u * kept q) takes the first kept id, in id order, whose
// running q exceeds it. Each cut is found by bisection over the bits of w and then over ids.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace relgen::cuda {

// The server's logprobs and prompt_logprobs bound (20) and beam search's candidates (2 x 16 beams).
inline constexpr int kMaxAnswerTop = 32;

struct DeviceQuery {
  int32_t row = 0;
  int32_t draw = 0;    // 1: draw a token; 0: score `token`; 2: beam candidates (top_n of them)
  int32_t token = 0;   // scores
  int32_t top_n = -1;  // alternatives reported (draws: the request's logprobs; -1 none)
  float temperature = 1.0f;  // draws: 0 greedy
  float top_p = 1.0f;
  float repetition_penalty = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  int32_t index = 0;
  int32_t history_offset = 0;  // into `history`
  int32_t history_len = 0;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float min_p = 0.0f;
  int32_t no_repeat_ngram_size = 0;  // 0: off (else the history is sent)
  // Into `history`: the query's other controls, -1 for none. Int32 words: the logit bias's count
  // and (id, float bits) pairs; the allowed ids' count and ids (sorted; none: every id); the
  // banned ids' count and ids (min_tokens: the host sends them only while they apply); the bad
  // words' count and, per word, its length and tokens.
  int32_t controls_offset = -1;
};

struct DeviceAnswer {
  int32_t token = 0;
  float logprob = 0.0f;  // of the raw logits; set when top_n >= 0 (draws) or always (scores)
  int32_t num_top = 0;
  int32_t top_token[kMaxAnswerTop];
  float top_logprob[kMaxAnswerTop];
};

// Answers queries[0..n) by sampler.h's definitions (a draw whose controls ban every token answers
// token -1). `logits` [rows, vocab]: a draw's row is processed in place, and `history_raw` (as
// long as `history`) receives the raw logits of the history tokens and of the logit bias's, so no
// other query may read a draw's row or share its history or controls span (the engine draws once
// per sequence, from that sequence's last row). `u` (tests only, else null): each query's draw instead of Philox's.
cudaError_t AnswerRows(float* logits, int vocab, const DeviceQuery* queries, int n, const int32_t* history,
                       float* history_raw, const double* u, DeviceAnswer* answers, cudaStream_t stream);

// For each of the n pairs (index, query) in `feeds`: dst[index] = answers[query].token (0 for -1). A step's
// input tokens (and histories) that are the previous step's draws, taken on the device so the step
// can be launched before those answers reach the host.
cudaError_t FeedTokens(const DeviceAnswer* answers, const int32_t* feeds, int n, int32_t* dst, cudaStream_t stream);


}  // namespace relgen::cuda
