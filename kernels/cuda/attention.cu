// Paged attention with every relative scheme's term: the per-row kernel (decode), the tiled kernel
// (prefill; the same bits row for row), and the merge of key splits.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256

// Loads in flight per lane in the per-row attention kernel: 16-byte pieces of a K (or skew/Shaw
// E) row, and V rows. A round trip to memory per round is what bounds decode attention: on an H200,
// 8 of each against 2 took the batch-1 layer from 18.5 to 10.8 us and batch 64 from 82 to 75 us
// (docs/gpu-performance.md). Unrolling keeps the order of every sum, so the bits are the same.
constexpr int kRowLoads = 8, kVLoads = 8;

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
    if (rel.scheme == relpos::Scheme::kT5) rv = T5SignedBias(rel, th, dist);
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
      default:
        rv = CausalScalarBias(rel, th, h, dist);
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

}  // namespace

cudaError_t AttentionCombine(const float* workspace, int rows, int n_heads, int head_dim, int splits, float* out,
                             cudaStream_t s) {
  RELGEN_LAUNCH(CombineKernel, dim3(rows, n_heads), 64, CombinePadded(splits) * sizeof(float), s)(
      workspace, splits, n_heads, head_dim, out);
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
  return AttentionCombine(workspace, rows.n, kv.n_heads, kv.head_dim, splits, out, s);
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
