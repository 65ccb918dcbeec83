// The projections: LinearKernel (CUDA cores, float32 or bf16 weights) and LinearMmaKernel (tensor
// cores, bf16 weights) with its range combine; the fused QKV projection writes K and V into the cache.
#include <cuda_runtime.h>
#include <cuda_pipeline_primitives.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

constexpr int kLinWarps = 4;  // per block

// A projection's output (row, col) from its sum: alpha, bias, activation, then into y (plus its old
// value with `residual`) or, for the K (part 1) and V (part 2) of a fused QKV projection with a
// pool, straight into the cache as WriteKv writes it. `y` and `bias` are those of product `part`.
__device__ __forceinline__ void LinearOut(float sum, int row, int col, int out, const float* bias, int act,
                                          bool residual, float alpha, float* y, const KvPool& kv, const Rows& kv_rows,
                                          int part) {
  float val = alpha * sum;
  if (bias != nullptr) val += bias[col];
  val = Act(act, val);
  if (kv.k != nullptr && part > 0) {
    const int64_t dst = RowOffset(kv, kv_rows.block_tables + kv_rows.table_offset[row], col / kv.head_dim,
                                  kv_rows.position[row]) + col % kv.head_dim;
    void* const pool = part == 1 ? kv.k : kv.v;
    if (kv.type == KvElem::kBf16) {
      Store(static_cast<uint16_t*>(pool) + dst, val);
    } else {
      Store(static_cast<float*>(pool) + dst, val);
    }
  } else {
    float* const at = y + int64_t{row} * out + col;
    *at = residual ? *at + val : val;
  }
}

// Four weights from k on (16-byte aligned floats, or 8-byte aligned bf16 bits widened exactly).
__device__ __forceinline__ float4 Load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 Load4(const uint16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(Lo(u.x), Hi(u.x), Lo(u.y), Hi(u.y));
}

// One warp per kOuts outputs and one block per kRows rows (grid.y). A lane reads 16-byte pieces of
// the weight rows (k = 4 * lane + 128 * i, each weight once for the kRows rows) and of the rows of
// x, kChunks values of i per round with every load issued before the first use (a round trip to
// memory is what bounds a pass), and keeps one partial sum per (row, output), adding i in order;
// the warp then hands the partial sums of every lane through shared memory and lane j adds the 32
// of sum j in lane order. A (row, output)'s chain of operations is that whatever kOuts, kRows and
// kChunks are and whichever rows share its block, which is what makes rows batch invariant and
// lets the launch pick the grouping by the row count.
template <typename TW, int kOuts, int kRows, int kChunks>
__global__ void __launch_bounds__(32 * kLinWarps, 4) LinearKernel(const float* x, int rows, int in, const TW* w,
                                                               int out, const float* bias, int act, bool residual,
                                                               float alpha, float* y, int64_t w_stride,
                                                               int64_t bias_stride, int64_t y_stride, KvPool kv,
                                                               Rows kv_rows) {
  constexpr int kSums = kRows * kOuts;
  static_assert(kSums <= 32, "LinearKernel: one lane adds up each (row, output)");
  // Per warp [kSums][33]: sum j's 32 partials in a row, padded against bank conflicts.
  __shared__ float partial[kLinWarps][kSums][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int o0 = (blockIdx.x * kLinWarps + warp) * kOuts;
  if (o0 >= out) return;  // no block-wide barrier below
  w += blockIdx.z * w_stride;
  y += blockIdx.z * y_stride;
  if (bias != nullptr) bias += blockIdx.z * bias_stride;
  const int r0 = blockIdx.y * kRows;
  const int live_rows = min(kRows, rows - r0);
  const int live_outs = min(kOuts, out - o0);
  float acc[kSums];  // [row][output]
#pragma unroll
  for (int j = 0; j < kSums; ++j) acc[j] = 0.f;
  if ((in & 3) == 0) {  // rows start on 16 bytes
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 4 * lane; k < in; k += 128 * kChunks) {
      const int chunks = min(kChunks, (in - k + 127) / 128);
      float4 wv[kChunks][kOuts], xv[kChunks][kRows];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int o = 0; o < kOuts; ++o) {
          wv[c][o] = c < chunks && o < live_outs ? Load4(w + int64_t{o0 + o} * in + k + 128 * c) : zero;
        }
#pragma unroll
        for (int rr = 0; rr < kRows; ++rr) {
          xv[c][rr] = c < chunks && rr < live_rows
                          ? *reinterpret_cast<const float4*>(x + int64_t{r0 + rr} * in + k + 128 * c)
                          : zero;
        }
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c >= chunks) break;
#pragma unroll
        for (int rr = 0; rr < kRows; ++rr) {
          if (rr >= live_rows) break;
#pragma unroll
          for (int o = 0; o < kOuts; ++o) {
            float& a = acc[rr * kOuts + o];
            a += wv[c][o].x * xv[c][rr].x;
            a += wv[c][o].y * xv[c][rr].y;
            a += wv[c][o].z * xv[c][rr].z;
            a += wv[c][o].w * xv[c][rr].w;
          }
        }
      }
    }
  } else {
    for (int k = lane; k < in; k += 32) {
      float wv[kOuts];
#pragma unroll
      for (int o = 0; o < kOuts; ++o) wv[o] = o < live_outs ? Widen(w[int64_t{o0 + o} * in + k]) : 0.f;
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        if (rr >= live_rows) break;
        const float xv = x[int64_t{r0 + rr} * in + k];
#pragma unroll
        for (int o = 0; o < kOuts; ++o) acc[rr * kOuts + o] += wv[o] * xv;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kSums; ++j) partial[warp][j][lane] = acc[j];
  __syncwarp();
  const int rr = lane / kOuts, o = lane % kOuts;
  if (lane < kSums && rr < live_rows && o < live_outs) {
    float sum = 0.f;
    for (int l = 0; l < 32; ++l) sum += partial[warp][lane][l];
    LinearOut(sum, r0 + rr, o0 + o, out, bias, act, residual, alpha, y, kv, kv_rows, blockIdx.z);
  }
}

// Tensor cores, bf16 weights: a block of kMmaWarps warps computes 32 rows x 32 outputs (a 16 x 16
// tile per warp), or from kMmaWideRows rows 64 x 64 (four per warp), over one of `splits`
// consecutive ranges of k (MmaSplitK). For each kMmaK of its range in turn, the block rounds its
// rows of x to bf16 and stages them in shared memory with its weight rows (zeros past rows, out
// and the range), and each warp adds kMmaK / 16 m16n16k16 products to each float accumulator, k
// ascending. The weights come kMmaStages - 1 rounds ahead, by asynchronous 16-byte copies
// (cp.async) where the rows allow, so a block keeps that many rounds of weights in flight while
// it multiplies; that is what a decode step, whose few rows make the weights the whole of the
// traffic, waits on. One range: the epilogue runs here. Several: each range's sums go to
// `partial` [product][range][rows][out], and the tile's last block to finish (its ticket says so)
// adds them in range order and runs the epilogue, then zeroes the ticket for the next launch (a
// graph's replay too): no second launch, and no block waits for another. An output's chain of
// operations is the same whichever rows share its tile, whatever the tile's size and however deep
// a stage is, and the ranges depend on the shape alone: rows are batch invariant. Deep stages and
// the ranges keep the weights in flight when a decode step's few rows make a small grid.
constexpr int kMmaWarps = 4;
constexpr int kMmaK = 64;          // k staged per round
constexpr int kMmaLd = kMmaK + 8;  // staged row pitch in bf16: a multiple of 8, rows 16-byte aligned
constexpr int kMmaStages = 3;      // weight buffers: rounds in flight + the one being multiplied
constexpr int kMmaWideRows = 64;   // rows from which a launch takes 64 x 64 tiles
constexpr int kMmaBlocks = 512;    // blocks a one-row launch should have (4 per SM on 132 SMs)
constexpr int kMmaMinRange = 256;  // k per range at least
__host__ __device__ __forceinline__ int MmaRangeK(int in, int splits) {
  return ((in + splits - 1) / splits + kMmaK - 1) / kMmaK * kMmaK;
}
template <int kTileRows, int kTileOuts>
__device__ __forceinline__ void LinearMmaTile(const float* x, int rows, int in, const uint16_t* w, int out,
                                              const float* bias, int act, bool residual, float alpha, float* y,
                                              int64_t w_stride, int64_t bias_stride, int64_t y_stride, KvPool kv,
                                              Rows kv_rows, int splits, float* partial, unsigned* tickets) {
  namespace wmma = nvcuda::wmma;
  // The warps form a 2 x 2 grid over the tile; each holds (kTileRows / 32) x (kTileOuts / 32)
  // accumulators of 16 x 16.
  constexpr int kFragRows = kTileRows / 32, kFragOuts = kTileOuts / 32;
  __shared__ bool last;
  __shared__ __attribute__((aligned(32))) __nv_bfloat16 xs[kTileRows * kMmaLd];
  __shared__ __attribute__((aligned(32))) __nv_bfloat16 ws[kMmaStages][kTileOuts * kMmaLd];
  __shared__ __attribute__((aligned(32))) float cs[kMmaWarps][16 * 16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 1, wn = warp & 1;
  const int part = blockIdx.z / splits, range = blockIdx.z % splits;
  w += part * w_stride;
  y += part * y_stride;
  if (bias != nullptr) bias += part * bias_stride;
  const int r0 = blockIdx.x * kTileRows, o0 = blockIdx.y * kTileOuts;
  const int kb = range * MmaRangeK(in, splits), ke = min(in, kb + MmaRangeK(in, splits));
  // 16-byte pieces: 8 weights, or 4 of x, when every row starts on 16 bytes.
  const bool w_vec = in % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0;
  const bool x_vec = in % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  // The weights of round `round` into its buffer, as one commit group (empty past the range, so
  // every thread's groups count alike): asynchronous where whole and aligned, else plain stores.
  const int rounds = max(0, (ke - kb + kMmaK - 1) / kMmaK);
  auto stage_weights = [&](int round) {
    if (round < rounds) {
      const int k0 = kb + round * kMmaK;
      __nv_bfloat16* dst = ws[round % kMmaStages];
      if (w_vec && k0 + kMmaK <= ke) {
        for (int e = threadIdx.x; e < kTileOuts * kMmaK / 8; e += 32 * kMmaWarps) {
          const int r = e / (kMmaK / 8), k = (e % (kMmaK / 8)) * 8;
          if (o0 + r < out) {
            __pipeline_memcpy_async(dst + r * kMmaLd + k, w + int64_t{o0 + r} * in + k0 + k, 16);
          } else {
            *reinterpret_cast<uint4*>(dst + r * kMmaLd + k) = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      } else {
        for (int e = threadIdx.x; e < kTileOuts * kMmaK; e += 32 * kMmaWarps) {
          const int r = e / kMmaK, k = e % kMmaK;
          dst[r * kMmaLd + k] = __ushort_as_bfloat16(o0 + r < out && k0 + k < ke ? w[int64_t{o0 + r} * in + k0 + k]
                                                                                 : static_cast<uint16_t>(0));
        }
      }
    }
    __pipeline_commit();
  };
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragRows][kFragOuts];
#pragma unroll
  for (int i = 0; i < kFragRows; ++i) {
#pragma unroll
    for (int j = 0; j < kFragOuts; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  }
  // A whole round's x is read into registers a round ahead, every piece's load issued before any
  // is used: its latency then passes under the wait for the weights and the products, where
  // loading it at the top of its round put one L2 round trip per piece (8 in a row at 64 rows)
  // ahead of every round's products.
  constexpr int kXPieces = kTileRows * kMmaK / 4 / (32 * kMmaWarps);
  static_assert(kXPieces * 4 * 32 * kMmaWarps == kTileRows * kMmaK, "x pieces must cover the tile");
  float4 xr[kXPieces];
  auto x_whole = [&](int round) { return x_vec && kb + (round + 1) * kMmaK <= ke; };
  // Piece p of a thread: row xrow + p * kXRowStep of the tile, its 4 x at column xcol of the round.
  constexpr int kXRowStep = 32 * kMmaWarps / (kMmaK / 4);
  const int xrow = threadIdx.x / (kMmaK / 4), xcol = threadIdx.x % (kMmaK / 4) * 4;
  auto load_x = [&](int round) {
    const float* src = x + int64_t{r0 + xrow} * in + kb + round * kMmaK + xcol;
#pragma unroll
    for (int p = 0; p < kXPieces; ++p) {
      xr[p] = r0 + xrow + p * kXRowStep < rows ? *reinterpret_cast<const float4*>(src + int64_t{p} * kXRowStep * in)
                                               : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  for (int round = 0; round < kMmaStages - 1; ++round) stage_weights(round);
  if (rounds > 0 && x_whole(0)) load_x(0);
  for (int round = 0; round < rounds; ++round) {
    const int k0 = kb + round * kMmaK;
    // Into the buffer the last round multiplied from: every warp is past it (the barrier below).
    stage_weights(round + kMmaStages - 1);
    if (x_whole(round)) {
#pragma unroll
      for (int p = 0; p < kXPieces; ++p) {
        __nv_bfloat16* d = xs + (xrow + p * kXRowStep) * kMmaLd + xcol;
        d[0] = __float2bfloat16_rn(xr[p].x);
        d[1] = __float2bfloat16_rn(xr[p].y);
        d[2] = __float2bfloat16_rn(xr[p].z);
        d[3] = __float2bfloat16_rn(xr[p].w);
      }
    } else {
      for (int e = threadIdx.x; e < kTileRows * kMmaK; e += 32 * kMmaWarps) {
        const int r = e / kMmaK, k = e % kMmaK;
        xs[r * kMmaLd + k] =
            __float2bfloat16_rn(r0 + r < rows && k0 + k < ke ? x[int64_t{r0 + r} * in + k0 + k] : 0.f);
      }
    }
    if (round + 1 < rounds && x_whole(round + 1)) load_x(round + 1);
    __pipeline_wait_prior(kMmaStages - 1);  // this round's weights, as this thread copied them
    __syncthreads();                        // and as every thread did, with x
    // Steps wholly past the range add zeros; they are skipped, the same in every tile. Each
    // accumulator takes its steps in k order, whatever the tile's size: the same bits.
    const int steps = min(kMmaK, ke - k0 + 15) / 16;
    const __nv_bfloat16* wr = ws[round % kMmaStages];
    for (int t = 0; t < steps; ++t) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[kFragRows];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[kFragOuts];
#pragma unroll
      for (int i = 0; i < kFragRows; ++i) {
        wmma::load_matrix_sync(a[i], xs + (wm * kTileRows / 2 + 16 * i) * kMmaLd + 16 * t, kMmaLd);
      }
#pragma unroll
      for (int j = 0; j < kFragOuts; ++j) {
        wmma::load_matrix_sync(b[j], wr + (wn * kTileOuts / 2 + 16 * j) * kMmaLd + 16 * t, kMmaLd);
      }
#pragma unroll
      for (int i = 0; i < kFragRows; ++i) {
#pragma unroll
        for (int j = 0; j < kFragOuts; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
  // Out through one 16 x 16 buffer a warp, an accumulator at a time.
#pragma unroll
  for (int i = 0; i < kFragRows; ++i) {
#pragma unroll
    for (int j = 0; j < kFragOuts; ++j) {
      wmma::store_matrix_sync(cs[warp], acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 16 * 16; e += 32) {
        const int row = r0 + wm * kTileRows / 2 + 16 * i + (e >> 4);
        const int col = o0 + wn * kTileOuts / 2 + 16 * j + (e & 15);
        if (row >= rows || col >= out) continue;
        if (splits == 1) {
          LinearOut(cs[warp][e], row, col, out, bias, act, residual, alpha, y, kv, kv_rows, part);
        } else {
          partial[(int64_t{blockIdx.z} * rows + row) * out + col] = cs[warp][e];
        }
      }
      __syncwarp();
    }
  }
  if (splits == 1) return;
  // This block's sums reach global memory before its ticket is taken; the last taker's loads
  // bypass L1 (it holds nothing of other blocks' writes, but the rule costs nothing).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int tile = (part * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    last = atomicAdd(tickets + tile, 1u) == static_cast<unsigned>(splits - 1);
    if (last) tickets[tile] = 0u;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int64_t n = int64_t{rows} * out;
  for (int e = threadIdx.x; e < kTileRows * kTileOuts; e += 32 * kMmaWarps) {
    const int row = r0 + e / kTileOuts, col = o0 + e % kTileOuts;
    if (row >= rows || col >= out) continue;
    const float* p = partial + int64_t{part} * splits * n + int64_t{row} * out + col;
    float sum = __ldcg(p);
    for (int r = 1; r < splits; ++r) sum += __ldcg(p + r * n);
    LinearOut(sum, row, col, out, bias, act, residual, alpha, y, kv, kv_rows, part);
  }
}

#define RELGEN_MMA_PARAMS                                                                                   \
  const float *x, int rows, int in, const uint16_t *w, int out, const float *bias, int act, bool residual, \
      float alpha, float *y, int64_t w_stride, int64_t bias_stride, int64_t y_stride, KvPool kv, Rows kv_rows, \
      int splits, float *partial, unsigned *tickets
#define RELGEN_MMA_ARGS \
  x, rows, in, w, out, bias, act, residual, alpha, y, w_stride, bias_stride, y_stride, kv, kv_rows, splits, partial, tickets
// 32 x 32 tiles: few registers, 6-7 blocks a SM, for the decode steps' few rows.
__global__ void __launch_bounds__(32 * kMmaWarps, 6) LinearMmaKernel(RELGEN_MMA_PARAMS) {
  LinearMmaTile<32, 32>(RELGEN_MMA_ARGS);
}
// 64 x 64 tiles: four accumulators a warp and 41 KB of shared memory, 4 blocks a SM.
__global__ void __launch_bounds__(32 * kMmaWarps, 4) LinearMmaWideKernel(RELGEN_MMA_PARAMS) {
  LinearMmaTile<64, 64>(RELGEN_MMA_ARGS);
}
#undef RELGEN_MMA_PARAMS
#undef RELGEN_MMA_ARGS

}  // namespace

namespace {
template <typename TW>
cudaError_t LaunchLinear(const float* x, int rows, int in, const TW* w, int out, const float* bias, int act,
                         bool residual, float alpha, float* y, cudaStream_t s, int batch, int64_t w_stride,
                         int64_t bias_stride, int64_t y_stride, const KvPool& kv = KvPool{},
                         const Rows& kv_rows = Rows{}, bool mma = false, float* workspace = nullptr,
                         unsigned* tickets = nullptr) {
  if (in < 1 || out < 1 || batch < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if constexpr (std::is_same_v<TW, uint16_t>) {
    if (mma) {
      const int splits = LinearMmaSplits(in, out, batch);
      if (splits > 1 && (workspace == nullptr || tickets == nullptr)) return cudaErrorInvalidValue;
      // Row tiles adjacent in launch order: the tiles reading one weight tile run together, so it
      // comes from DRAM once and from L2 for the rest. From 64 rows, 64 x 64 tiles: each weight
      // tile is read by half as many blocks and each x row by half as many, so half the traffic
      // from L2 per product. The bits are the same either way (each output's k order is).
      if (rows >= kMmaWideRows) {
        const dim3 grid(Blocks(rows, 64), Blocks(out, 64), batch * splits);
        RELGEN_LAUNCH(LinearMmaWideKernel, grid, 32 * kMmaWarps, 0, s)(
            x, rows, in, w, out, bias, act, residual, alpha, y, w_stride, bias_stride, y_stride, kv, kv_rows, splits,
            workspace, tickets);
      } else {
        const dim3 grid(Blocks(rows, 32), Blocks(out, 32), batch * splits);
        RELGEN_LAUNCH(LinearMmaKernel, grid, 32 * kMmaWarps, 0, s)(
            x, rows, in, w, out, bias, act, residual, alpha, y, w_stride, bias_stride, y_stride, kv, kv_rows, splits,
            workspace, tickets);
      }
      return cudaGetLastError();
    }
  }
  // One row (a batch-1 decode step): a warp per output, eight 16-byte loads in flight per lane, so
  // the grid has 4x the warps and each a quarter of the round trips. Otherwise 4 outputs x 4 rows
  // per warp, two loads of each in flight. The same bits either way (see LinearKernel).
  if (rows == 1) {
    const dim3 grid(Blocks(out, kLinWarps), 1, batch);
    RELGEN_LAUNCH((LinearKernel<TW, 1, 1, 8>), grid, 32 * kLinWarps, 0, s)(x, rows, in, w, out, bias, act, residual,
                                                                         alpha, y, w_stride, bias_stride, y_stride,
                                                                         kv, kv_rows);
  } else {
    const dim3 grid(Blocks(out, kLinWarps * 4), Blocks(rows, 4), batch);
    RELGEN_LAUNCH((LinearKernel<TW, 4, 4, 2>), grid, 32 * kLinWarps, 0, s)(x, rows, in, w, out, bias, act, residual,
                                                                         alpha, y, w_stride, bias_stride, y_stride,
                                                                         kv, kv_rows);
  }
  return cudaGetLastError();
}

template <typename TW>
cudaError_t LaunchQkvToCache(const float* x, int rows, int in, const TW* w, int width, const float* bias, float* q,
                             const KvPool& kv, const Rows& kv_rows, cudaStream_t s, bool mma = false,
                             float* workspace = nullptr, unsigned* tickets = nullptr) {
  if (kv.k == nullptr || kv.v == nullptr || kv.n_heads * kv.head_dim != width || kv_rows.n != rows) {
    return cudaErrorInvalidValue;
  }
  return LaunchLinear(x, rows, in, w, width, bias, -1, false, 1.f, q, s, 3, int64_t{width} * in,
                      bias != nullptr ? width : 0, 0, kv, kv_rows, mma, workspace, tickets);
}
}  // namespace

cudaError_t Linear(const float* x, int rows, int in, const float* w, int out, const float* bias, int act, bool residual,
                   float alpha, float* y, cudaStream_t s, int batch, int64_t w_stride, int64_t bias_stride,
                   int64_t y_stride) {
  return LaunchLinear(x, rows, in, w, out, bias, act, residual, alpha, y, s, batch, w_stride, bias_stride, y_stride);
}

cudaError_t Linear(const float* x, int rows, int in, const uint16_t* w, int out, const float* bias, int act,
                   bool residual, float alpha, float* y, cudaStream_t s, int batch, int64_t w_stride,
                   int64_t bias_stride, int64_t y_stride) {
  return LaunchLinear(x, rows, in, w, out, bias, act, residual, alpha, y, s, batch, w_stride, bias_stride, y_stride);
}

int LinearMmaSplits(int in, int out, int batch) {
  const int64_t tiles = int64_t{(out + 31) / 32} * batch;
  int splits = 1;
  while (tiles * splits < kMmaBlocks && in >= 2 * splits * kMmaMinRange) splits *= 2;
  return splits;
}

int64_t LinearMmaWorkspace(int rows, int in, int out, int batch) {
  const int splits = LinearMmaSplits(in, out, batch);
  return splits > 1 ? int64_t{rows} * out * batch * splits : 0;
}

int64_t LinearMmaTickets(int rows, int in, int out, int batch) {
  return LinearMmaSplits(in, out, batch) > 1 ? int64_t{Blocks(rows, 32)} * Blocks(out, 32) * batch : 0;
}

cudaError_t LinearMma(const float* x, int rows, int in, const uint16_t* w, int out, const float* bias, int act,
                      bool residual, float alpha, float* y, cudaStream_t s, int batch, int64_t w_stride,
                      int64_t bias_stride, int64_t y_stride, float* workspace, unsigned* tickets) {
  return LaunchLinear(x, rows, in, w, out, bias, act, residual, alpha, y, s, batch, w_stride, bias_stride, y_stride,
                      KvPool{}, Rows{}, true, workspace, tickets);
}

cudaError_t QkvToCacheMma(const float* x, int rows, int in, const uint16_t* w, int width, const float* bias, float* q,
                          const KvPool& kv, const Rows& kv_rows, cudaStream_t s, float* workspace,
                          unsigned* tickets) {
  return LaunchQkvToCache(x, rows, in, w, width, bias, q, kv, kv_rows, s, true, workspace, tickets);
}

cudaError_t QkvToCache(const float* x, int rows, int in, const float* w, int width, const float* bias, float* q,
                       const KvPool& kv, const Rows& kv_rows, cudaStream_t s) {
  return LaunchQkvToCache(x, rows, in, w, width, bias, q, kv, kv_rows, s);
}

cudaError_t QkvToCache(const float* x, int rows, int in, const uint16_t* w, int width, const float* bias, float* q,
                       const KvPool& kv, const Rows& kv_rows, cudaStream_t s) {
  return LaunchQkvToCache(x, rows, in, w, width, bias, q, kv, kv_rows, s);
}

}  // namespace relgen::cuda
