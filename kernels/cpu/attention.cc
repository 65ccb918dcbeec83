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

float Dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct Scratch {
  std::vector<float> keys, values, scores, rel, weights;
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

// One head, queries at absolute positions qs..qe-1 (rows of `q` with stride ldq), keys ks..qe-1.
// Every query in the tile sees every key in [ks, its own position].
void AttendTile(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv, int head,
                const float* q, int ldq, int qs, int qe, int ks, float* out, int ldo) {
  const int hd = dims.head_dim;
  const int lq = qe - qs;
  const int lk = qe - ks;
  Scratch& s = ThreadScratch();
  float* keys = Sized(s.keys, static_cast<int64_t>(lk) * hd);
  float* values = Sized(s.values, static_cast<int64_t>(lk) * hd);
  for (int j = 0; j < lk; ++j) {
    std::memcpy(keys + static_cast<int64_t>(j) * hd, kv.KeyRow(head, ks + j), hd * sizeof(float));
    std::memcpy(values + static_cast<int64_t>(j) * hd, kv.ValueRow(head, ks + j),
                hd * sizeof(float));
  }
  float* scores = Sized(s.scores, static_cast<int64_t>(lq) * lk);
  GemmNT(lq, lk, hd, dims.scale, q, ldq, keys, hd, 0.0f, scores, lk);

  const float rel_mult = rel.scale_with_qk ? dims.scale : 1.0f;
  switch (rel.scheme) {
    case relpos::Scheme::kNone:
      break;
    case relpos::Scheme::kSkew:
    case relpos::Scheme::kSkewLocal: {
      const float* e = TableForHead(rel.table_k, rel.heads_share, head, int64_t{rel.rows} * hd);
      AddSkewedRelativeLogits(q, ldq, lq, lk, e, rel.rows, hd, rel_mult, scores,
                              Sized(s.rel, static_cast<int64_t>(lq) * (lk + 1)));
      break;
    }
    case relpos::Scheme::kShaw: {
      // Causal keys use rows 0..k (relative positions -k..0).
      const int k = rel.clip_k;
      float* qr = Sized(s.rel, static_cast<int64_t>(lq) * (k + 1));
      const float* r = TableForHead(rel.table_k, rel.heads_share, head, int64_t{rel.rows} * hd);
      GemmNT(lq, k + 1, hd, 1.0f, q, ldq, r, hd, 0.0f, qr, k + 1);
      for (int i = 0; i < lq; ++i) {
        float* row = scores + static_cast<int64_t>(i) * lk;
        for (int j = 0; j <= i + lk - lq; ++j) {
          row[j] += rel_mult * qr[static_cast<int64_t>(i) * (k + 1) +
                                  relpos::ShawRow(qs + i, ks + j, k)];
        }
      }
      break;
    }
    case relpos::Scheme::kT5: {
      const float* bias = rel.t5_bias + (rel.heads_share ? 0 : head * rel.t5_num_buckets);
      for (int i = 0; i < lq; ++i) {
        float* row = scores + static_cast<int64_t>(i) * lk;
        for (int j = 0; j <= i + lk - lq; ++j) {
          const int b = relpos::T5BucketOfDistance(rel.t5_bucket_of_distance, rel.t5_table_len,
                                                   qs + i - (ks + j));
          row[j] += rel_mult * bias[b];
        }
      }
      break;
    }
    case relpos::Scheme::kAlibi: {
      const float slope = rel.alibi_slopes[head];
      for (int i = 0; i < lq; ++i) {
        float* row = scores + static_cast<int64_t>(i) * lk;
        for (int j = 0; j <= i + lk - lq; ++j) {
          row[j] += rel_mult * relpos::AlibiBias(slope, qs + i - (ks + j));
        }
      }
      break;
    }
  }
  // Causal mask: the upper part (including the skew's garbage) never reaches the softmax.
  for (int i = 0; i < lq; ++i) {
    float* row = scores + static_cast<int64_t>(i) * lk;
    std::fill(row + i + lk - lq + 1, row + lk, kNegInf);
  }
  SoftmaxRows(scores, lq, lk, lk);
  GemmNN(lq, hd, lk, 1.0f, scores, lk, values, hd, 0.0f, out, ldo);

  if (rel.scheme == relpos::Scheme::kShaw && rel.table_v != nullptr) {
    // sum_j w_ij R^V[row(i,j)] = (w summed per row of R^V) * R^V: [lq, k+1] x [k+1, hd].
    const int k = rel.clip_k;
    float* w = Sized(s.weights, static_cast<int64_t>(lq) * (k + 1));
    std::fill(w, w + static_cast<int64_t>(lq) * (k + 1), 0.0f);
    for (int i = 0; i < lq; ++i) {
      const float* p = scores + static_cast<int64_t>(i) * lk;
      float* wi = w + static_cast<int64_t>(i) * (k + 1);
      for (int j = 0; j <= i + lk - lq; ++j) wi[relpos::ShawRow(qs + i, ks + j, k)] += p[j];
    }
    const float* rv = TableForHead(rel.table_v, rel.heads_share, head, int64_t{rel.rows} * hd);
    GemmNN(lq, hd, k + 1, 1.0f, w, k + 1, rv, hd, 1.0f, out, ldo);
  }
}

}  // namespace

void AddSkewedRelativeLogits(const float* q, int ldq, int lq, int lk, const float* e, int m, int hd,
                             float mult, float* scores, float* scratch) {
  // Column c of the padded buffer (after the pad column) is distance lk-1-c; only the last
  // min(m, lk) columns have a table row, the rest stay zero.
  float* qe = scratch;
  std::fill(qe, qe + static_cast<int64_t>(lq) * (lk + 1), 0.0f);
  const int c0 = std::max(0, lk - m);
  GemmNT(lq, lk - c0, hd, 1.0f, q, ldq, e + static_cast<int64_t>(m - lk + c0) * hd, hd, 0.0f,
         qe + 1 + c0, lk + 1);
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
                      const float* q, int start, int n, float* out) {
  const int width = dims.n_heads * dims.head_dim;
  const bool local = rel.scheme == relpos::Scheme::kSkewLocal;
  for (int qs = start; qs < start + n;) {
    // A tile never crosses a local block boundary, so all its queries share one window start.
    int qe = std::min(start + n, qs + kQueryTile);
    if (local) qe = std::min(qe, (qs / rel.block_length + 1) * rel.block_length);
    const int ks = relpos::WindowStart(rel.scheme, qs, rel.block_length);
    const int64_t row = static_cast<int64_t>(qs - start) * width;
    for (int h = 0; h < dims.n_heads; ++h) {
      AttendTile(dims, rel, kv, h, q + row + h * dims.head_dim, width, qs, qe, ks,
                 out + row + h * dims.head_dim, width);
    }
    qs = qe;
  }
}

void AttentionDecode(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                     const float* q, int pos, float* out) {
  const int hd = dims.head_dim;
  const int ks = relpos::WindowStart(rel.scheme, pos, rel.block_length);
  const int lk = pos - ks + 1;
  const float rel_mult = rel.scale_with_qk ? dims.scale : 1.0f;
  Scratch& s = ThreadScratch();
  float* scores = Sized(s.scores, lk);
  for (int h = 0; h < dims.n_heads; ++h) {
    const float* qh = q + h * hd;
    float* oh = out + h * hd;
    for (int j = 0; j < lk; ++j) scores[j] = dims.scale * Dot(qh, kv.KeyRow(h, ks + j), hd);
    switch (rel.scheme) {
      case relpos::Scheme::kNone:
        break;
      case relpos::Scheme::kSkew:
      case relpos::Scheme::kSkewLocal: {
        // The skew for one query is a slice of q.E^T: one product per needed distance, then gather.
        const int m = rel.rows;
        const int nd = std::min(m, lk);
        const float* e = TableForHead(rel.table_k, rel.heads_share, h, int64_t{m} * hd);
        float* qe = Sized(s.rel, nd);
        for (int d = 0; d < nd; ++d) {
          qe[d] = Dot(qh, e + static_cast<int64_t>(relpos::SkewRow(d, m)) * hd, hd);
        }
        for (int j = 0; j < lk; ++j) {
          const int d = pos - (ks + j);
          if (d < nd) scores[j] += rel_mult * qe[d];
        }
        break;
      }
      case relpos::Scheme::kShaw: {
        const int k = rel.clip_k;
        const float* r = TableForHead(rel.table_k, rel.heads_share, h, int64_t{rel.rows} * hd);
        float* qr = Sized(s.rel, k + 1);
        for (int row = 0; row <= k; ++row) qr[row] = Dot(qh, r + static_cast<int64_t>(row) * hd, hd);
        for (int j = 0; j < lk; ++j) scores[j] += rel_mult * qr[relpos::ShawRow(pos, ks + j, k)];
        break;
      }
      case relpos::Scheme::kT5: {
        const float* bias = rel.t5_bias + (rel.heads_share ? 0 : h * rel.t5_num_buckets);
        for (int j = 0; j < lk; ++j) {
          scores[j] += rel_mult * bias[relpos::T5BucketOfDistance(
                                      rel.t5_bucket_of_distance, rel.t5_table_len, pos - (ks + j))];
        }
        break;
      }
      case relpos::Scheme::kAlibi:
        for (int j = 0; j < lk; ++j) {
          scores[j] += rel_mult * relpos::AlibiBias(rel.alibi_slopes[h], pos - (ks + j));
        }
        break;
    }
    SoftmaxRows(scores, 1, lk, lk);
    std::fill(oh, oh + hd, 0.0f);
    for (int j = 0; j < lk; ++j) {
      const float p = scores[j];
      const float* v = kv.ValueRow(h, ks + j);
      for (int d = 0; d < hd; ++d) oh[d] += p * v[d];
    }
    if (rel.scheme == relpos::Scheme::kShaw && rel.table_v != nullptr) {
      const int k = rel.clip_k;
      float* w = Sized(s.weights, k + 1);
      std::fill(w, w + k + 1, 0.0f);
      for (int j = 0; j < lk; ++j) w[relpos::ShawRow(pos, ks + j, k)] += scores[j];
      const float* rv = TableForHead(rel.table_v, rel.heads_share, h, int64_t{rel.rows} * hd);
      for (int row = 0; row <= k; ++row) {
        const float* rr = rv + static_cast<int64_t>(row) * hd;
        for (int d = 0; d < hd; ++d) oh[d] += w[row] * rr[d];
      }
    }
  }
}

}  // namespace relgen::cpu
