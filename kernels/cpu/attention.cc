#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"

namespace relgen::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows per prefill tile: bounds the scratch to O(tile * keys) per call.
constexpr int kQueryTile = 128;

// Every query row is computed by the same arithmetic whether it arrives in a prefill tile, a
// chunk or a decode step, so a sequence's results do not depend on how it was chunked or what it
// was batched with (the dense layers rely on GEMM rows being independent of the row count).

// Dot product accumulated in 8 lanes, reduced in a fixed order.
inline float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

struct Scratch {
  std::vector<float> rel, row, weights;
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
void AttendRow(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv, int head,
               const float* q, int pos, int ks, const float* rel_by_key, const float* shaw_products,
               float* out) {
  const int hd = dims.head_dim;
  const int lk = pos - ks + 1;
  const float rel_mult = rel.scale_with_qk ? dims.scale : 1.0f;
  Scratch& s = ThreadScratch();
  float* p = Sized(s.row, lk);
  for (int j = 0; j < lk; ++j) p[j] = dims.scale * Dot(q, kv.KeyRow(head, ks + j), hd);
  switch (rel.scheme) {
    case relpos::Scheme::kNone:
      break;
    case relpos::Scheme::kSkew:
    case relpos::Scheme::kSkewLocal:
      for (int j = 0; j < lk; ++j) p[j] += rel_mult * rel_by_key[j];
      break;
    case relpos::Scheme::kShaw:
      for (int j = 0; j < lk; ++j) p[j] += rel_mult * shaw_products[relpos::ShawRow(pos, ks + j, rel.clip_k)];
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
      for (int j = 0; j < lk; ++j) p[j] += rel_mult * relpos::AlibiBias(rel.alibi_slopes[head], pos - (ks + j));
      break;
  }
  SoftmaxRows(p, 1, lk, lk);
  std::fill(out, out + hd, 0.0f);
  for (int j = 0; j < lk; ++j) {
    const float w = p[j];
    const float* v = kv.ValueRow(head, ks + j);
    for (int d = 0; d < hd; ++d) out[d] += w * v[d];
  }
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
  for (int row = 0; row <= rel.clip_k; ++row) out[row] = Dot(q, r + static_cast<int64_t>(row) * hd, hd);
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
      ShawProducts(rel, head, hd, q + static_cast<int64_t>(i) * ldq, buf + static_cast<int64_t>(i) * (rel.clip_k + 1));
    }
  }
  for (int i = 0; i < lq; ++i) {
    const float* rel_by_key = skew ? buf + lq + static_cast<int64_t>(i) * lk : nullptr;
    const float* shaw = rel.scheme == relpos::Scheme::kShaw ? buf + static_cast<int64_t>(i) * (rel.clip_k + 1) : nullptr;
    AttendRow(dims, rel, kv, head, q + static_cast<int64_t>(i) * ldq, qs + i, ks, rel_by_key, shaw,
              out + static_cast<int64_t>(i) * ldo);
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

void WriteKv(const KvView& kv, const float* k, const float* v, int start, int n) {
  const int hd = kv.head_dim;
  const int width = kv.n_heads * hd;
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < kv.n_heads; ++h) {
      const int64_t src = static_cast<int64_t>(t) * width + h * hd;
      std::memcpy(kv.KeyRow(h, start + t), k + src, hd * sizeof(float));
      std::memcpy(kv.ValueRow(h, start + t), v + src, hd * sizeof(float));
    }
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
      for (int d = 0; d < nd; ++d) buf[d] = Dot(qh, e + static_cast<int64_t>(relpos::SkewRow(d, m)) * hd, hd);
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
      for (int j = 0; j < n; ++j) p[j] = dims.scale * Dot(qh, kv.KeyRow(h, j), hd);
      if (rel.scheme == relpos::Scheme::kT5) {
        const float* bias = rel.t5_bias + (rel.heads_share ? 0 : h * rel.t5_num_buckets);
        for (int j = 0; j < n; ++j) {
          p[j] += rel_mult * bias[rel.t5_bucket_of_distance[std::clamp(j - i, -half, half) + half]];
        }
      }
      SoftmaxRows(p, 1, n, n);
      float* o = out + int64_t{i} * width + h * hd;
      std::fill(o, o + hd, 0.0f);
      for (int j = 0; j < n; ++j) {
        const float w = p[j];
        const float* v = kv.ValueRow(h, j);
        for (int d = 0; d < hd; ++d) o[d] += w * v[d];
      }
    }
  }
}

}  // namespace relgen::cpu
