// The attention kernels' bodies, compiled once per instruction set (attention_base.cc,
// attention_avx2.cc, attention_avx512.cc) into namespace relgen::cpu::RELGEN_ATTENTION_ISA; attention.cc picks one per
// process. Not a public header: include it only from those files, after defining the namespace.
#ifndef RELGEN_ATTENTION_ISA
#error "define RELGEN_ATTENTION_ISA before including attention_impl.h"
#endif

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/bf16.h"
#include "kernels/cpu/ops.h"
#include "kernels/relpos.h"

namespace relgen::cpu::RELGEN_ATTENTION_ISA {

// Declared first so the tiles below call this instruction set's copy, not the dispatching one.
void AddSkewedRelativeLogits(const float* q, int ldq, int lq, int lk, const float* e, int m, int hd,
                             float mult, float* scores, float* scratch);

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows per prefill tile: bounds the scratch to O(tile * keys) per call.
constexpr int kQueryTile = 128;
// Query rows from which a prefill tile widens bf16 K/V into float32 once for all its rows.
constexpr int kWidenTileRows = 4;

// Every query row is computed by the same arithmetic whether it arrives in a prefill tile, a
// chunk or a decode step, so a sequence's results do not depend on how it was chunked or what it
// was batched with (the dense layers rely on GEMM rows being independent of the row count).

// A cached element as float: bf16 widens exactly.
inline float Wide(float x) { return x; }
inline float Wide(uint16_t h) { return FromBf16(h); }

// The K or V rows of one head at positions pos, pos+1, ... (below `end`): one block-table lookup
// (and one division) per block instead of per row; a head's rows are contiguous inside a block.
// Each row handed out asks for one row of the following block (from its first, where the sequence
// goes on) into L2: a head's rows in a block are one short run (4 KiB for 16 rows of 64 floats) and
// the blocks lie anywhere in the pool, so the hardware prefetcher starts cold at every block. The
// decode attention of 32 sequences of ~150 tokens (bloom-560m's heads, 2 threads, AVX2) read its
// K/V at ~18 GB/s without this, ~26 with it; into L1 instead of L2 it gained nothing.
template <typename T>
class RowCursor {
 public:
  RowCursor(const KvView& kv, const void* pool, int head, int pos, int end)
      : kv_(kv), pool_(static_cast<const T*>(pool)), head_(head), pos_(pos), end_(end) {}
  const T* Next() {
    if (left_ == 0) {
      row_ = pool_ + kv_.RowOffset(head_, pos_);
      left_ = kv_.block_size - pos_ % kv_.block_size;
      const int next = pos_ + left_;  // first position of the following block
      ahead_ = next < end_ ? pool_ + kv_.RowOffset(head_, next) : nullptr;
    }
    const T* r = row_;
    if (ahead_ != nullptr) {
      const char* a = reinterpret_cast<const char*>(ahead_);
      const int bytes = kv_.head_dim * static_cast<int>(sizeof(T));
      for (int b = 0; b < bytes; b += 64) __builtin_prefetch(a + b, 0, 2);
      ahead_ += kv_.head_dim;
    }
    row_ += kv_.head_dim;
    --left_;
    ++pos_;
    return r;
  }

 private:
  const KvView& kv_;
  const T* pool_;
  int head_, pos_, end_;
  int left_ = 0;
  const T* row_ = nullptr;
  const T* ahead_ = nullptr;  // the following block's next row to ask for (null: none follows)
};

// out[d] = sum over j in order of w[j] * V[ks + j][d] (from zero): one chain per element.
template <typename T>
inline void WeightedSumAnySize(const float* w, int n, const KvView& kv, int head, int ks, int hd, float* out) {
  std::fill(out, out + hd, 0.0f);
  RowCursor<T> rows(kv, kv.v, head, ks, ks + n);
  for (int j = 0; j < n; ++j) {
    const float wj = w[j];
    const T* v = rows.Next();
    for (int d = 0; d < hd; ++d) out[d] += wj * Wide(v[d]);
  }
}

#if RELGEN_ATTENTION_VECTOR8 || RELGEN_ATTENTION_VECTOR16
#if RELGEN_ATTENTION_VECTOR8
// Eight floats as one value (ymm registers in the AVX2 file). Lane l of every accumulator below
// does exactly what the scalar loops of the baseline do for l.
constexpr int kLanes = 8;
typedef float V __attribute__((vector_size(32), aligned(4)));

__attribute__((always_inline)) inline V Load(const float* p) { return *reinterpret_cast<const V*>(p); }

// Eight bf16 values widened: zero-extend to 32 bits, shift into the high half.
__attribute__((always_inline)) inline V Load(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<V>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
}

// The lanes folded to four: (c0+c4, c1+c5, c2+c6, c3+c7).
__attribute__((always_inline)) inline __m128 Quarter(V c) {
  const __m256 m = reinterpret_cast<__m256>(c);
  return _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
}
#else
// Sixteen floats as one value (zmm registers in the AVX-512 file): the same loops at twice the
// width, with their own fixed reduction order.
constexpr int kLanes = 16;
typedef float V __attribute__((vector_size(64), aligned(4)));

__attribute__((always_inline)) inline V Load(const float* p) { return *reinterpret_cast<const V*>(p); }

__attribute__((always_inline)) inline V Load(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<V>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}

// Lanes l and l + 8 first, then as the 8-lane fold.
__attribute__((always_inline)) inline __m128 Quarter(V c) {
  const __m512 m = reinterpret_cast<__m512>(c);
  const __m256 h =
      _mm256_add_ps(_mm512_castps512_ps256(m), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// The fixed reduction order: the four folded lanes as (q0 + q1) + (q2 + q3).
__attribute__((always_inline)) inline float Reduce(V c) {
  float q[4];
  _mm_storeu_ps(q, Quarter(c));
  return (q[0] + q[1]) + (q[2] + q[3]);
}

// Dot product accumulated in kLanes lanes, reduced in the fixed order.
template <typename T>
__attribute__((always_inline)) inline float Dot(const float* a, const T* b, int n) {
  V acc = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += Load(a + i) * Load(b + i);
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * Wide(b[i]);
  return Reduce(acc);
}

// Dot(a, b[x], n) for four vectors at once: each result is Dot's arithmetic exactly, but the four
// independent chains keep the multiply-add units busy where one chain waits on its own latency.
template <typename T>
__attribute__((always_inline)) inline void Dot4(const float* a, const T* const b[4], int n, float* out) {
  V acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V x = Load(a + i);
    acc0 += x * Load(b[0] + i);
    acc1 += x * Load(b[1] + i);
    acc2 += x * Load(b[2] + i);
    acc3 += x * Load(b[3] + i);
  }
  for (int l = 0; i < n; ++i, ++l) {
    acc0[l] += a[i] * Wide(b[0][i]);
    acc1[l] += a[i] * Wide(b[1][i]);
    acc2[l] += a[i] * Wide(b[2][i]);
    acc3[l] += a[i] * Wide(b[3][i]);
  }
  // Reduce of each, four at a time: two rounds of pairwise adds over the folded lanes give
  // (q0 + q1) + (q2 + q3), the same additions in the same order.
  const __m128 h01 = _mm_hadd_ps(Quarter(acc0), Quarter(acc1));
  const __m128 h23 = _mm_hadd_ps(Quarter(acc2), Quarter(acc3));
  _mm_storeu_ps(out, _mm_hadd_ps(h01, h23));
}

// WeightedSumAnySize with the accumulators in registers, for the common head sizes.
template <int HD, typename T>
__attribute__((always_inline)) inline void WeightedSumFixed(const float* w, int n, const KvView& kv,
                                                            int head, int ks, float* out) {
  V acc[HD / kLanes] = {};
  RowCursor<T> rows(kv, kv.v, head, ks, ks + n);
  for (int j = 0; j < n; ++j) {
    const T* v = rows.Next();
    const V wj = V{} + w[j];
    for (int c = 0; c < HD / kLanes; ++c) acc[c] += wj * Load(v + kLanes * c);
  }
  for (int c = 0; c < HD / kLanes; ++c) {
    for (int l = 0; l < kLanes; ++l) out[kLanes * c + l] = acc[c][l];
  }
}

template <typename T>
inline void WeightedSum(const float* w, int n, const KvView& kv, int head, int ks, int hd,
                        float* out) {
  // The 8-lane path keeps head size 128 on the any-size loop (16 ymm sums would leave no register
  // for the loads).
  if (kLanes == 16 && hd == 128) return WeightedSumFixed<128, T>(w, n, kv, head, ks, out);
  if (hd == 64) return WeightedSumFixed<64, T>(w, n, kv, head, ks, out);
  if (hd == 32) return WeightedSumFixed<32, T>(w, n, kv, head, ks, out);
  WeightedSumAnySize<T>(w, n, kv, head, ks, hd, out);
}

#else
// Dot product accumulated in 8 lanes, reduced in a fixed order (the compiler vectorizes the lanes).
template <typename T>
inline float Dot(const float* a, const T* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * Wide(b[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * Wide(b[i]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

template <typename T>
inline void Dot4(const float* a, const T* const b[4], int n, float* out) {
  for (int x = 0; x < 4; ++x) out[x] = Dot(a, b[x], n);
}

template <typename T>
inline void WeightedSum(const float* w, int n, const KvView& kv, int head, int ks, int hd,
                        float* out) {
  WeightedSumAnySize<T>(w, n, kv, head, ks, hd, out);
}
#endif

// p[j] = scale * q.K[ks + j] for j < n.
template <typename T>
inline void ScoresOf(const float* q, const KvView& kv, int head, int ks, int n, float scale, int hd,
                     float* p) {
  RowCursor<T> rows(kv, kv.k, head, ks, ks + n);
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* keys[4];
    for (const T*& k : keys) k = rows.Next();
    float d4[4];
    Dot4(q, keys, hd, d4);
    for (int x = 0; x < 4; ++x) p[j + x] = scale * d4[x];
  }
  for (; j < n; ++j) p[j] = scale * Dot(q, rows.Next(), hd);
}

// The two reads of the cache, for its element type.
inline void Scores(const float* q, const KvView& kv, int head, int ks, int n, float scale, int hd,
                   float* p) {
  if (kv.type == KvType::kBf16) return ScoresOf<uint16_t>(q, kv, head, ks, n, scale, hd, p);
  ScoresOf<float>(q, kv, head, ks, n, scale, hd, p);
}

inline void Values(const float* w, int n, const KvView& kv, int head, int ks, int hd, float* out) {
  if (kv.type == KvType::kBf16) return WeightedSum<uint16_t>(w, n, kv, head, ks, hd, out);
  WeightedSum<float>(w, n, kv, head, ks, hd, out);
}

struct Scratch {
  std::vector<float> rel, row, weights, k_wide, v_wide;
};

Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

float* Sized(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

const float* TableForHead(const float* table, bool share, int head, int64_t per_head) {
  return table + (share ? 0 : head * per_head);
}

// One query row of one head: query at position `pos` attends to keys ks..pos. `rel_by_key[j]` is
// the relative term for key ks+j (null: none); `shaw_products` [k+1] are q.R^K rows for Shaw.
// The head's K/V are head `kv_head` of `kv` (-1: `head`).
void AttendRow(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv, int head,
               const float* q, int pos, int ks, const float* rel_by_key, const float* shaw_products,
               float* out, int kv_head = -1) {
  if (kv_head < 0) kv_head = head;
  const int hd = dims.head_dim;
  const int lk = pos - ks + 1;
  const float rel_mult = rel.scale_with_qk ? dims.scale : 1.0f;
  Scratch& s = ThreadScratch();
  float* p = Sized(s.row, lk);
  Scores(q, kv, kv_head, ks, lk, dims.scale, hd, p);
  switch (rel.scheme) {
    case relpos::Scheme::kNone:
      break;
    case relpos::Scheme::kSkew:
    case relpos::Scheme::kSkewLocal:
      for (int j = 0; j < lk; ++j) p[j] += rel_mult * rel_by_key[j];
      break;
    case relpos::Scheme::kShaw:
      for (int j = 0; j < lk; ++j)
        p[j] += rel_mult * shaw_products[relpos::ShawRow(pos, ks + j, rel.clip_k)];
      break;
    case relpos::Scheme::kT5: {
      const float* bias = rel.t5_bias + (rel.heads_share ? 0 : head * rel.t5_num_buckets);
      for (int j = 0; j < lk; ++j) {
        p[j] += rel_mult * bias[relpos::T5BucketOfDistance(rel.t5_bucket_of_distance,
                                                           rel.t5_table_len, pos - (ks + j))];
      }
      break;
    }
    case relpos::Scheme::kAlibi:
      for (int j = 0; j < lk; ++j)
        p[j] += rel_mult * relpos::AlibiBias(rel.alibi_slopes[head], pos - (ks + j));
      break;
  }
  SoftmaxRows(p, 1, lk, lk);
  Values(p, lk, kv, kv_head, ks, hd, out);
  if (rel.scheme == relpos::Scheme::kShaw && rel.table_v != nullptr) {
    // sum_j w_j R^V[row(j)] = sum over rows of (weights summed per row) * R^V[row].
    const int k = rel.clip_k;
    float* w = Sized(s.weights, k + 1);
    std::fill(w, w + k + 1, 0.0f);
    for (int j = 0; j < lk; ++j) w[relpos::ShawRow(pos, ks + j, k)] += p[j];
    const float* rv = TableForHead(rel.table_v, rel.heads_share, head, int64_t{rel.rows} * hd);
    for (int r = 0; r <= k; ++r) {
      const float* rr = rv + static_cast<int64_t>(r) * hd;
      for (int d = 0; d < hd; ++d) out[d] += w[r] * rr[d];
    }
  }
}

// q.R^K for the causal Shaw rows 0..k (relative positions -k..0).
void ShawProducts(const RelativeParams& rel, int head, int hd, const float* q, float* out) {
  const float* r = TableForHead(rel.table_k, rel.heads_share, head, int64_t{rel.rows} * hd);
  for (int row = 0; row <= rel.clip_k; ++row)
    out[row] = Dot(q, r + static_cast<int64_t>(row) * hd, hd);
}

// One head, queries at absolute positions qs..qe-1 (rows of `q` with stride ldq), keys ks..qe-1.
void AttendTile(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv, int head,
                const float* q, int ldq, int qs, int qe, int ks, float* out, int ldo) {
  const int hd = dims.head_dim;
  const int lq = qe - qs;
  const int lk = qe - ks;
  const bool skew = rel.scheme == relpos::Scheme::kSkew || rel.scheme == relpos::Scheme::kSkewLocal;
  Scratch& s = ThreadScratch();
  float* buf = nullptr;
  if (skew) {
    // Relative logits of the whole tile from one Q E^T product and the skew view; row i of the
    // view is then the relative term of each key, in key order.
    buf = Sized(s.rel, static_cast<int64_t>(lq) * (lk + 1));
    std::fill(buf, buf + static_cast<int64_t>(lq) * (lk + 1), 0.0f);
    const float* e = TableForHead(rel.table_k, rel.heads_share, head, int64_t{rel.rows} * hd);
    AddSkewedRelativeLogits(q, ldq, lq, lk, e, rel.rows, hd, 1.0f, nullptr, buf);
  } else if (rel.scheme == relpos::Scheme::kShaw) {
    buf = Sized(s.rel, static_cast<int64_t>(lq) * (rel.clip_k + 1));
    for (int i = 0; i < lq; ++i) {
      ShawProducts(rel, head, hd, q + static_cast<int64_t>(i) * ldq,
                   buf + static_cast<int64_t>(i) * (rel.clip_k + 1));
    }
  }
  // bf16 K/V are widened once per tile rather than once per query row. Widening is exact, so each
  // row gets the bits it gets reading the cache directly (as a decode step does).
  KvView tile_kv = kv;
  int kv_head = head;
  static const int32_t kOneBlock[1] = {0};
  if (kv.type == KvType::kBf16 && lq >= kWidenTileRows) {
    float* kw = Sized(s.k_wide, static_cast<int64_t>(qe) * hd);
    float* vw = Sized(s.v_wide, static_cast<int64_t>(qe) * hd);
    RowCursor<uint16_t> kr(kv, kv.k, head, ks, qe), vr(kv, kv.v, head, ks, qe);
    for (int j = ks; j < qe; ++j) {
      const uint16_t* kj = kr.Next();
      const uint16_t* vj = vr.Next();
      for (int d = 0; d < hd; ++d) {
        kw[static_cast<int64_t>(j) * hd + d] = Wide(kj[d]);
        vw[static_cast<int64_t>(j) * hd + d] = Wide(vj[d]);
      }
    }
    tile_kv = KvView{kw, vw, kOneBlock, qe, 1, hd, KvType::kF32};  // positions 0..qe-1 of one head
    kv_head = 0;
  }
  for (int i = 0; i < lq; ++i) {
    const float* rel_by_key = skew ? buf + lq + static_cast<int64_t>(i) * lk : nullptr;
    const float* shaw = rel.scheme == relpos::Scheme::kShaw
                            ? buf + static_cast<int64_t>(i) * (rel.clip_k + 1)
                            : nullptr;
    AttendRow(dims, rel, tile_kv, head, q + static_cast<int64_t>(i) * ldq, qs + i, ks, rel_by_key, shaw,
              out + static_cast<int64_t>(i) * ldo, kv_head);
  }
}

}  // namespace

void AddSkewedRelativeLogits(const float* q, int ldq, int lq, int lk, const float* e, int m, int hd,
                             float mult, float* scores, float* scratch) {
  // Column c of the padded buffer (after the pad column) is distance lk-1-c; only the last
  // min(m, lk) columns have a table row (E row m-lk+c), the rest stay zero.
  float* qe = scratch;
  std::fill(qe, qe + static_cast<int64_t>(lq) * (lk + 1), 0.0f);
  const int c0 = std::max(0, lk - m);
  for (int i = 0; i < lq; ++i) {
    const float* qi = q + static_cast<int64_t>(i) * ldq;
    float* row = qe + static_cast<int64_t>(i) * (lk + 1) + 1;
    for (int c = c0; c < lk; ++c) row[c] = Dot(qi, e + static_cast<int64_t>(m - lk + c) * hd, hd);
  }
  if (scores == nullptr) return;  // the caller reads the skew view of `scratch` itself
  for (int i = 0; i < lq; ++i) {
    float* row = scores + static_cast<int64_t>(i) * lk;
    const float* skewed = qe + lq + static_cast<int64_t>(i) * lk;
    const int jmax = i + lk - lq;
    for (int j = 0; j <= jmax; ++j) row[j] += mult * skewed[j];
  }
}

void AttentionPrefill(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                      const float* q, int start, int n, float* out, int head_begin, int head_end) {
  if (head_end < 0) head_end = dims.n_heads;
  const int width = dims.n_heads * dims.head_dim;
  const bool local = rel.scheme == relpos::Scheme::kSkewLocal;
  for (int qs = start; qs < start + n;) {
    // A tile never crosses a local block boundary, so all its queries share one window start.
    int qe = std::min(start + n, qs + kQueryTile);
    if (local) qe = std::min(qe, (qs / rel.block_length + 1) * rel.block_length);
    const int ks = relpos::WindowStart(rel.scheme, qs, rel.block_length);
    const int64_t row = static_cast<int64_t>(qs - start) * width;
    for (int h = head_begin; h < head_end; ++h) {
      AttendTile(dims, rel, kv, h, q + row + h * dims.head_dim, width, qs, qe, ks,
                 out + row + h * dims.head_dim, width);
    }
    qs = qe;
  }
}

void AttentionDecode(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                     const float* q, int pos, float* out, int head_begin, int head_end) {
  if (head_end < 0) head_end = dims.n_heads;
  const int hd = dims.head_dim;
  const int ks = relpos::WindowStart(rel.scheme, pos, rel.block_length);
  const int lk = pos - ks + 1;
  Scratch& s = ThreadScratch();
  for (int h = head_begin; h < head_end; ++h) {
    const float* qh = q + h * hd;
    const float* rel_by_key = nullptr;
    const float* shaw = nullptr;
    if (rel.scheme == relpos::Scheme::kSkew || rel.scheme == relpos::Scheme::kSkewLocal) {
      // The skew for one query is a slice of q.E^T: one product per needed distance (M at most,
      // not the context length), then a gather into key order.
      const int m = rel.rows;
      const int nd = std::min(m, lk);
      const float* e = TableForHead(rel.table_k, rel.heads_share, h, int64_t{m} * hd);
      float* buf = Sized(s.rel, nd + lk);
      for (int d = 0; d < nd; ++d)
        buf[d] = Dot(qh, e + static_cast<int64_t>(relpos::SkewRow(d, m)) * hd, hd);
      float* by_key = buf + nd;
      for (int j = 0; j < lk; ++j) {
        const int d = pos - (ks + j);
        by_key[j] = d < nd ? buf[d] : 0.0f;
      }
      rel_by_key = by_key;
    } else if (rel.scheme == relpos::Scheme::kShaw) {
      float* buf = Sized(s.rel, rel.clip_k + 1);
      ShawProducts(rel, h, hd, qh, buf);
      shaw = buf;
    }
    AttendRow(dims, rel, kv, h, qh, pos, ks, rel_by_key, shaw, out + h * hd);
  }
}

void AttentionBidirectional(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                            const float* q, int n, float* out, int head_begin, int head_end) {
  if (head_end < 0) head_end = dims.n_heads;
  const int hd = dims.head_dim, width = dims.n_heads * hd;
  const float rel_mult = rel.scale_with_qk ? dims.scale : 1.0f;
  const int half = rel.t5_table_len / 2;
  float* p = Sized(ThreadScratch().row, n);
  for (int i = 0; i < n; ++i) {
    for (int h = head_begin; h < head_end; ++h) {
      const float* qh = q + int64_t{i} * width + h * hd;
      Scores(qh, kv, h, 0, n, dims.scale, hd, p);
      if (rel.scheme == relpos::Scheme::kT5) {
        const float* bias = rel.t5_bias + (rel.heads_share ? 0 : h * rel.t5_num_buckets);
        for (int j = 0; j < n; ++j) {
          p[j] += rel_mult * bias[rel.t5_bucket_of_distance[std::clamp(j - i, -half, half) + half]];
        }
      }
      SoftmaxRows(p, 1, n, n);
      float* o = out + int64_t{i} * width + h * hd;
      Values(p, n, kv, h, 0, hd, o);
    }
  }
}

}  // namespace relgen::cpu::RELGEN_ATTENTION_ISA
