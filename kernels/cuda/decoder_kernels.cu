#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <type_traits>

#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float Act(int act, float v) {
  switch (act) {
    case 0: return v > 0.f ? v : 0.f;
    case 1: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    case 2: return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case 3: return v / (1.f + expf(-v));
    default: return v;
  }
}

__global__ void EmbeddingKernel(const int32_t* ids, int n, const float* table, int dim, float scale, float* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= int64_t{n} * dim) return;
  const int64_t row = i / dim, col = i % dim;
  out[i] = table[int64_t{ids[row]} * dim + col] * scale;
}

__global__ void NormKernel(bool layernorm, const float* x, int dim, const float* w, const float* b, float eps, float* y) {
  __shared__ float red[32];
  const float* xr = x + int64_t{blockIdx.x} * dim;
  float* yr = y + int64_t{blockIdx.x} * dim;
  auto block_sum = [&](float v) {
    v = WarpSum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    if (threadIdx.x < 32) t = WarpSum(t);
    if (threadIdx.x == 0) red[0] = t;
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
  };
  float mean = 0.f;
  if (layernorm) {
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    mean = block_sum(s) / dim;
  }
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += (xr[i] - mean) * (xr[i] - mean);
  const float inv = rsqrtf(block_sum(ss) / dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    yr[i] = (xr[i] - mean) * inv * w[i] + (b != nullptr ? b[i] : 0.f);
  }
}

// `batch` matrices of n = rows * cols elements, batch_stride apart, each with its own bias row.
__global__ void BiasActivateKernel(float* y, int64_t n, int cols, const float* bias, int act, int batch,
                                   int64_t batch_stride) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n * batch) return;
  const int64_t b = i / n, e = i % n;
  float* const at = y + b * batch_stride + e;
  const float v = *at + (bias != nullptr ? bias[b * cols + e % cols] : 0.f);
  *at = Act(act, v);
}

__device__ __forceinline__ int64_t RowOffset(const KvPool& kv, const int32_t* table, int head, int pos) {
  const int64_t block = table[pos / kv.block_size];
  return ((block * kv.n_heads + head) * kv.block_size + pos % kv.block_size) * kv.head_dim;
}

// bf16 storage: cpu::ToBf16's rule (nearest even; a NaN stays a quiet NaN), on the bits so that
// no compiler flag changes it.
__device__ __forceinline__ uint16_t Bf16Bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ void Store(float* p, float f) { *p = f; }
__device__ __forceinline__ void Store(uint16_t* p, float f) { *p = Bf16Bits(f); }
__device__ __forceinline__ float Widen(float f) { return f; }
__device__ __forceinline__ float Widen(uint16_t h) { return __uint_as_float(uint32_t{h} << 16); }
// The two bf16 elements of a 32-bit word (the lower address in the low half).
__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Loads in flight per lane in the per-row attention kernel: 16-byte pieces of a K (or skew/Shaw
// E) row, and V rows. A round trip to memory per round is what bounds decode attention: on an H200,
// 8 of each against 2 took the batch-1 layer from 18.5 to 10.8 us and batch 64 from 82 to 75 us
// (docs/gpu-performance.md). Unrolling keeps the order of every sum, so the bits are the same.
constexpr int kRowLoads = 8, kVLoads = 8;
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

// Tensor cores, bf16 weights: a block of kMmaWarps warps computes 32 rows x 32 outputs, a 16 x 16
// tile per warp, over one of `splits` consecutive ranges of k (MmaSplitK). For each kMmaK of its
// range in turn, the block rounds its 32 rows of x to bf16 and stages them with the 32 weight rows
// in shared memory (zeros past rows, out and the range: 16-byte loads where the rows allow), and
// each warp adds kMmaK / 16 m16n16k16 products to its float accumulator, k ascending. One range:
// the epilogue runs here. Several: each range's sums go to `partial` [product][range][rows][out],
// and LinearMmaCombineKernel adds them in range order. An output's chain of operations is the same
// whichever rows share its tile and however deep a stage is, and the ranges depend on the shape
// alone: rows are batch invariant. Deep stages and the ranges keep the weights in flight when a
// decode step's few rows make a small grid.
constexpr int kMmaWarps = 4;
constexpr int kMmaK = 64;          // k staged per round
constexpr int kMmaLd = kMmaK + 8;  // staged row pitch in bf16: a multiple of 8, rows 16-byte aligned
constexpr int kMmaBlocks = 512;    // blocks a one-row launch should have (4 per SM on 132 SMs)
constexpr int kMmaMinRange = 256;  // k per range at least
__host__ __device__ __forceinline__ int MmaRangeK(int in, int splits) {
  return ((in + splits - 1) / splits + kMmaK - 1) / kMmaK * kMmaK;
}
__global__ void __launch_bounds__(32 * kMmaWarps) LinearMmaKernel(const float* x, int rows, int in, const uint16_t* w,
                                                                  int out, const float* bias, int act, bool residual,
                                                                  float alpha, float* y, int64_t w_stride,
                                                                  int64_t bias_stride, int64_t y_stride, KvPool kv,
                                                                  Rows kv_rows, int splits, float* partial) {
  namespace wmma = nvcuda::wmma;
  __shared__ __attribute__((aligned(32))) __nv_bfloat16 xs[32 * kMmaLd];
  __shared__ __attribute__((aligned(32))) __nv_bfloat16 ws[32 * kMmaLd];
  __shared__ __attribute__((aligned(32))) float cs[kMmaWarps][16 * 16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 1, wn = warp & 1;
  const int part = blockIdx.z / splits, range = blockIdx.z % splits;
  w += part * w_stride;
  y += part * y_stride;
  if (bias != nullptr) bias += part * bias_stride;
  const int r0 = blockIdx.x * 32, o0 = blockIdx.y * 32;
  const int kb = range * MmaRangeK(in, splits), ke = min(in, kb + MmaRangeK(in, splits));
  // 16-byte pieces: 8 weights, or 4 of x, when every row starts on 16 bytes.
  const bool w_vec = in % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0;
  const bool x_vec = in % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.f);
  for (int k0 = kb; k0 < ke; k0 += kMmaK) {
    const bool whole_k = k0 + kMmaK <= ke;
    if (w_vec && whole_k) {
      for (int e = threadIdx.x; e < 32 * kMmaK / 8; e += 32 * kMmaWarps) {
        const int r = e / (kMmaK / 8), k = (e % (kMmaK / 8)) * 8;
        const uint4 v = o0 + r < out ? *reinterpret_cast<const uint4*>(w + int64_t{o0 + r} * in + k0 + k)
                                     : make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(ws + r * kMmaLd + k) = v;
      }
    } else {
      for (int e = threadIdx.x; e < 32 * kMmaK; e += 32 * kMmaWarps) {
        const int r = e / kMmaK, k = e % kMmaK;
        ws[r * kMmaLd + k] = __ushort_as_bfloat16(o0 + r < out && k0 + k < ke ? w[int64_t{o0 + r} * in + k0 + k]
                                                                              : static_cast<uint16_t>(0));
      }
    }
    if (x_vec && whole_k) {
      for (int e = threadIdx.x; e < 32 * kMmaK / 4; e += 32 * kMmaWarps) {
        const int r = e / (kMmaK / 4), k = (e % (kMmaK / 4)) * 4;
        const float4 v = r0 + r < rows ? *reinterpret_cast<const float4*>(x + int64_t{r0 + r} * in + k0 + k)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
        __nv_bfloat16* d = xs + r * kMmaLd + k;
        d[0] = __float2bfloat16_rn(v.x);
        d[1] = __float2bfloat16_rn(v.y);
        d[2] = __float2bfloat16_rn(v.z);
        d[3] = __float2bfloat16_rn(v.w);
      }
    } else {
      for (int e = threadIdx.x; e < 32 * kMmaK; e += 32 * kMmaWarps) {
        const int r = e / kMmaK, k = e % kMmaK;
        xs[r * kMmaLd + k] =
            __float2bfloat16_rn(r0 + r < rows && k0 + k < ke ? x[int64_t{r0 + r} * in + k0 + k] : 0.f);
      }
    }
    __syncthreads();
    // Steps wholly past the range add zeros; they are skipped, the same in every tile.
    const int steps = min(kMmaK, ke - k0 + 15) / 16;
    for (int t = 0; t < steps; ++t) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
      wmma::load_matrix_sync(a, xs + 16 * wm * kMmaLd + 16 * t, kMmaLd);
      wmma::load_matrix_sync(b, ws + 16 * wn * kMmaLd + 16 * t, kMmaLd);
      wmma::mma_sync(acc, a, b, acc);
    }
    __syncthreads();
  }
  wmma::store_matrix_sync(cs[warp], acc, 16, wmma::mem_row_major);
  __syncwarp();
  for (int e = lane; e < 16 * 16; e += 32) {
    const int row = r0 + 16 * wm + (e >> 4), col = o0 + 16 * wn + (e & 15);
    if (row >= rows || col >= out) continue;
    if (splits == 1) {
      LinearOut(cs[warp][e], row, col, out, bias, act, residual, alpha, y, kv, kv_rows, part);
    } else {
      partial[(int64_t{blockIdx.z} * rows + row) * out + col] = cs[warp][e];
    }
  }
}

// The ranges' sums of each output added in range order, then LinearMmaKernel's epilogue. Grid: x
// over rows * out, y the product.
__global__ void LinearMmaCombineKernel(const float* partial, int splits, int rows, int out, const float* bias, int act,
                                       bool residual, float alpha, float* y, int64_t bias_stride, int64_t y_stride,
                                       KvPool kv, Rows kv_rows) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x, n = int64_t{rows} * out;
  if (i >= n) return;
  const int part = blockIdx.y;
  const float* p = partial + int64_t{part} * splits * n + i;
  float sum = p[0];
  for (int r = 1; r < splits; ++r) sum += p[r * n];
  LinearOut(sum, static_cast<int>(i / out), static_cast<int>(i % out), out,
            bias != nullptr ? bias + part * bias_stride : nullptr, act, residual, alpha, y + part * y_stride, kv,
            kv_rows, part);
}

__global__ void GatedKernel(int act, float* x, const float* gate, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) x[i] = Act(act, x[i]) * gate[i];
}

__global__ void AddKernel(float* y, const float* x, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) y[i] += x[i];
}

__global__ void RoundToBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) y[i] = Bf16Bits(x[i]);
}

template <typename T>
__global__ void WriteKvKernel(KvPool kv, Rows rows, const float* k, const float* v) {
  const int r = blockIdx.x, h = blockIdx.y;
  const int width = kv.n_heads * kv.head_dim;
  const int32_t* table = rows.block_tables + rows.table_offset[r];
  const int64_t dst = RowOffset(kv, table, h, rows.position[r]);
  T* const pk = static_cast<T*>(kv.k);
  T* const pv = static_cast<T*>(kv.v);
  for (int d = threadIdx.x; d < kv.head_dim; d += blockDim.x) {
    Store(pk + dst + d, k[int64_t{r} * width + h * kv.head_dim + d]);
    Store(pv + dst + d, v[int64_t{r} * width + h * kv.head_dim + d]);
  }
}

// T5's bucket of the signed relative position key_pos - query_pos, from the signed table
// (relpos::T5SignedBucketTable, centred at table_len / 2; farther positions clamp to its ends).
__device__ __forceinline__ int T5SignedBucket(const int32_t* table, int table_len, int relative) {
  const int half = table_len / 2;
  return table[(relative < -half ? -half : (relative > half ? half : relative)) + half];
}

// `nq` rows of q (in shared memory, head_dim floats apart; nq <= kQ) . one K or E row, by one
// thread, the row read once for all of them. Per q row four independent sums over 16-byte loads
// where head_dim allows (rows start at multiples of head_dim floats), added as (s0 + s1) + (s2 + s3):
// a q row's chain is the same whatever kQ and nq are, which is what makes the tiled kernel's
// scores those of the per-row kernel bit for bit. kLoads: 16-byte loads in flight (the loop's
// unrolling; the order of the sums is the same).
template <int kQ, int kLoads = 2>
__device__ __forceinline__ void RowDots(const float* qs, int nq, const float* row, int hd, float* dots) {
  float s[kQ][4];
#pragma unroll
  for (int q = 0; q < kQ; ++q) s[q][0] = s[q][1] = s[q][2] = s[q][3] = 0.f;
  if ((hd & 3) == 0) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll kLoads
    for (int i = 0; i < hd / 4; ++i) {
      const float4 a = r4[i];
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        if (q >= nq) break;
        const float4 b = reinterpret_cast<const float4*>(qs + q * hd)[i];
        s[q][0] += a.x * b.x;
        s[q][1] += a.y * b.y;
        s[q][2] += a.z * b.z;
        s[q][3] += a.w * b.w;
      }
    }
  } else {
    for (int d = 0; d < hd; ++d) {
      const float a = row[d];
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        if (q >= nq) break;
        s[q][0] += qs[q * hd + d] * a;
      }
    }
  }
#pragma unroll
  for (int q = 0; q < kQ; ++q) dots[q] = (s[q][0] + s[q][1]) + (s[q][2] + s[q][3]);
}

// The same over a bf16 row: 16-byte loads of eight elements where head_dim allows, each element
// widened exactly and summed into the partial sum a float row's element would go to.
template <int kQ, int kLoads = 2>
__device__ __forceinline__ void RowDots(const float* qs, int nq, const uint16_t* row, int hd, float* dots) {
  float s[kQ][4];
#pragma unroll
  for (int q = 0; q < kQ; ++q) s[q][0] = s[q][1] = s[q][2] = s[q][3] = 0.f;
  if ((hd & 7) == 0) {
    const uint4* r8 = reinterpret_cast<const uint4*>(row);
#pragma unroll kLoads
    for (int i = 0; i < hd / 8; ++i) {
      const uint4 a = r8[i];
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        if (q >= nq) break;
        const float4* q4 = reinterpret_cast<const float4*>(qs + q * hd);
        const float4 b = q4[2 * i], c = q4[2 * i + 1];
        s[q][0] += Lo(a.x) * b.x;
        s[q][1] += Hi(a.x) * b.y;
        s[q][2] += Lo(a.y) * b.z;
        s[q][3] += Hi(a.y) * b.w;
        s[q][0] += Lo(a.z) * c.x;
        s[q][1] += Hi(a.z) * c.y;
        s[q][2] += Lo(a.w) * c.z;
        s[q][3] += Hi(a.w) * c.w;
      }
    }
  } else {
    for (int d = 0; d < hd; ++d) {
      const float a = Widen(row[d]);
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        if (q >= nq) break;
        s[q][0] += qs[q * hd + d] * a;
      }
    }
  }
#pragma unroll
  for (int q = 0; q < kQ; ++q) dots[q] = (s[q][0] + s[q][1]) + (s[q][2] + s[q][3]);
}

template <int kLoads, typename T>
__device__ __forceinline__ float RowDot(const float* qs, const T* row, int hd) {
  float dot;
  RowDots<1, kLoads>(qs, 1, row, hd, &dot);
  return dot;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The score of query q (shared memory; at position pos) against key j whose q.K is `dot`: the
// relative term of their distance added (skew's and Shaw's q.E row, T5's bucket, ALiBi's slope).
// kBidirectional (an encoder): T5's buckets from the signed table.
template <bool kBidirectional, int kLoads>
__device__ __forceinline__ float Score(const Relative& rel, float scale, float dot, const float* qs, int hd, int h,
                                       int pos, int j) {
  const int th = rel.heads_share ? 0 : h;
  const int dist = pos - j;
  float rv = 0.f;
  if constexpr (kBidirectional) {
    if (rel.scheme == relpos::Scheme::kT5) {
      rv = rel.t5_bias[th * rel.t5_num_buckets + T5SignedBucket(rel.t5_bucket_of_distance, rel.t5_table_len, -dist)];
    }
  } else {
    switch (rel.scheme) {
      case relpos::Scheme::kSkew:
      case relpos::Scheme::kSkewLocal: {
        const int row = relpos::SkewRow(dist, rel.rows);
        if (row >= 0) rv = RowDot<kLoads>(qs, rel.table_k + (int64_t{th} * rel.rows + row) * hd, hd);
        break;
      }
      case relpos::Scheme::kShaw:
        rv = RowDot<kLoads>(qs, rel.table_k + (int64_t{th} * rel.rows + relpos::ShawRow(pos, j, rel.clip_k)) * hd, hd);
        break;
      case relpos::Scheme::kT5:
        rv = rel.t5_bias[th * rel.t5_num_buckets +
                         relpos::T5BucketOfDistance(rel.t5_bucket_of_distance, rel.t5_table_len, dist)];
        break;
      case relpos::Scheme::kAlibi:
        rv = relpos::AlibiBias(rel.alibi_slopes[h], dist);
        break;
      default:
        break;
    }
  }
  return scale * dot + (rel.scale_with_qk ? scale : 1.f) * rv;
}

// One tile of a warp's online softmax for one query: the lane's score s (-inf past the query's
// keys) joins the running max m and sum l; returns the lane's weight and in *corr the factor the
// running output takes. The tile's first key is live, so its max is finite.
__device__ __forceinline__ float OnlineSoftmax(float s, bool live, float& m, float& l, float* corr) {
  const float m_new = fmaxf(m, WarpMax(s));
  *corr = __expf(m - m_new);
  const float p = live ? __expf(s - m_new) : 0.f;
  l = l * *corr + WarpSum(p);
  m = m_new;
  return p;
}

// Warp 0 of the block merges the kWarps states in `merge` (each m, l, then head_dim sums) into the
// row's output (one split) or its split's partial state (part, several).
__device__ __forceinline__ void MergeWarps(const float* merge, int hd, int lane, float* out_row, float* part) {
  float big = -INFINITY;
  for (int w = 0; w < kWarps; ++w) big = fmaxf(big, merge[w * (hd + 2)]);
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    const float mw = merge[w * (hd + 2)];
    total += mw == -INFINITY ? 0.f : merge[w * (hd + 2) + 1] * __expf(mw - big);
  }
  for (int d = lane; d < hd; d += 32) {
    float a = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = merge[w * (hd + 2)];
      if (mw != -INFINITY) a += merge[w * (hd + 2) + 2 + d] * __expf(mw - big);
    }
    if (part == nullptr) {
      out_row[d] = a / total;
    } else {
      part[2 + d] = a;
    }
  }
  if (part != nullptr && lane == 0) {
    part[0] = big;
    part[1] = total;
  }
}

// The first key row r sees in split `split`, and one past its last.
template <bool kBidirectional>
__device__ __forceinline__ int SplitBegin(const Relative& rel, const Rows& rows, int r, int split, int keys_per_split) {
  const int ks = kBidirectional ? 0 : relpos::WindowStart(rel.scheme, rows.position[r], rel.block_length);
  return ks + split * keys_per_split;
}
template <bool kBidirectional>
__device__ __forceinline__ int SplitEnd(const Rows& rows, int r, int begin, int keys_per_split) {
  return min(kBidirectional ? rows.keys[r] : rows.position[r] + 1, begin + keys_per_split);
}

// One (row, head, key split) per block: decode, and every step whose sequences each bring one row
// (AttentionTileKernel takes prefill). Each warp takes tiles of 32 keys, one key per lane: the
// lane reads its key's block-table entry and K row (16-byte loads, all lanes' loads independent)
// and scores it; the tile then updates the warp's online softmax once (max and sum over the lanes),
// and every lane accumulates its head_dim / 32 output elements over the tile's V rows. The warps
// merge at the end. kBidirectional (an encoder): the row sees keys 0..rows.keys[r]-1 on both sides;
// otherwise causal. T: the pool's element (float, or uint16_t bf16 bits).
// At least 4 resident blocks per SM (tests/cuda_resources.py): caps ptxas at 128 registers, which
// go to loads in flight (kRowLoads, kVLoads).
template <bool kBidirectional, typename T>
__global__ void __launch_bounds__(32 * kWarps, 4) AttentionKernel(const float* q, Rows rows, float scale, Relative rel, KvPool kv, float* out,
                                float* workspace, int keys_per_split) {
  const int r = blockIdx.x, h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = kv.head_dim, width = kv.n_heads * hd;
  const int pos = rows.position[r];
  const int begin = SplitBegin<kBidirectional>(rel, rows, r, split, keys_per_split);
  const int end = SplitEnd<kBidirectional>(rows, r, begin, keys_per_split);
  float* const part = splits > 1 ? workspace + ((int64_t{r} * kv.n_heads + h) * splits + split) * (hd + 2) : nullptr;
  if (begin >= end) {  // a split past the row's keys (a grid sized for a longer context): merges as nothing
    if (threadIdx.x == 0 && part != nullptr) {
      part[0] = -INFINITY;
      part[1] = 0.f;
    }
    return;
  }
  const int32_t* table = rows.block_tables + rows.table_offset[r];
  const int th = rel.heads_share ? 0 : h;
  const float* extra_v = !kBidirectional && rel.scheme == relpos::Scheme::kShaw ? rel.table_v : nullptr;
  const T* const pk = static_cast<const T*>(kv.k);
  const T* const pv = static_cast<const T*>(kv.v);

  // q [hd]; the warps' merge, kWarps * (hd + 2); per warp its tile's weights [32]; then (8-byte
  // aligned) per warp its tile's K/V row offsets [32] (AttentionSharedBytes).
  RELGEN_DYNAMIC_SHARED(float, smem);
  float* const qs = smem;
  float* const tile_p = smem + hd + kWarps * (hd + 2) + warp * 32;
  int64_t* const tile_off =
      reinterpret_cast<int64_t*>(smem + ((hd + kWarps * (hd + 2) + kWarps * 32 + 1) & ~1)) + warp * 32;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[int64_t{r} * width + h * hd + d];
  __syncthreads();

  float acc[kMaxPerLane];
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) acc[t] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int base = begin + warp * 32; base < end; base += kWarps * 32) {
    const int j = base + lane;
    float s = -INFINITY;
    int64_t off = 0;
    if (j < end) {
      off = RowOffset(kv, table, h, j);
      s = Score<kBidirectional, kRowLoads>(rel, scale, RowDot<kRowLoads>(qs, pk + off, hd), qs, hd, h, pos, j);
    }
    float corr;
    const float p = OnlineSoftmax(s, j < end, m, l, &corr);
#pragma unroll
    for (int t = 0; t < kMaxPerLane; ++t) acc[t] *= corr;
    // The tile's weights and rows through shared memory: the V loop has no collective in it, so
    // its loads of several keys are in flight at once.
    tile_p[lane] = p;
    tile_off[lane] = off;
    __syncwarp();
    const int live = min(32, end - base);
#pragma unroll kVLoads
    for (int i = 0; i < live; ++i) {
      const float pi = tile_p[i];
      const T* vj = pv + tile_off[i];
      const float* xj = extra_v != nullptr
                            ? extra_v + (int64_t{th} * rel.rows + relpos::ShawRow(pos, base + i, rel.clip_k)) * hd
                            : nullptr;
#pragma unroll
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int d = lane + 32 * t;
        if (d < hd) acc[t] += pi * (Widen(vj[d]) + (xj != nullptr ? xj[d] : 0.f));
      }
    }
    __syncwarp();  // the next tile overwrites what other lanes may still read
  }

  float* mine = smem + hd + warp * (hd + 2);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int d = lane + 32 * t;
    if (d < hd) mine[2 + d] = acc[t];
  }
  if (lane == 0) {
    mine[0] = m;
    mine[1] = l;
  }
  __syncthreads();
  if (warp == 0) MergeWarps(smem + hd, hd, lane, out + int64_t{r} * width + h * hd, part);
}

size_t AttentionSharedBytes(int hd) {
  const int floats = (hd + kWarps * (hd + 2) + kWarps * 32 + 1) & ~1;
  return sizeof(float) * floats + kWarps * 32 * sizeof(int64_t);
}

// Prefill: the rows of a block (kQ consecutive rows of the step) in runs of rows that read the same
// keys (the same block table and, for local attention, the same window start: a chunk of one
// sequence's prompt, or one input of an encoder). A run's query rows sit in shared memory; each
// lane reads its key's K row once for all of them (kQ dot products per load) and each V row once
// for all of them, so a K/V row is read once per run instead of once per query row. Every query
// row's arithmetic is AttentionKernel's, operation for operation (the same splits, the same warp
// and tile for each key, the same sums in the same order, the same merge): the tiled kernel's
// output equals the per-row kernel's bit for bit, so a token's logits do not depend on how its
// prompt was chunked or whether it came by prefill or by decode. kPerLane: head_dim / 32 rounded
// up (2 or 8 instantiated).
template <bool kBidirectional, typename T, int kPerLane, int kQ>
__global__ void __launch_bounds__(32 * kWarps, 4) AttentionTileKernel(const float* q, Rows rows, float scale, Relative rel, KvPool kv,
                                    float* out, float* workspace, int keys_per_split) {
  const int h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = kv.head_dim, width = kv.n_heads * hd;
  const int th = rel.heads_share ? 0 : h;
  const float* extra_v = !kBidirectional && rel.scheme == relpos::Scheme::kShaw ? rel.table_v : nullptr;
  const T* const pk = static_cast<const T*>(kv.k);
  const T* const pv = static_cast<const T*>(kv.v);
  const int last = min(rows.n, (static_cast<int>(blockIdx.x) + 1) * kQ);

  // q [kQ][hd]; the warps' merge, kQ * kWarps * (hd + 2); per warp its tile's weights [kQ][32];
  // then (8-byte aligned) per warp its tile's K/V row offsets [32] (AttentionTileSharedBytes).
  RELGEN_DYNAMIC_SHARED(float, smem);
  float* const qs = smem;
  float* const merge = smem + kQ * hd;
  float* const tile_p = merge + kQ * kWarps * (hd + 2) + warp * kQ * 32;
  int64_t* const tile_off =
      reinterpret_cast<int64_t*>(smem + ((kQ * hd + kQ * kWarps * (hd + 2) + kWarps * kQ * 32 + 1) & ~1)) + warp * 32;

  for (int r0 = static_cast<int>(blockIdx.x) * kQ; r0 < last;) {
    const int offset = rows.table_offset[r0];
    const int begin = SplitBegin<kBidirectional>(rel, rows, r0, split, keys_per_split);
    int nq = 1;
    while (r0 + nq < last && rows.table_offset[r0 + nq] == offset &&
           SplitBegin<kBidirectional>(rel, rows, r0 + nq, split, keys_per_split) == begin) {
      ++nq;
    }
    const int32_t* table = rows.block_tables + offset;
    int pos[kQ], end[kQ];
    int end_max = begin;
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
      pos[i] = i < nq ? rows.position[r0 + i] : 0;
      end[i] = i < nq ? SplitEnd<kBidirectional>(rows, r0 + i, begin, keys_per_split) : begin;
      end_max = max(end_max, end[i]);
    }
    for (int i = threadIdx.x; i < nq * hd; i += blockDim.x) {
      qs[i] = q[int64_t{r0 + i / hd} * width + h * hd + i % hd];
    }
    __syncthreads();

    float acc[kQ][kPerLane], m[kQ], l[kQ];
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
      m[i] = -INFINITY;
      l[i] = 0.f;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) acc[i][t] = 0.f;
    }
    for (int base = begin + warp * 32; base < end_max; base += kWarps * 32) {
      const int j = base + lane;
      int64_t off = 0;
      float dots[kQ] = {};
      if (j < end_max) {
        off = RowOffset(kv, table, h, j);
        RowDots<kQ>(qs, nq, pk + off, hd, dots);
      }
#pragma unroll
      for (int i = 0; i < kQ; ++i) {
        if (i >= nq) break;
        if (base >= end[i]) continue;  // past this row's keys: the per-row kernel has no such tile
        const float s = j < end[i] ? Score<kBidirectional, 2>(rel, scale, dots[i], qs + i * hd, hd, h, pos[i], j) : -INFINITY;
        float corr;
        tile_p[i * 32 + lane] = OnlineSoftmax(s, j < end[i], m[i], l[i], &corr);
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) acc[i][t] *= corr;
      }
      tile_off[lane] = off;
      __syncwarp();
      const int live = min(32, end_max - base);
      for (int k = 0; k < live; ++k) {
        const T* vj = pv + tile_off[k];
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) {
          const int d = lane + 32 * t;
          if (d >= hd) break;
          const float vd = Widen(vj[d]);
#pragma unroll
          for (int i = 0; i < kQ; ++i) {
            if (i >= nq) break;
            if (k >= end[i] - base) continue;
            const float x = extra_v != nullptr
                                ? extra_v[(int64_t{th} * rel.rows + relpos::ShawRow(pos[i], base + k, rel.clip_k)) * hd + d]
                                : 0.f;
            acc[i][t] += tile_p[i * 32 + k] * (vd + x);
          }
        }
      }
      __syncwarp();  // the next tile overwrites what other lanes may still read
    }

    // Merge the warps: every row's states through shared memory, then warp 0 merges row by row.
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
      if (i >= nq) break;
      float* mine = merge + (i * kWarps + warp) * (hd + 2);
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (d < hd) mine[2 + d] = acc[i][t];
      }
      if (lane == 0) {
        mine[0] = m[i];
        mine[1] = l[i];
      }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < kQ; ++i) {
        if (i >= nq) break;
        const int r = r0 + i;
        float* const part =
            splits > 1 ? workspace + ((int64_t{r} * kv.n_heads + h) * splits + split) * (hd + 2) : nullptr;
        if (begin < end[i]) {
          MergeWarps(merge + i * kWarps * (hd + 2), hd, lane, out + int64_t{r} * width + h * hd, part);
        } else if (lane == 0 && part != nullptr) {  // as the per-row kernel: merges as nothing
          part[0] = -INFINITY;
          part[1] = 0.f;
        }
      }
    }
    __syncthreads();  // the next run's q rows overwrite these
    r0 += nq;
  }
}

constexpr int kTileRows = 4;

size_t AttentionTileSharedBytes(int hd) {
  const int floats = (kTileRows * hd + kTileRows * kWarps * (hd + 2) + kWarps * kTileRows * 32 + 1) & ~1;
  return sizeof(float) * floats + kWarps * 32 * sizeof(int64_t);
}

__host__ __device__ constexpr int CombinePadded(int splits) { return (splits + 3) / 4 * 4; }

// Merges the key splits of each (row, head): each split's weight exp(m_s - max) once, into shared
// memory (a split with no keys gets -1: none), then every output dim and the total add the splits in
// order.
__global__ void CombineKernel(const float* workspace, int splits, int n_heads, int hd, float* out) {
  RELGEN_DYNAMIC_SHARED(float, weight);  // [splits]; -1 marks a split with no keys
  __shared__ float warp_big[32];
  const int r = blockIdx.x, h = blockIdx.y;
  const float* parts = workspace + (int64_t{r} * n_heads + h) * splits * (hd + 2);
  float big = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) big = fmaxf(big, parts[s * (hd + 2)]);
  for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
  if ((threadIdx.x & 31) == 0) warp_big[threadIdx.x >> 5] = big;
  __syncthreads();
  big = warp_big[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) big = fmaxf(big, warp_big[w]);
  // Padded to whole 16-byte words: ptxas reads the weights four at a time, past the last split.
  for (int s = threadIdx.x; s < CombinePadded(splits); s += blockDim.x) {
    const float ms = s < splits ? parts[s * (hd + 2)] : -INFINITY;
    weight[s] = ms != -INFINITY ? __expf(ms - big) : -1.f;
  }
  __syncthreads();
  float total = 0.f;
  for (int s = 0; s < splits; ++s) {
    if (weight[s] >= 0.f) total += parts[s * (hd + 2) + 1] * weight[s];
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < splits; ++s) {
      if (weight[s] >= 0.f) a += parts[s * (hd + 2) + 2 + d] * weight[s];
    }
    out[int64_t{r} * n_heads * hd + h * hd + d] = a / total;
  }
}

unsigned Blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

cudaError_t Embedding(const int32_t* ids, int n, const float* table, int dim, float scale, float* out, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(EmbeddingKernel, Blocks(int64_t{n} * dim, 256), 256, 0, s)(ids, n, table, dim, scale, out);
  return cudaGetLastError();
}

cudaError_t Norm(bool layernorm, const float* x, int rows, int dim, const float* w, const float* b, float eps, float* y,
                 cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  RELGEN_LAUNCH(NormKernel, rows, 256, 0, s)(layernorm, x, dim, w, b, eps, y);
  return cudaGetLastError();
}

cudaError_t BiasActivate(float* y, int rows, int cols, const float* bias, int act, cudaStream_t s, int batch,
                         int64_t batch_stride) {
  const int64_t n = int64_t{rows} * cols;
  if (n == 0 || batch == 0) return cudaSuccess;
  RELGEN_LAUNCH(BiasActivateKernel, Blocks(n * batch, 256), 256, 0, s)(y, n, cols, bias, act, batch, batch_stride);
  return cudaGetLastError();
}

namespace {
template <typename TW>
cudaError_t LaunchLinear(const float* x, int rows, int in, const TW* w, int out, const float* bias, int act,
                         bool residual, float alpha, float* y, cudaStream_t s, int batch, int64_t w_stride,
                         int64_t bias_stride, int64_t y_stride, const KvPool& kv = KvPool{},
                         const Rows& kv_rows = Rows{}, bool mma = false, float* workspace = nullptr) {
  if (in < 1 || out < 1 || batch < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if constexpr (std::is_same_v<TW, uint16_t>) {
    if (mma) {
      const int splits = LinearMmaSplits(in, out, batch);
      if (splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
      // Row tiles adjacent in launch order: the tiles reading one weight tile run together, so it
      // comes from DRAM once and from L2 for the rest.
      const dim3 grid(Blocks(rows, 32), Blocks(out, 32), batch * splits);
      RELGEN_LAUNCH(LinearMmaKernel, grid, 32 * kMmaWarps, 0, s)(x, rows, in, w, out, bias, act, residual, alpha, y,
                                                                  w_stride, bias_stride, y_stride, kv, kv_rows,
                                                                  splits, workspace);
      if (splits == 1) return cudaGetLastError();
      if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
      RELGEN_LAUNCH(LinearMmaCombineKernel, dim3(Blocks(int64_t{rows} * out, 256), batch), 256, 0, s)(
          workspace, splits, rows, out, bias, act, residual, alpha, y, bias_stride, y_stride, kv, kv_rows);
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
                             float* workspace = nullptr) {
  if (kv.k == nullptr || kv.v == nullptr || kv.n_heads * kv.head_dim != width || kv_rows.n != rows) {
    return cudaErrorInvalidValue;
  }
  return LaunchLinear(x, rows, in, w, width, bias, -1, false, 1.f, q, s, 3, int64_t{width} * in,
                      bias != nullptr ? width : 0, 0, kv, kv_rows, mma, workspace);
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

cudaError_t LinearMma(const float* x, int rows, int in, const uint16_t* w, int out, const float* bias, int act,
                      bool residual, float alpha, float* y, cudaStream_t s, int batch, int64_t w_stride,
                      int64_t bias_stride, int64_t y_stride, float* workspace) {
  return LaunchLinear(x, rows, in, w, out, bias, act, residual, alpha, y, s, batch, w_stride, bias_stride, y_stride,
                      KvPool{}, Rows{}, true, workspace);
}

cudaError_t QkvToCacheMma(const float* x, int rows, int in, const uint16_t* w, int width, const float* bias, float* q,
                          const KvPool& kv, const Rows& kv_rows, cudaStream_t s, float* workspace) {
  return LaunchQkvToCache(x, rows, in, w, width, bias, q, kv, kv_rows, s, true, workspace);
}

cudaError_t QkvToCache(const float* x, int rows, int in, const float* w, int width, const float* bias, float* q,
                       const KvPool& kv, const Rows& kv_rows, cudaStream_t s) {
  return LaunchQkvToCache(x, rows, in, w, width, bias, q, kv, kv_rows, s);
}

cudaError_t QkvToCache(const float* x, int rows, int in, const uint16_t* w, int width, const float* bias, float* q,
                       const KvPool& kv, const Rows& kv_rows, cudaStream_t s) {
  return LaunchQkvToCache(x, rows, in, w, width, bias, q, kv, kv_rows, s);
}

cudaError_t ActivateGated(int act, float* x, const float* gate, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(GatedKernel, Blocks(n, 256), 256, 0, s)(act, x, gate, n);
  return cudaGetLastError();
}

cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(AddKernel, Blocks(n, 256), 256, 0, s)(y, x, n);
  return cudaGetLastError();
}

cudaError_t RoundToBf16(const float* x, int64_t n, uint16_t* y, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(RoundToBf16Kernel, Blocks(n, 256), 256, 0, s)(x, n, y);
  return cudaGetLastError();
}

cudaError_t WriteKv(const KvPool& kv, const Rows& rows, const float* k, const float* v, cudaStream_t s) {
  if (rows.n == 0) return cudaSuccess;
  if (kv.type == KvElem::kBf16) {
    RELGEN_LAUNCH(WriteKvKernel<uint16_t>, dim3(rows.n, kv.n_heads), 64, 0, s)(kv, rows, k, v);
  } else {
    RELGEN_LAUNCH(WriteKvKernel<float>, dim3(rows.n, kv.n_heads), 64, 0, s)(kv, rows, k, v);
  }
  return cudaGetLastError();
}

int64_t AttentionWorkspace(int rows, int n_heads, int head_dim, int max_keys, int keys_per_split) {
  const int splits = (max_keys + keys_per_split - 1) / keys_per_split;
  return splits > 1 ? int64_t{rows} * n_heads * splits * (head_dim + 2) : 0;
}

namespace {

template <bool kBidirectional, int kPerLane>
void LaunchTiles(const float* q, const Rows& rows, float scale, const Relative& rel, const KvPool& kv, float* out,
                 float* workspace, int keys_per_split, int splits, cudaStream_t s) {
  const dim3 grid((rows.n + kTileRows - 1) / kTileRows, kv.n_heads, splits);
  const size_t smem = AttentionTileSharedBytes(kv.head_dim);
  if (kv.type == KvElem::kBf16) {
    RELGEN_LAUNCH((AttentionTileKernel<kBidirectional, uint16_t, kPerLane, kTileRows>), grid, 32 * kWarps, smem, s)(
        q, rows, scale, rel, kv, out, workspace, keys_per_split);
  } else {
    RELGEN_LAUNCH((AttentionTileKernel<kBidirectional, float, kPerLane, kTileRows>), grid, 32 * kWarps, smem, s)(
        q, rows, scale, rel, kv, out, workspace, keys_per_split);
  }
}

template <bool kBidirectional>
cudaError_t LaunchAttention(const float* q, const Rows& rows, int max_keys, float scale, const Relative& rel,
                            const KvPool& kv, float* out, float* workspace, int keys_per_split, cudaStream_t s,
                            bool tiled) {
  if (kv.head_dim > 32 * kMaxPerLane || kv.head_dim < 1) return cudaErrorInvalidValue;  // dispatch: head_dim <= 256
  if (rows.n == 0) return cudaSuccess;
  const int splits = (max_keys + keys_per_split - 1) / keys_per_split;
  if (tiled && kv.head_dim <= 64) {
    LaunchTiles<kBidirectional, 2>(q, rows, scale, rel, kv, out, workspace, keys_per_split, splits, s);
  } else if (tiled) {
    LaunchTiles<kBidirectional, kMaxPerLane>(q, rows, scale, rel, kv, out, workspace, keys_per_split, splits, s);
  } else {
    const size_t smem = AttentionSharedBytes(kv.head_dim);
    const dim3 grid(rows.n, kv.n_heads, splits);
    if (kv.type == KvElem::kBf16) {
      RELGEN_LAUNCH((AttentionKernel<kBidirectional, uint16_t>), grid, 32 * kWarps, smem, s)(
          q, rows, scale, rel, kv, out, workspace, keys_per_split);
    } else {
      RELGEN_LAUNCH((AttentionKernel<kBidirectional, float>), grid, 32 * kWarps, smem, s)(
          q, rows, scale, rel, kv, out, workspace, keys_per_split);
    }
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  RELGEN_LAUNCH(CombineKernel, dim3(rows.n, kv.n_heads), 64, CombinePadded(splits) * sizeof(float), s)(
      workspace, splits, kv.n_heads, kv.head_dim, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t Attention(const float* q, const Rows& rows, int max_keys, float scale, const Relative& rel, const KvPool& kv,
                      float* out, float* workspace, int keys_per_split, cudaStream_t s, bool tiled) {
  return LaunchAttention<false>(q, rows, max_keys, scale, rel, kv, out, workspace, keys_per_split, s, tiled);
}

cudaError_t AttentionBidirectional(const float* q, const Rows& rows, int max_keys, float scale, const Relative& rel,
                                   const KvPool& kv, float* out, float* workspace, int keys_per_split,
                                   cudaStream_t s, bool tiled) {
  if (rel.scheme != relpos::Scheme::kNone && rel.scheme != relpos::Scheme::kT5) return cudaErrorInvalidValue;
  if (rows.n > 0 && rows.keys == nullptr) return cudaErrorInvalidValue;
  return LaunchAttention<true>(q, rows, max_keys, scale, rel, kv, out, workspace, keys_per_split, s, tiled);
}

}  // namespace relgen::cuda
