// CPU attention with relative-position terms, in three modes: prefill (the whole prompt, start 0),
// chunked prefill (several queries starting at any cache position) and decode (one query).
// The relative term is computed for the queries of the call only: the skew turns one Q*E^T
// product per head into the relative logits (no [L, L, D] tensor); Shaw uses one Q*R^T product and
// a gather; T5 a bucket lookup; ALiBi a slope.
// Each query row is computed by one fixed sequence of float operations in every mode, so results
// do not depend on chunking or batching (bitwise). Thread-safety: reentrant; scratch is per thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/relpos.h"
#include "kernels/storage_types.h"

namespace relgen::cpu {

// Relative-position parameters of one layer. "Hs" is 1 when heads share a table, else n_heads.
struct RelativeParams {
  relpos::Scheme scheme = relpos::Scheme::kNone;
  bool heads_share = false;
  // kSkew / kSkewLocal: [Hs, rows, head_dim], row r holds distance rows-1-r (rows = M).
  // kShaw: [Hs, rows, head_dim], row r holds clipped relative position r-k (rows = 2k+1).
  const float* table_k = nullptr;
  const float* table_v = nullptr;  // kShaw relative values, [Hs, 2k+1, head_dim], or null
  int rows = 0;
  int clip_k = 0;        // kShaw
  int block_length = 0;  // kSkewLocal
  // kT5: bias[Hs, num_buckets] and the exact distance->bucket table.
  const float* t5_bias = nullptr;
  int t5_num_buckets = 0;
  const int32_t* t5_bucket_of_distance = nullptr;
  int t5_table_len = 0;
  const float* alibi_slopes = nullptr;  // kAlibi, [n_heads]
  // True: softmax(scale * (QK^T + rel)); false: softmax(scale * QK^T + rel).
  bool scale_with_qk = true;
};

// How the K/V cache stores an element. bf16 halves the cache's bytes (and what a decode step
// reads of it): K and V are rounded to nearest even when written and widened exactly when read;
// the arithmetic stays float32, so every row still takes one fixed sequence of operations.

// One layer's keys and values, paged: pool [num_blocks, n_heads, block_size, head_dim] of `type`
// elements (float, or uint16_t bf16 bits) and a block table mapping a sequence's logical block to
// a pool block. A contiguous cache is one block.
struct KvView {
  void* k = nullptr;
  void* v = nullptr;
  const int32_t* block_table = nullptr;
  int block_size = 0;
  int n_heads = 0;
  int head_dim = 0;
  KvType type = KvType::kF32;

  // In elements.
  int64_t RowOffset(int head, int pos) const {
    const int64_t block = block_table[pos / block_size];
    return ((block * n_heads + head) * block_size + pos % block_size) * head_dim;
  }
};

struct AttentionDims {
  int n_heads = 0;
  int head_dim = 0;
  float scale = 0.0f;  // multiplies QK^T (usually 1/sqrt(head_dim))
};

// Stores k, v [n, n_heads*head_dim] at positions start..start+n-1 (rounded to kv.type).
void WriteKv(const KvView& kv, const float* k, const float* v, int start, int n);

// Queries q [n, n_heads*head_dim] at positions start..start+n-1 (n >= 1, any start) attend to the
// cache, which must already hold keys/values for positions 0..start+n-1. out [n, n_heads*head_dim].
// Heads [head_begin, head_end) only (all by default), so callers can spread heads over threads.
void AttentionPrefill(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                      const float* q, int start, int n, float* out, int head_begin = 0,
                      int head_end = -1);

// One query q [n_heads*head_dim] at position pos; the cache holds positions 0..pos.
void AttentionDecode(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                     const float* q, int pos, float* out, int head_begin = 0, int head_end = -1);

// Bidirectional self-attention (an encoder): each of the n queries q [n, n_heads*head_dim] at
// positions 0..n-1 attends every key 0..n-1 of `kv`. Relative terms: kNone, or kT5 with
// `t5_bucket_of_distance` a signed table (relpos::T5SignedBucketTable): entry r + t5_table_len/2
// is the bucket of key_pos - query_pos = r, clamped at both ends. out [n, n_heads*head_dim].
void AttentionBidirectional(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                            const float* q, int n, float* out, int head_begin = 0, int head_end = -1);

// Adds mult * S_rel to scores [lq, lk] (row stride lk) for lq queries whose last row sits at the
// last of lk keys (query i at key index i + lk - lq), from a skew table e [m, hd] whose row r holds
// distance m-1-r (distances >= m contribute zero). Computes one Q*E^T product over the distances
// the tile needs into a buffer padded with one column on the left, then reads it through the skew
// view: padded-flat[lq + i*lk + j] (pad left, reshape, drop the first lq elements: one row when
// lq == lk). Only the causal part j <= i + lk - lq is written; `scratch` holds lq*(lk+1) floats.
// With scores == null only `scratch` is filled (the caller reads the skew view itself).
void AddSkewedRelativeLogits(const float* q, int ldq, int lq, int lk, const float* e, int m, int hd,
                             float mult, float* scores, float* scratch);

// The instruction sets attention has a code path for. A process uses one, the best its CPU runs
// (the functions above): AVX-512 and AVX2 fuse multiply-adds (in 16 and 8 lanes), the baseline
// does not, so the paths differ in rounding; within one, every row takes the same arithmetic in
// every mode.
enum class AttentionIsa { kAvx512, kAvx2, kBase };
std::vector<AttentionIsa> SupportedAttentionIsas();  // best first
const char* AttentionIsaName(AttentionIsa isa);
// The functions above, of one instruction set (tests reach each path this way).
struct AttentionKernels {
  void (*prefill)(const AttentionDims&, const RelativeParams&, const KvView&, const float* q,
                  int start, int n, float* out, int head_begin, int head_end);
  void (*decode)(const AttentionDims&, const RelativeParams&, const KvView&, const float* q,
                 int pos, float* out, int head_begin, int head_end);
  void (*bidirectional)(const AttentionDims&, const RelativeParams&, const KvView&, const float* q,
                        int n, float* out, int head_begin, int head_end);
  void (*add_skewed)(const float* q, int ldq, int lq, int lk, const float* e, int m, int hd,
                     float mult, float* scores, float* scratch);
};
const AttentionKernels& AttentionKernelsFor(AttentionIsa isa);  // `isa` must be supported

}  // namespace relgen::cpu
