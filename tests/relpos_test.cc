// Relative-position facts checked against the seed notes' worked examples and hand-derived values.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/relpos.h"
#include "kernels/relpos_host.h"

namespace relgen {
namespace {

// Runs the production skew step for D=1, Q = ones, and table values = -distance (the seed's E).
std::vector<float> SkewOnes(int lq, int lk, int m) {
  std::vector<float> q(lq, 1.0f), e(m), scores(lq * lk, 0.0f), scratch(lq * (lk + 1));
  for (int r = 0; r < m; ++r) e[r] = -static_cast<float>(m - 1 - r);
  cpu::AddSkewedRelativeLogits(q.data(), 1, lq, lk, e.data(), m, 1, 1.0f, scores.data(),
                               scratch.data());
  return scores;
}

// Seed 000, global: S_rel after the skew, lower triangle (the upper one is masked).
TEST(SkewTest, SeedGlobalFiveByFive) {
  const float seed[5][5] = {{0, 0, 0, 0, 0},
                            {-1, 0, 0, 0, 0},
                            {-2, -1, 0, 0, 0},
                            {-3, -2, -1, 0, 0},
                            {-4, -3, -2, -1, 0}};
  const std::vector<float> s = SkewOnes(5, 5, 5);
  for (int i = 0; i < 5; ++i) {
    for (int j = 0; j <= i; ++j) EXPECT_EQ(s[i * 5 + j], seed[i][j]) << i << "," << j;
  }
}

// Seed 000, local: a block of N=5 queries against the previous block gives
// srel[i][j] = -(N + i - j); against its own block, the global skew above.
TEST(SkewTest, SeedLocalFiveByFive) {
  const float seed_prev[5][5] = {{-5, -4, -3, -2, -1},
                                 {-6, -5, -4, -3, -2},
                                 {-7, -6, -5, -4, -3},
                                 {-8, -7, -6, -5, -4},
                                 {-9, -8, -7, -6, -5}};
  // Queries at positions 5..9 against keys 0..9 (previous + current block), table of 2N rows.
  const std::vector<float> s = SkewOnes(5, 10, 10);
  for (int i = 0; i < 5; ++i) {
    for (int j = 0; j < 5; ++j) EXPECT_EQ(s[i * 10 + j], seed_prev[i][j]) << i << "," << j;
    for (int j = 0; j <= i; ++j) EXPECT_EQ(s[i * 10 + 5 + j], -(i - j)) << i << "," << j;
  }
}

// Distances the table does not cover contribute zero (not the edge row).
TEST(SkewTest, DistancesBeyondTableAreZero) {
  const std::vector<float> s = SkewOnes(6, 6, 3);
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j <= i; ++j) EXPECT_EQ(s[i * 6 + j], i - j < 3 ? -(i - j) : 0.0f);
  }
}

// Random q and table, any tile shape: the skew view equals q_i . E[m-1-d] computed directly.
TEST(SkewTest, RandomTilesMatchDirectProducts) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const int hd = 5;
  for (int lq : {1, 2, 7}) {
    for (int extra : {0, 1, 9}) {
      for (int m : {1, 4, 30}) {
        const int lk = lq + extra;
        std::vector<float> q(lq * hd), e(m * hd), s(lq * lk, 0.0f), scratch(lq * (lk + 1));
        for (float& v : q) v = nd(rng);
        for (float& v : e) v = nd(rng);
        cpu::AddSkewedRelativeLogits(q.data(), hd, lq, lk, e.data(), m, hd, 1.0f, s.data(),
                                     scratch.data());
        for (int i = 0; i < lq; ++i) {
          for (int j = 0; j <= i + extra; ++j) {
            const int d = i + extra - j;
            float want = 0.0f;
            if (d < m) {
              for (int x = 0; x < hd; ++x) want += q[i * hd + x] * e[(m - 1 - d) * hd + x];
            }
            EXPECT_NEAR(s[i * lk + j], want, 1e-5) << lq << " " << lk << " " << m;
          }
        }
      }
    }
  }
}

TEST(SkewTest, RowOfDistance) {
  // M = 4 rows for distances 3, 2, 1, 0; distance 4 and beyond has none (zero logit).
  EXPECT_EQ(relpos::SkewRow(0, 4), 3);
  EXPECT_EQ(relpos::SkewRow(3, 4), 0);
  EXPECT_EQ(relpos::SkewRow(4, 4), -1);
  EXPECT_EQ(relpos::SkewRow(100, 4), -1);
}

TEST(LocalWindowTest, BlocksResetAtBoundaries) {
  // Block length 4: positions 0..7 see from 0; 8..11 from 4; 12..15 from 8.
  for (int p = 0; p < 8; ++p) EXPECT_EQ(relpos::LocalWindowStart(p, 4), 0);
  for (int p = 8; p < 12; ++p) EXPECT_EQ(relpos::LocalWindowStart(p, 4), 4);
  for (int p = 12; p < 16; ++p) EXPECT_EQ(relpos::LocalWindowStart(p, 4), 8);
  EXPECT_EQ(relpos::WindowStart(relpos::Scheme::kSkew, 100, 4), 0);
}

TEST(ShawTest, ClipIndexRepeatsEdgeRow) {
  // Row = clip(j - i, -k, k) + k, k = 2: causal keys use rows 0..2.
  EXPECT_EQ(relpos::ShawRow(10, 10, 2), 2);
  EXPECT_EQ(relpos::ShawRow(10, 9, 2), 1);
  EXPECT_EQ(relpos::ShawRow(10, 8, 2), 0);
  EXPECT_EQ(relpos::ShawRow(10, 0, 2), 0);
  EXPECT_EQ(relpos::ShawRow(0, 5, 2), 4);
}

// Seed 002: 6 buckets, max distance 20, 14x14 (rows: query, cols: key), causal.
TEST(T5BucketTest, SeedTable) {
  const int seed[14][14] = {
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
      {2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
      {3, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {3, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
      {4, 3, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0}, {4, 4, 3, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0},
      {4, 4, 4, 3, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0}, {4, 4, 4, 4, 3, 3, 3, 2, 1, 0, 0, 0, 0, 0},
      {4, 4, 4, 4, 4, 3, 3, 3, 2, 1, 0, 0, 0, 0}, {5, 4, 4, 4, 4, 4, 3, 3, 3, 2, 1, 0, 0, 0},
      {5, 5, 4, 4, 4, 4, 4, 3, 3, 3, 2, 1, 0, 0}, {5, 5, 5, 4, 4, 4, 4, 4, 3, 3, 3, 2, 1, 0}};
  for (int i = 0; i < 14; ++i) {
    for (int j = 0; j < 14; ++j) {
      EXPECT_EQ(relpos::T5Bucket(j - i, 6, 20, false), seed[i][j]) << i << "," << j;
    }
  }
  const std::vector<int32_t> table = relpos::T5BucketTable(6, 20, false);
  for (int i = 0; i < 14; ++i) {
    EXPECT_EQ(relpos::T5BucketOfDistance(table.data(), static_cast<int>(table.size()), i), seed[i][0]);
  }
}

// Standard causal 32 buckets / 128: distances 0..15 exact; first distance of each log bucket
// 16..31 is 16, 19, 21, 24, 27, 31, 35, 40, 46, 52, 59, 67, 77, 87, 99, 113; 113 and beyond -> 31.
TEST(T5BucketTest, StandardCausal) {
  const int first[16] = {16, 19, 21, 24, 27, 31, 35, 40, 46, 52, 59, 67, 77, 87, 99, 113};
  for (int d = 0; d < 16; ++d) EXPECT_EQ(relpos::T5Bucket(-d, 32, 128, false), d);
  for (int b = 0; b < 16; ++b) {
    const int last = b < 15 ? first[b + 1] - 1 : 5000;
    for (int d = first[b]; d <= last; ++d) {
      ASSERT_EQ(relpos::T5Bucket(-d, 32, 128, false), 16 + b) << "distance " << d;
    }
  }
  // Future keys all share bucket 0 in the causal variant.
  EXPECT_EQ(relpos::T5Bucket(5, 32, 128, false), 0);
  const std::vector<int32_t> table = relpos::T5BucketTable(32, 128, false);
  const int len = static_cast<int>(table.size());
  EXPECT_EQ(relpos::T5BucketOfDistance(table.data(), len, 112), 30);
  EXPECT_EQ(relpos::T5BucketOfDistance(table.data(), len, 113), 31);
  EXPECT_EQ(relpos::T5BucketOfDistance(table.data(), len, 100000), 31);
}

// Bidirectional 32/128: 16 buckets a side, 8 exact; log bucket k starts where 8*16^(k/8) is
// reached: 8, 12, 16, 23, 32, 46, 64, 91 (computed by hand: ceil(8 * 2^(k/2))); positive
// relative positions are offset by 16.
TEST(T5BucketTest, Bidirectional) {
  const int first[8] = {8, 12, 16, 23, 32, 46, 64, 91};
  for (int d = 0; d < 8; ++d) {
    EXPECT_EQ(relpos::T5Bucket(-d, 32, 128, true), d);
    EXPECT_EQ(relpos::T5Bucket(d, 32, 128, true), d == 0 ? 0 : 16 + d);
  }
  for (int b = 0; b < 8; ++b) {
    const int last = b < 7 ? first[b + 1] - 1 : 1000;
    for (int d = first[b]; d <= last; ++d) {
      ASSERT_EQ(relpos::T5Bucket(-d, 32, 128, true), 8 + b) << "distance " << d;
      ASSERT_EQ(relpos::T5Bucket(d, 32, 128, true), 24 + b) << "distance " << d;
    }
  }
}

// An exact integer boundary: 32 buckets / 64 has log bucket 8 start at exactly 16*4^(1/2) = 32.
TEST(T5BucketTest, BoundaryOnAnInteger) {
  EXPECT_EQ(relpos::T5Bucket(-31, 32, 64, false), 23);
  EXPECT_EQ(relpos::T5Bucket(-32, 32, 64, false), 24);
}

TEST(AlibiTest, SlopesForEightAndTwelveHeads) {
  const std::vector<float> s8 = relpos::AlibiSlopes(8);
  ASSERT_EQ(s8.size(), 8u);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s8[h], std::pow(2.0f, -(h + 1.0f)));
  // 12 heads: the 8-head slopes, then 16-head slopes 1, 3, 5, 7: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  const std::vector<float> s12 = relpos::AlibiSlopes(12);
  ASSERT_EQ(s12.size(), 12u);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s12[h], s8[h]);
  for (int h = 0; h < 4; ++h) EXPECT_FLOAT_EQ(s12[8 + h], std::pow(2.0f, -(h + 0.5f)));
  EXPECT_FLOAT_EQ(relpos::AlibiBias(0.5f, 6), -3.0f);
}

}  // namespace
}  // namespace relgen
