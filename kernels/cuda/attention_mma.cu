// Paged attention on tensor cores (bf16 K/V cache, head_dim 16, 32, 64 or 128): q . K, the skew /
// Shaw q . E term and P . V as m16n16k16 bf16 products with float accumulators, the softmax in
// float32, every scheme's relative term added in the kernel. One kernel for prefill, chunked
// prefill and decode: a block takes up to 16 query rows of one sequence (decode: one row, the
// tile's other rows zero), so a row's arithmetic is the same whichever rows share its tile.
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/launch.h"

namespace relgen::cuda {
namespace {

using namespace nvcuda;

constexpr int kAmWarps = 4;
constexpr int kAmThreads = 32 * kAmWarps;
constexpr int kAmRows = 16;                 // query rows of a tile
constexpr int kAmKeys = 32;                 // keys of a tile, from the split's first key on
constexpr int kAmSpan = kAmKeys + kAmRows;  // distances a tile's q . E covers (47 used)

// The block's shared memory for head_dim hd (bf16 rows hd + 8 apart: 16-byte aligned, and the
// rows of a fragment fall in different banks). Offsets in bytes, each a multiple of 32.
struct AmLayout {
  int ldh, ldo;  // bf16 row pitch; float row pitch of the P . V tile
  int q, k, v, e, s, g, p, state, bytes;
  __host__ __device__ explicit AmLayout(int hd) {
    ldh = hd + 8;
    ldo = hd + 4;
    const int rows_e = kAmSpan * ldh * 2, pv = kAmRows * ldo * 4;
    q = 0;
    k = q + kAmRows * ldh * 2;
    v = k + kAmKeys * ldh * 2;
    e = v + kAmKeys * ldh * 2;  // E's rows for q . E, then (consumed) the P . V tile
    s = e + (rows_e > pv ? rows_e : pv);
    g = s + kAmRows * kAmKeys * 4;
    p = g + kAmRows * kAmSpan * 4;
    state = p + kAmRows * (kAmKeys + 8) * 2;
    bytes = state + 4 * kAmRows * 4;
  }
};

// One tile's rows (a run: consecutive rows of the step with the same block table and first key,
// positions within 16 of the first's) and their state.
struct AmRun {
  int r0, nq, begin, end_max, pmin;
};

template <bool kBidirectional>
__device__ __forceinline__ int AmBegin(const Relative& rel, const Rows& rows, int r, int split,
                                       int keys_per_split) {
  const int ks =
      kBidirectional ? 0 : relpos::WindowStart(rel.scheme, rows.position[r], rel.block_length);
  return ks + split * keys_per_split;
}
template <bool kBidirectional>
__device__ __forceinline__ int AmEnd(const Rows& rows, int r, int begin, int keys_per_split) {
  return min(kBidirectional ? rows.keys[r] : rows.position[r] + 1, begin + keys_per_split);
}

// The E row (skew or Shaw keys) of distance query_pos - key_pos, or -1: none (a zero term).
// Skew has rows for distances 0 .. rows - 1 only (a tile's masked keys ahead of the query too).
__device__ __forceinline__ int AmRelRow(const Relative& rel, int distance) {
  if (rel.scheme == relpos::Scheme::kShaw) return relpos::ShawRow(distance, 0, rel.clip_k);
  return distance >= 0 ? relpos::SkewRow(distance, rel.rows) : -1;
}

// 16-byte copies of a bf16 row of the pool into shared memory; zeros for a row past the keys.
__device__ __forceinline__ void AmCopyRow(const uint16_t* src, __nv_bfloat16* dst, int hd,
                                          int piece) {
  reinterpret_cast<uint4*>(dst)[piece] =
      src != nullptr ? reinterpret_cast<const uint4*>(src)[piece] : make_uint4(0u, 0u, 0u, 0u);
}

// grid (row groups, heads, splits); a block's group is rows_per_block consecutive rows (1 for
// decode, 16 for prefill), taken run by run. Per key tile of 32: K, V (and E's rows for the tile's
// distances) into shared memory; the warps' products S = q . K^T and G = q . E^T; the softmax
// threads (8 a row, 4 keys each) add the relative term, update the row's running max and sum in
// a fixed butterfly and write P (bf16) and the row's correction; the warps' P . V; each thread
// rescales its elements of the row's output and adds the tile (and Shaw's value rows, in float
// on CUDA cores). A key past a row's end scores -inf; a tile past it leaves the row as it was: the
// row's bits are those of the row alone. Keys are loaded only below the run's last end.
template <bool kBidirectional, int kHd>
__global__ void __launch_bounds__(kAmThreads, 4)
    AttentionMmaKernel(const float* q, Rows rows, int rows_per_block, float scale, Relative rel,
                       KvPool kv, float* out, float* workspace, int keys_per_split) {
  const int h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  constexpr int hd = kHd;
  const int width = kv.n_heads * hd;
  const int th = rel.heads_share ? 0 : h;
  const bool rel_k = !kBidirectional && (rel.scheme == relpos::Scheme::kSkew ||
                                         rel.scheme == relpos::Scheme::kSkewLocal ||
                                         rel.scheme == relpos::Scheme::kShaw);
  const float* const extra_v =
      !kBidirectional && rel.scheme == relpos::Scheme::kShaw ? rel.table_v : nullptr;
  const float rel_scale = rel.scale_with_qk ? scale : 1.f;
  const uint16_t* const pk = static_cast<const uint16_t*>(kv.k);
  const uint16_t* const pv = static_cast<const uint16_t*>(kv.v);
  const AmLayout lay(hd);
  const int ldh = lay.ldh, ldo = lay.ldo, pieces = hd / 8;

  RELGEN_DYNAMIC_SHARED(float, smem_f);
  char* const smem = reinterpret_cast<char*>(smem_f);
  __nv_bfloat16* const qs = reinterpret_cast<__nv_bfloat16*>(smem + lay.q);
  __nv_bfloat16* const ks = reinterpret_cast<__nv_bfloat16*>(smem + lay.k);
  __nv_bfloat16* const vs = reinterpret_cast<__nv_bfloat16*>(smem + lay.v);
  __nv_bfloat16* const es = reinterpret_cast<__nv_bfloat16*>(smem + lay.e);
  float* const pvs = reinterpret_cast<float*>(smem + lay.e);
  float* const ss = reinterpret_cast<float*>(smem + lay.s);
  float* const gs = reinterpret_cast<float*>(smem + lay.g);
  __nv_bfloat16* const ps = reinterpret_cast<__nv_bfloat16*>(smem + lay.p);
  float* const st_m = reinterpret_cast<float*>(smem + lay.state);
  float* const st_l = st_m + kAmRows;
  float* const st_corr = st_l + kAmRows;
  int* const st_live = reinterpret_cast<int*>(st_corr + kAmRows);

  const int first = static_cast<int>(blockIdx.x) * rows_per_block;
  const int last = min(rows.n, first + rows_per_block);
  // The softmax thread's row and keys; the output elements a thread owns (e = tid + 128 i).
  const int srow = tid >> 3, skey = (tid & 7) * 4;
  constexpr int owned = kAmRows * hd / kAmThreads;  // 2 to 16

  for (int r0 = first; r0 < last;) {
    const int offset = rows.table_offset[r0];
    const int begin = AmBegin<kBidirectional>(rel, rows, r0, split, keys_per_split);
    int nq = 1, pmin = rows.position[r0], pmax = pmin;
    while (r0 + nq < last && nq < kAmRows && rows.table_offset[r0 + nq] == offset &&
           AmBegin<kBidirectional>(rel, rows, r0 + nq, split, keys_per_split) == begin) {
      const int p = rows.position[r0 + nq];
      if (max(pmax, p) - min(pmin, p) >= kAmRows) break;
      pmin = min(pmin, p);
      pmax = max(pmax, p);
      ++nq;
    }
    const int32_t* table = rows.block_tables + offset;
    // This thread's softmax row (none past nq: its scores stay -inf and it writes nothing).
    const bool srow_in = srow < nq;
    const int spos = srow_in ? rows.position[r0 + srow] : 0;
    const int send =
        srow_in ? AmEnd<kBidirectional>(rows, r0 + srow, begin, keys_per_split) : begin;
    int end_max = begin;
    for (int i = 0; i < nq; ++i)
      end_max = max(end_max, AmEnd<kBidirectional>(rows, r0 + i, begin, keys_per_split));

    for (int i = tid; i < kAmRows * hd; i += kAmThreads) {
      const int r = i / hd, d = i % hd;
      qs[r * ldh + d] = __float2bfloat16_rn(r < nq ? q[int64_t{r0 + r} * width + h * hd + d] : 0.f);
    }
    if (tid < kAmRows) {
      st_m[tid] = -INFINITY;
      st_l[tid] = 0.f;
    }
    float acc[owned];
#pragma unroll
    for (int i = 0; i < owned; ++i) acc[i] = 0.f;
    __syncthreads();

    for (int j0 = begin; j0 < end_max; j0 += kAmKeys) {
      // K and V rows of the tile; E's rows of distances pmin - j0 - 31 ... in order.
      const int dmin = pmin - j0 - (kAmKeys - 1);
      for (int i = tid; i < kAmKeys * pieces; i += kAmThreads) {
        const int c = i / pieces, piece = i % pieces, j = j0 + c;
        const int64_t off = j < end_max ? RowOffset(kv, table, h, j) : -1;
        AmCopyRow(off >= 0 ? pk + off : nullptr, ks + c * ldh, hd, piece);
        AmCopyRow(off >= 0 ? pv + off : nullptr, vs + c * ldh, hd, piece);
      }
      if (rel_k) {
        for (int i = tid; i < kAmSpan * hd; i += kAmThreads) {
          const int t = i / hd, d = i % hd;
          const int row = AmRelRow(rel, dmin + t);
          es[t * ldh + d] = __float2bfloat16_rn(
              row >= 0 ? rel.table_k[(int64_t{th} * rel.rows + row) * hd + d] : 0.f);
        }
      }
      __syncthreads();
      // S (2 tiles of 16 keys) and G (3 tiles of 16 distances): warp w takes tiles w and w + 4.
      const int tiles = kAmKeys / 16 + (rel_k ? kAmSpan / 16 : 0);
      for (int t = warp; t < tiles; t += kAmWarps) {
        const bool is_s = t < kAmKeys / 16;
        const __nv_bfloat16* bsrc = is_s ? ks + t * 16 * ldh : es + (t - kAmKeys / 16) * 16 * ldh;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
        wmma::fill_fragment(c, 0.f);
        for (int kk = 0; kk < hd; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
          wmma::load_matrix_sync(a, qs + kk, ldh);
          wmma::load_matrix_sync(b, bsrc + kk, ldh);
          wmma::mma_sync(c, a, b, c);
        }
        if (is_s) {
          wmma::store_matrix_sync(ss + t * 16, c, kAmKeys, wmma::mem_row_major);
        } else {
          wmma::store_matrix_sync(gs + (t - kAmKeys / 16) * 16, c, kAmSpan, wmma::mem_row_major);
        }
      }
      __syncthreads();

      // Softmax: scores of this thread's 4 keys, the row's max and sum over its 8 threads.
      const bool row_live = srow_in && j0 < send;
      float sc[4];
      float tile_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = skey + u, j = j0 + c;
        sc[u] = -INFINITY;
        if (row_live && j < send) {
          const int dist = spos - j;
          float rv = 0.f;
          if constexpr (kBidirectional) {
            if (rel.scheme == relpos::Scheme::kT5) rv = T5SignedBias(rel, th, dist);
          } else {
            switch (rel.scheme) {
              case relpos::Scheme::kSkew:
              case relpos::Scheme::kSkewLocal:
              case relpos::Scheme::kShaw:
                rv = gs[srow * kAmSpan + (dist - dmin)];
                break;
              default:
                rv = CausalScalarBias(rel, th, h, dist);
                break;
            }
          }
          sc[u] = scale * ss[srow * kAmKeys + c] + rel_scale * rv;
          tile_max = fmaxf(tile_max, sc[u]);
        }
      }
      for (int o = 4; o > 0; o >>= 1)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      const float m_old = srow_in ? st_m[srow] : -INFINITY;
      const float m_new = row_live ? fmaxf(m_old, tile_max) : m_old;
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float p = sc[u] != -INFINITY ? __expf(sc[u] - m_new) : 0.f;
        sum += p;
        ss[srow * kAmKeys + skey + u] = p;  // float weights, for Shaw's value rows
        ps[srow * (kAmKeys + 8) + skey + u] = __float2bfloat16_rn(p);
      }
      for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncthreads();  // every thread has read the row's old state
      if ((tid & 7) == 0 && srow_in) {
        const float corr = row_live ? __expf(m_old - m_new) : 1.f;
        st_corr[srow] = corr;
        st_live[srow] = row_live;
        if (row_live) {
          st_m[srow] = m_new;
          st_l[srow] = st_l[srow] * corr + sum;
        }
      } else if ((tid & 7) == 0) {
        st_live[srow] = 0;
      }

      // P . V: warp w takes the 16-column tiles w, w + 4 of the output, into the E region.
      for (int t = warp; t < hd / 16; t += kAmWarps) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
        wmma::fill_fragment(c, 0.f);
        for (int kk = 0; kk < kAmKeys; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
          wmma::load_matrix_sync(a, ps + kk, kAmKeys + 8);
          wmma::load_matrix_sync(b, vs + kk * ldh + t * 16, ldh);
          wmma::mma_sync(c, a, b, c);
        }
        wmma::store_matrix_sync(pvs + t * 16, c, ldo, wmma::mem_row_major);
      }
      __syncthreads();

#pragma unroll
      for (int i = 0; i < owned; ++i) {
        const int e = tid + kAmThreads * i, r = e / hd, d = e % hd;
        if (r >= nq || !st_live[r]) continue;
        float x = 0.f;
        if (extra_v != nullptr) {
          const int pos = rows.position[r0 + r];
          for (int c = 0; c < kAmKeys; ++c) {
            const float p = ss[r * kAmKeys + c];
            if (p != 0.f)
              x +=
                  p *
                  extra_v[(int64_t{th} * rel.rows + relpos::ShawRow(pos, j0 + c, rel.clip_k)) * hd +
                          d];
          }
        }
        acc[i] = acc[i] * st_corr[r] + (pvs[r * ldo + d] + x);
      }
      __syncthreads();  // the next tile overwrites K, V, E, S and P
    }

#pragma unroll
    for (int i = 0; i < owned; ++i) {
      const int e = tid + kAmThreads * i, r = e / hd, d = e % hd;
      if (r >= nq) continue;
      const int row = r0 + r;
      const bool any = begin < AmEnd<kBidirectional>(rows, row, begin, keys_per_split);
      if (splits == 1) {
        out[int64_t{row} * width + h * hd + d] = acc[i] / st_l[r];
      } else {
        float* const part =
            workspace + ((int64_t{row} * kv.n_heads + h) * splits + split) * (hd + 2);
        part[2 + d] = any ? acc[i] : 0.f;
        if (d == 0) {  // a split past the row's keys merges as nothing
          part[0] = any ? st_m[r] : -INFINITY;
          part[1] = any ? st_l[r] : 0.f;
        }
      }
    }
    __syncthreads();  // the next run's q rows and state overwrite these
    r0 += nq;
  }
}

template <int kHd>
void LaunchMma(bool bidirectional, dim3 grid, size_t smem, cudaStream_t s, const float* q,
               const Rows& rows, int per_block, float scale, const Relative& rel, const KvPool& kv,
               float* out, float* workspace, int keys_per_split) {
  if (bidirectional) {
    RELGEN_LAUNCH((AttentionMmaKernel<true, kHd>), grid, kAmThreads, smem, s)
    (q, rows, per_block, scale, rel, kv, out, workspace, keys_per_split);
  } else {
    RELGEN_LAUNCH((AttentionMmaKernel<false, kHd>), grid, kAmThreads, smem, s)
    (q, rows, per_block, scale, rel, kv, out, workspace, keys_per_split);
  }
}

}  // namespace

bool AttentionMmaSupported(const KvPool& kv) {
  const int hd = kv.head_dim;
  return kv.type == KvElem::kBf16 && (hd == 16 || hd == 32 || hd == 64 || hd == 128);
}

size_t AttentionMmaSharedBytes(int head_dim) {
  return static_cast<size_t>(AmLayout(head_dim).bytes);
}

cudaError_t AttentionMma(const float* q, const Rows& rows, int max_keys, float scale,
                         const Relative& rel, const KvPool& kv, float* out, float* workspace,
                         int keys_per_split, cudaStream_t s, bool tiled, bool bidirectional) {
  if (!AttentionMmaSupported(kv)) return cudaErrorInvalidValue;
  if (bidirectional && rel.scheme != relpos::Scheme::kNone && rel.scheme != relpos::Scheme::kT5) {
    return cudaErrorInvalidValue;
  }
  if (bidirectional && rows.n > 0 && rows.keys == nullptr) return cudaErrorInvalidValue;
  if (rows.n == 0) return cudaSuccess;
  const int splits = (max_keys + keys_per_split - 1) / keys_per_split;
  if (splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const int per_block = tiled ? kAmRows : 1;
  const dim3 grid((rows.n + per_block - 1) / per_block, kv.n_heads, splits);
  const size_t smem = AttentionMmaSharedBytes(kv.head_dim);
  switch (kv.head_dim) {
    case 16:
      LaunchMma<16>(bidirectional, grid, smem, s, q, rows, per_block, scale, rel, kv, out,
                    workspace, keys_per_split);
      break;
    case 32:
      LaunchMma<32>(bidirectional, grid, smem, s, q, rows, per_block, scale, rel, kv, out,
                    workspace, keys_per_split);
      break;
    case 64:
      LaunchMma<64>(bidirectional, grid, smem, s, q, rows, per_block, scale, rel, kv, out,
                    workspace, keys_per_split);
      break;
    default:
      LaunchMma<128>(bidirectional, grid, smem, s, q, rows, per_block, scale, rel, kv, out,
                     workspace, keys_per_split);
      break;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  return AttentionCombine(workspace, rows.n, kv.n_heads, kv.head_dim, splits, out, s);
}

}  // namespace relgen::cuda
