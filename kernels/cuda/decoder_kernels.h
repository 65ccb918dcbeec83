// CUDA kernels of the decoder, float32 (the K/V cache float32 or bf16). Every kernel has a CPU twin in kernels/cpu (named in its
// comment) and the parity tests compare them. All pointers are device pointers; all launches go on
// `stream` and return the launch's error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/relpos.h"

namespace relgen::cuda {

// Relative-position parameters of one layer (device pointers), as cpu::RelativeParams.
struct Relative {
  relpos::Scheme scheme = relpos::Scheme::kNone;
  bool heads_share = false;
  const float* table_k = nullptr;  // skew [Hs, M, hd]; shaw [Hs, 2k+1, hd]
  const float* table_v = nullptr;  // shaw values [Hs, 2k+1, hd]
  int rows = 0;
  int clip_k = 0;
  int block_length = 0;
  const float* t5_bias = nullptr;  // [Hs, num_buckets]
  int t5_num_buckets = 0;
  const int32_t* t5_bucket_of_distance = nullptr;
  int t5_table_len = 0;
  const float* alibi_slopes = nullptr;  // [n_heads]
  bool scale_with_qk = true;
};

// How a K/V pool stores an element (cpu::KvType's two): float32, or bfloat16 bits (uint16_t),
// rounded to nearest even when written (cpu::ToBf16's rule) and widened exactly when read; the
// arithmetic stays float32. bf16 halves the bytes a decode step reads of the cache.
enum class KvElem { kF32, kBf16 };

// One layer's paged K/V pool: [num_blocks, n_heads, block_size, head_dim] each, of `type`.
struct KvPool {
  void* k = nullptr;
  void* v = nullptr;
  int block_size = 0;
  int n_heads = 0;
  int head_dim = 0;
  KvElem type = KvElem::kF32;
};

// Per new-token row r of a step: its absolute position and where its sequence's block table
// starts in `block_tables` (all sequences' tables concatenated).
struct Rows {
  int n = 0;
  const int32_t* position = nullptr;
  const int32_t* table_offset = nullptr;
  const int32_t* block_tables = nullptr;
  // AttentionBidirectional only: row r sees keys 0..keys[r]-1 of its sequence (its input's length).
  const int32_t* keys = nullptr;
};

// out[i, :] = table[ids[i], :] * scale (cpu::Embedding).
cudaError_t Embedding(const int32_t* ids, int n, const float* table, int dim, float scale, float* out,
                      cudaStream_t stream);
// Row-wise LayerNorm (bias may be null) or RmsNorm; y may alias x (cpu::LayerNorm, cpu::RmsNorm).
cudaError_t Norm(bool layernorm, const float* x, int rows, int dim, const float* weight, const float* bias,
                 float eps, float* y, cudaStream_t stream);
// y[r, :] += bias (when not null), then the activation in place: 0 relu, 1 gelu, 2 gelu_tanh,
// 3 silu, -1 none (cpu::Linear's bias, cpu::Activate). With batch > 1, as many [rows, cols]
// matrices batch_stride floats apart, matrix b with bias[b * cols, ...] (a fused QKV projection).
cudaError_t BiasActivate(float* y, int rows, int cols, const float* bias, int activation, cudaStream_t stream,
                         int batch = 1, int64_t batch_stride = 0);
// The projections: y[r, o] = act(alpha * sum_k x[r, k] * w[o, k] + bias[o]) for r < rows, o < out,
// then (with `residual`) plus y's old value; x [rows, in], w [out, in] row-major as the model stores
// it, bias may be null, activation as BiasActivate's. Each output is one fixed chain of
// multiply-adds whatever `rows` is (per lane a sum over k in a fixed order, then a fixed butterfly
// over the warp), so a row's result does not depend on the rows beside it: the batch-invariant
// GEMM (cuBLAS picks its algorithm, and so a row's order of summation, by the problem's shape).
// With batch > 1, `batch` products in one launch: product z reads the same x, w + z * w_stride and
// bias + z * bias_stride, and writes y + z * y_stride (a fused QKV projection). (cpu::Linear.)
cudaError_t Linear(const float* x, int rows, int in, const float* w, int out, const float* bias, int activation,
                   bool residual, float alpha, float* y, cudaStream_t stream, int batch = 1, int64_t w_stride = 0,
                   int64_t bias_stride = 0, int64_t y_stride = 0);
// The same with w as bfloat16 bits (rounded to nearest even at load, cpu::ToBf16's rule), widened
// exactly as read: the CPU backend's bf16 weights (--weights_dtype bf16), half the weight bytes, the
// same float32 sums in the same order. Rows start on 8 bytes where `in` is a multiple of 4.
cudaError_t Linear(const float* x, int rows, int in, const uint16_t* w, int out, const float* bias, int activation,
                   bool residual, float alpha, float* y, cudaStream_t stream, int batch = 1, int64_t w_stride = 0,
                   int64_t bias_stride = 0, int64_t y_stride = 0);
// A self-attention's q, k and v in one launch, k and v written straight into the paged cache: the
// three products of Linear (batch 3: w [3, width, in] and bias [3, width] side by side, bias may be
// null), q [rows, width] into `q`, and row r's k and v into `kv` at kv_rows' position r, stored as
// WriteKv stores them (the same bits): one launch where Linear then WriteKv take two.
// kv.n_heads * kv.head_dim must be width and kv_rows.n must be rows (cudaErrorInvalidValue).
cudaError_t QkvToCache(const float* x, int rows, int in, const float* w, int width, const float* bias, float* q,
                       const KvPool& kv, const Rows& kv_rows, cudaStream_t stream);
cudaError_t QkvToCache(const float* x, int rows, int in, const uint16_t* w, int width, const float* bias, float* q,
                       const KvPool& kv, const Rows& kv_rows, cudaStream_t stream);
// Linear and QkvToCache on tensor cores (sm_80 and later), bf16 weights: each x row rounded to
// bf16 (nearest even), products exact, float accumulation in m16n16k16 steps over k in order,
// within each of LinearMmaSplits(in, out, batch) consecutive ranges of k (whole multiples of 64
// but the last), the ranges' sums then added in order. The ranges depend on the shape, never on
// the rows, so a row's result does not depend on the rows beside it; it differs from Linear's by
// the rounding of x: relative to sum_k |x_k w_k|, at most 2^-8 (bf16's unit roundoff) from x plus
// the float accumulation's ~in * 2^-24. With more than one range, `workspace` holds
// LinearMmaWorkspace(rows, in, out, batch) floats for the ranges' sums and `tickets`
// LinearMmaTickets(rows, in, out, batch) counters, zero before the first call and left zero by
// every call that completes (cudaErrorInvalidValue when either is null). One launch either way.
int LinearMmaSplits(int in, int out, int batch);
int64_t LinearMmaWorkspace(int rows, int in, int out, int batch);
int64_t LinearMmaTickets(int rows, int in, int out, int batch);
cudaError_t LinearMma(const float* x, int rows, int in, const uint16_t* w, int out, const float* bias, int activation,
                      bool residual, float alpha, float* y, cudaStream_t stream, int batch = 1, int64_t w_stride = 0,
                      int64_t bias_stride = 0, int64_t y_stride = 0, float* workspace = nullptr,
                      unsigned* tickets = nullptr);
cudaError_t QkvToCacheMma(const float* x, int rows, int in, const uint16_t* w, int width, const float* bias, float* q,
                          const KvPool& kv, const Rows& kv_rows, cudaStream_t stream, float* workspace = nullptr,
                          unsigned* tickets = nullptr);
// One resident LoRA adapter's matrices for one projection (device pointers; rank 0 where that
// adapter does not adapt it), as PEFT's LoRA Linear: y += scale * (x A^T) B^T.
constexpr int kLoraMaxRank = 256;
struct LoraDesc {
  const float* a = nullptr;  // [rank, in]
  const float* b = nullptr;  // [out, rank]
  int rank = 0;              // at most kLoraMaxRank
  float scale = 0.f;
};
// y[r, :] (row-major [rows, out]) += each row's adapter's term, its adapter descs[slot[r] *
// desc_stride]; a row with slot[r] < 0 or an adapter of rank 0 here is left as it is. One launch
// for every adapter of a step; a row's bits depend on its input and its adapter alone (batch
// invariant). x [rows, in] float32.
cudaError_t LoraAdd(const float* x, int rows, int in, int out, const LoraDesc* descs, int desc_stride,
                    const int32_t* slot, float* y, cudaStream_t stream);
// x = act(x) * gate (cpu::ActivateGated).
cudaError_t ActivateGated(int activation, float* x, const float* gate, int64_t n, cudaStream_t stream);
// y += x (cpu::AddInPlace).
cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t stream);
// y = x as bfloat16 bits, rounded to nearest even (cpu::ToBf16's rule): the operand cuBLAS's bf16
// GEMM reads (--cuda_gemm cublas with bf16 weights).
cudaError_t RoundToBf16(const float* x, int64_t n, uint16_t* y, cudaStream_t stream);
// k, v [rows, n_heads*head_dim] into the pool at each row's position, in the pool's element type
// (cpu::WriteKv).
cudaError_t WriteKv(const KvPool& kv, const Rows& rows, const float* k, const float* v, cudaStream_t stream);

// Attention of every new-token row (prefill, chunked prefill and decode alike) against its
// sequence's cache, all rows and heads in one launch: online softmax over the row's visible keys,
// the relative term computed inside the kernel for that row (skew q.E over the needed distances,
// Shaw's clipped rows, T5's bucket table, ALiBi's slope). Keys are split into chunks of
// `keys_per_split` processed by separate blocks and merged (split-K / flash-decoding), which
// needs `workspace` of rows * heads * splits * (head_dim + 2) floats (see AttentionWorkspace).
// q, out [rows, n_heads*head_dim] (cpu::AttentionPrefill / cpu::AttentionDecode).
// `tiled` (for prefill): a block takes 4 rows and reads each K/V row once for the rows in it that
// read the same keys (one sequence's chunk), instead of once per row; every row's output is the
// per-row kernel's bit for bit, whatever rows sit beside it. Decode (one row per sequence) wants the
// per-row kernel: a block per row, more blocks in flight.
cudaError_t Attention(const float* q, const Rows& rows, int max_keys, float scale, const Relative& rel,
                      const KvPool& kv, float* out, float* workspace, int keys_per_split, cudaStream_t stream,
                      bool tiled = false);
int64_t AttentionWorkspace(int rows, int n_heads, int head_dim, int max_keys, int keys_per_split);
// The merge of key splits both attention kernels end with: per (row, head) the splits' partial
// states in `workspace` (each m, l, then head_dim sums; m = -inf: a split with no keys) into out.
cudaError_t AttentionCombine(const float* workspace, int rows, int n_heads, int head_dim, int splits, float* out,
                             cudaStream_t stream);
// Attention and AttentionBidirectional (`bidirectional`) on tensor cores, for a bf16 pool of head_dim
// 16, 32, 64 or 128 (AttentionMmaSupported; cudaErrorInvalidValue otherwise): q rounded to bf16 (nearest
// even), q . K, skew's and Shaw's q . E (E's rows rounded to bf16) and P . V (each weight rounded to
// bf16) in m16n16k16 products with float accumulation in k order, the softmax, ALiBi, T5 and
// Shaw's value rows in float32. Keys in tiles of 32 from each split's first key, query rows in
// tiles of 16 of one sequence (`tiled`: up to 16 consecutive rows a block; else one, the tile's
// other rows zero): a row's output is the same bits whichever rows share its tile, so prefill,
// chunked prefill and decode agree bit for bit. It differs from Attention's by the roundings: each
// score by at most scale * 2^-8 * sum_d |q_d k_d| (plus, for skew and Shaw, the factor on the
// relative term times (2^-8 + 2^-16 + 2^-8) sum_d |q_d e_d|), each weight by a further factor
// within 1 +- 2^-8. Splits, workspace and max_keys as Attention's.
bool AttentionMmaSupported(const KvPool& kv);
cudaError_t AttentionMma(const float* q, const Rows& rows, int max_keys, float scale, const Relative& rel,
                         const KvPool& kv, float* out, float* workspace, int keys_per_split, cudaStream_t stream,
                         bool tiled, bool bidirectional = false);
// Bidirectional self-attention (an encoder; cpu::AttentionBidirectional): row r, at position
// rows.position[r], attends every key 0..rows.keys[r]-1 of its sequence's cache, before and after
// it, with no causal mask. Relative terms: kNone, or kT5 with `t5_bucket_of_distance` the signed
// table (relpos::T5SignedBucketTable: entry key_pos - query_pos + t5_table_len/2, clamped at both
// ends); any other scheme is cudaErrorInvalidValue. Splits, workspace and `max_keys` (the largest
// keys[r]) and `tiled` as Attention's.
cudaError_t AttentionBidirectional(const float* q, const Rows& rows, int max_keys, float scale, const Relative& rel,
                                   const KvPool& kv, float* out, float* workspace, int keys_per_split,
                                   cudaStream_t stream, bool tiled = true);

}  // namespace relgen::cuda
