// CPU attention kernels on random data against a direct O(L^2) evaluation of each scheme's
// definition (written here from the seeds, not from the kernels): decode at every position and
// prefill in several chunkings, with K/V in a paged view whose blocks are scattered.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/relpos_host.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

struct KernelCase {
  relpos::Scheme scheme;
  int rows_or_k;  // skew M / shaw k
  int block_length;
  bool values;
  bool share;
  bool scale_rel;
  int hd = 8;  // 32 and 64 take the kernels' fixed-size paths
};

class AttentionKernelTest : public ::testing::TestWithParam<KernelCase> {};

TEST_P(AttentionKernelTest, DecodeAndChunkedPrefillMatchDefinition) {
  const KernelCase p = GetParam();
  const int H = 3, hd = p.hd, L = 45, W = H * hd, bs = 4;
  const int nblocks = (L + bs - 1) / bs;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const std::vector<float> q = randv(L * W), k = randv(L * W), v = randv(L * W);
  const int hs = p.share ? 1 : H;
  const int rows = p.scheme == relpos::Scheme::kShaw ? 2 * p.rows_or_k + 1 : p.rows_or_k;
  const std::vector<float> tk = randv(hs * std::max(rows, 1) * hd);
  const std::vector<float> tv = randv(hs * std::max(rows, 1) * hd);
  const int nb = 16, md = 40;
  const std::vector<float> t5 = randv(hs * nb);
  const std::vector<int32_t> t5_table = relpos::T5BucketTable(nb, md, false);
  const std::vector<float> slopes = relpos::AlibiSlopes(H);

  cpu::RelativeParams rel;
  rel.scheme = p.scheme;
  rel.heads_share = p.share;
  rel.table_k = tk.data();
  rel.table_v = p.values ? tv.data() : nullptr;
  rel.rows = rows;
  rel.clip_k = p.rows_or_k;
  rel.block_length = p.block_length;
  rel.t5_bias = t5.data();
  rel.t5_num_buckets = nb;
  rel.t5_bucket_of_distance = t5_table.data();
  rel.t5_table_len = static_cast<int>(t5_table.size());
  rel.alibi_slopes = slopes.data();
  rel.scale_with_qk = p.scale_rel;
  cpu::AttentionDims dims{H, hd, 0.37f};

  // Direct evaluation, from the keys and values as the cache holds them.
  std::vector<float> want;
  auto evaluate = [&](const std::vector<double>& k, const std::vector<double>& v) {
    want.assign(L * W, 0.0f);
    for (int h = 0; h < H; ++h) {
      const int th = p.share ? 0 : h;
      for (int i = 0; i < L; ++i) {
        int start = 0;
        if (p.scheme == relpos::Scheme::kSkewLocal) start = std::max(i / p.block_length - 1, 0) * p.block_length;
        std::vector<double> logit(L, -INFINITY);
        for (int j = start; j <= i; ++j) {
          double qk = 0, r = 0;
          for (int x = 0; x < hd; ++x) qk += double(q[i * W + h * hd + x]) * k[j * W + h * hd + x];
          const int dist = i - j;
          switch (p.scheme) {
            case relpos::Scheme::kSkew:
            case relpos::Scheme::kSkewLocal:
              if (dist < rows) {
                for (int x = 0; x < hd; ++x) r += double(q[i * W + h * hd + x]) * tk[(th * rows + rows - 1 - dist) * hd + x];
              }
              break;
            case relpos::Scheme::kShaw: {
              const int row = std::clamp(j - i, -p.rows_or_k, p.rows_or_k) + p.rows_or_k;
              for (int x = 0; x < hd; ++x) r += double(q[i * W + h * hd + x]) * tk[(th * rows + row) * hd + x];
              break;
            }
            case relpos::Scheme::kT5:
              r = t5[th * nb + relpos::T5Bucket(j - i, nb, md, false)];
              break;
            case relpos::Scheme::kAlibi:
              r = -double(slopes[h]) * dist;
              break;
            default:
              break;
          }
          logit[j] = p.scale_rel ? (qk + r) * dims.scale : qk * dims.scale + r;
        }
        const double mx = *std::max_element(logit.begin(), logit.end());
        double sum = 0;
        for (double& l : logit) sum += (l = std::exp(l - mx));
        for (int j = start; j <= i; ++j) {
          const double w = logit[j] / sum;
          for (int x = 0; x < hd; ++x) {
            double add = v[j * W + h * hd + x];
            if (p.values) {
              const int row = std::clamp(j - i, -p.rows_or_k, p.rows_or_k) + p.rows_or_k;
              add += tv[(th * rows + row) * hd + x];
            }
            want[i * W + h * hd + x] += static_cast<float>(w * add);
          }
        }
      }
    }
  };

  // Paged cache with a scattered block table; unused pool blocks hold poison (NaN in both types).
  std::vector<int32_t> table(nblocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  for (int32_t& b : table) b = 2 * b + 1;
  std::vector<float> kpool(2 * nblocks * H * bs * hd, NAN), vpool(kpool.size(), NAN);
  std::vector<uint16_t> kpool16(kpool.size(), 0x7fc0), vpool16(kpool.size(), 0x7fc0);
  std::vector<float> f32_decoded;
  for (cpu::KvType type : {cpu::KvType::kF32, cpu::KvType::kBf16}) {
    SCOPED_TRACE(cpu::KvTypeName(type));
    const bool bf16 = type == cpu::KvType::kBf16;
    cpu::KvView kv{bf16 ? static_cast<void*>(kpool16.data()) : kpool.data(),
                   bf16 ? static_cast<void*>(vpool16.data()) : vpool.data(), table.data(), bs, H, hd, type};
    cpu::WriteKv(kv, k.data(), v.data(), 0, L);
    std::vector<double> kd(k.size()), vd(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      kd[i] = bf16 ? testing::Bf16Value(k[i]) : k[i];
      vd[i] = bf16 ? testing::Bf16Value(v[i]) : v[i];
    }
    evaluate(kd, vd);

    auto expect_rows = [&](const std::vector<float>& got, int from, int to, const char* what) {
      for (int i = from; i < to; ++i) {
        for (int x = 0; x < W; ++x) {
          ASSERT_NEAR(got[i * W + x], want[i * W + x], 2e-4) << what << " row " << i << " col " << x;
        }
      }
    };
    // Every code path this CPU runs (the best is what the engine uses).
    for (cpu::AttentionIsa isa : cpu::SupportedAttentionIsas()) {
      SCOPED_TRACE(cpu::AttentionIsaName(isa));
      const cpu::AttentionKernels& kern = cpu::AttentionKernelsFor(isa);
      std::vector<float> decoded(L * W, NAN);
      for (int i = 0; i < L; ++i) kern.decode(dims, rel, kv, q.data() + i * W, i, decoded.data() + i * W, 0, H);
      expect_rows(decoded, 0, L, "decode");
      std::vector<float> out(L * W, NAN);
      for (const std::vector<int>& chunks : {std::vector<int>{L}, std::vector<int>{3, 5, 1, 7, 2, 11, 16},
                                             std::vector<int>{1, 20, 24}}) {
        std::fill(out.begin(), out.end(), NAN);
        int pos = 0;
        for (int c : chunks) {
          kern.prefill(dims, rel, kv, q.data() + pos * W, pos, c, out.data() + pos * W, 0, H);
          pos += c;
        }
        ASSERT_EQ(pos, L);
        expect_rows(out, 0, L, "prefill");
        // Bitwise: a row does not depend on how the sequence was chunked.
        for (int i = 0; i < L * W; ++i) ASSERT_EQ(out[i], decoded[i]) << "element " << i;
      }
      // The cache's precision is in effect: bf16 K/V move the outputs off the f32 cache's.
      if (isa == cpu::SupportedAttentionIsas().front()) {
        if (!bf16) f32_decoded = decoded;
        else EXPECT_NE(decoded, f32_decoded);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, AttentionKernelTest,
    ::testing::Values(KernelCase{relpos::Scheme::kNone, 0, 0, false, false, true},
                      KernelCase{relpos::Scheme::kSkew, 10, 0, false, false, true},
                      KernelCase{relpos::Scheme::kSkew, 100, 0, false, true, false},
                      KernelCase{relpos::Scheme::kSkewLocal, 12, 8, false, false, true},
                      KernelCase{relpos::Scheme::kSkewLocal, 5, 7, false, true, true},
                      KernelCase{relpos::Scheme::kShaw, 3, 0, false, false, true},
                      KernelCase{relpos::Scheme::kShaw, 60, 0, true, false, true},
                      KernelCase{relpos::Scheme::kShaw, 4, 0, true, true, false},
                      KernelCase{relpos::Scheme::kT5, 0, 0, false, false, false},
                      KernelCase{relpos::Scheme::kAlibi, 0, 0, false, false, false},
                      KernelCase{relpos::Scheme::kSkew, 30, 0, false, false, true, 64},
                      KernelCase{relpos::Scheme::kShaw, 5, 0, true, false, true, 32},
                      KernelCase{relpos::Scheme::kT5, 0, 0, false, false, false, 64}));

// T5's bidirectional bucket of relative position r = key - query, written from the definition
// (logarithmic buckets past max_exact, one half of the buckets per direction) in double.
int T5BidirectionalBucket(int r, int num_buckets, int max_distance) {
  const int half = num_buckets / 2, max_exact = half / 2;
  const int offset = r > 0 ? half : 0;
  const int n = std::abs(r);
  if (n < max_exact) return offset + n;
  const int b = max_exact + static_cast<int>(std::log(static_cast<double>(n) / max_exact) /
                                             std::log(static_cast<double>(max_distance) / max_exact) *
                                             (half - max_exact));
  return offset + std::min(b, half - 1);
}

// An encoder's self-attention: every query sees every key, with T5's bidirectional bias (distances
// past max_distance included) or none, K/V in scattered blocks.
TEST(AttentionBidirectionalTest, MatchesDefinition) {
  const int H = 3, hd = 8, L = 45, W = H * hd, bs = 4, nb = 16, md = 20;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const std::vector<float> q = randv(L * W), k = randv(L * W), v = randv(L * W), bias = randv(H * nb);
  const std::vector<int32_t> table = relpos::T5SignedBucketTable(nb, md);
  const int nblocks = (L + bs - 1) / bs;
  std::vector<int32_t> block_table(nblocks);
  std::iota(block_table.begin(), block_table.end(), 0);
  std::shuffle(block_table.begin(), block_table.end(), rng);
  std::vector<float> kpool(nblocks * H * bs * hd, NAN), vpool(kpool.size(), NAN);
  cpu::KvView kv{kpool.data(), vpool.data(), block_table.data(), bs, H, hd};
  cpu::WriteKv(kv, k.data(), v.data(), 0, L);
  for (bool with_bias : {false, true}) {
    cpu::RelativeParams rel;
    rel.scheme = with_bias ? relpos::Scheme::kT5 : relpos::Scheme::kNone;
    rel.t5_bias = bias.data();
    rel.t5_num_buckets = nb;
    rel.t5_bucket_of_distance = table.data();
    rel.t5_table_len = static_cast<int>(table.size());
    rel.scale_with_qk = false;
    const cpu::AttentionDims dims{H, hd, 0.7f};
    for (cpu::AttentionIsa isa : cpu::SupportedAttentionIsas()) {
      std::vector<float> out(L * W, NAN);
      cpu::AttentionKernelsFor(isa).bidirectional(dims, rel, kv, q.data(), L, out.data(), 0, H);
      for (int i = 0; i < L; ++i) {
        for (int h = 0; h < H; ++h) {
          std::vector<double> logit(L);
          for (int j = 0; j < L; ++j) {
            double dot = 0;
            for (int d = 0; d < hd; ++d) dot += double{q[i * W + h * hd + d]} * k[j * W + h * hd + d];
            logit[j] = 0.7 * dot + (with_bias ? bias[h * nb + T5BidirectionalBucket(j - i, nb, md)] : 0.0);
          }
          const double mx = *std::max_element(logit.begin(), logit.end());
          double sum = 0;
          for (double& x : logit) sum += (x = std::exp(x - mx));
          for (int d = 0; d < hd; ++d) {
            double want = 0;
            for (int j = 0; j < L; ++j) want += logit[j] / sum * v[j * W + h * hd + d];
            ASSERT_NEAR(out[i * W + h * hd + d], want, 1e-5 * (1 + std::abs(want)))
                << cpu::AttentionIsaName(isa) << (with_bias ? " t5" : " none") << " query " << i << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace relgen
