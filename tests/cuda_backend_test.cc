// The CUDA backend and kernels against their CPU twins and the PyTorch goldens. Built twice: by
// nvcc's host compiler against the CUDA toolkit (cuda_backend_test; every test skips where no CUDA
// device is present), and against relgen's SIMT emulator (cuda_backend_test_emu, tests/simt), which
// runs every test on the CPU with smaller shapes (RELGEN_SIMT_EMULATOR) and adds emulator checks.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "engine/backends/cpu_backend.h"
#include "engine/backends/cuda_backend.h"
#include "engine/backends/device.h"
#include "engine/backends/step_sync.h"
#include "engine/core/engine.h"
#include "engine/tokenizers/tokenizer.h"
#include "kernels/cpu/attention.h"
#include "kernels/bf16.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/relpos_device.h"
#include "kernels/cuda/sampler_kernels.h"
#include "kernels/philox.h"
#include "kernels/relpos_host.h"
#include "tests/hf_reference.h"
#include "tests/sampling_reference.h"
#include "tests/t5_reference.h"
#include "tests/test_util.h"
#if RELGEN_SIMT_EMULATOR
#include "tests/simt/simt.h"
#endif

namespace relgen {
namespace {

// A device build on a machine without a device fails every case, so that a GPU run that tests
// nothing cannot pass; RELGEN_ALLOW_NO_GPU=1 (set by .ci/run, whose machines have nvcc but no GPU)
// turns that into a skip.
bool NoGpuAllowed() {
  const char* v = std::getenv("RELGEN_ALLOW_NO_GPU");
  return v != nullptr && std::string(v) == "1";
}
#define REQUIRE_GPU()                                                                                 \
  if (CudaDeviceCount() == 0) {                                                                       \
    if (NoGpuAllowed()) GTEST_SKIP() << "no CUDA device (RELGEN_ALLOW_NO_GPU=1)";                     \
    FAIL() << "no CUDA device; on a machine without one set RELGEN_ALLOW_NO_GPU=1 to skip these cases"; \
  }

// The emulator runs every thread of every block on one CPU core: the same cases, smaller.
#if RELGEN_SIMT_EMULATOR
constexpr bool kEmulated = true;
// One OS thread per CUDA thread (the race check): the kernel cases shrink again.
bool OnThreads() { return simt::ThreadMode(); }
#else
constexpr bool kEmulated = false;
bool OnThreads() { return false; }
#endif
#if RELGEN_SANITIZER
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

template <typename T>
T* Upload(const std::vector<T>& v) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

struct AttnCase {
  relpos::Scheme scheme;
  int param;  // skew M / shaw k
  int block_length;
  bool values;
  int length;
  int block_size;
  int head_dim = 64;  // 20: float rows in 16-byte loads, bf16 rows element by element; 7: both so
};

class CudaAttentionTest : public ::testing::TestWithParam<AttnCase> {};

// bf16's unit roundoff: 8 significant bits, rounded to nearest, so |bf16(x) - x| <= 2^-8 |x|.
constexpr double kBf16Roundoff = 1.0 / 256;

// Every row of a sequence at once (as a prefill) on the GPU == the CPU twin, scattered pages; with
// the cache in f32 and in bf16. In bf16 the twin is the CPU's bf16 cache (the same rounding rule,
// so the same stored bits, float32 arithmetic: 1e-4), and against the f32 result the error stays
// within what rounding K and V can cause, derived per (row, head, dim) from the data:
//   scores move by at most delta = scale * u * max_j sum_d |q_d k_jd| (u = 2^-8; the relative
//   tables stay float32), so each softmax weight by at most a factor e^(+-2 delta), and
//   |out'_d - out_d| <= (e^(2 delta) - 1) * max_j |v'_jd + x_jd| + u * max_j |v_jd|
//   (x: Shaw's value row, unrounded; j over every key up to the row, a superset of its window).
TEST_P(CudaAttentionTest, MatchesCpuTwin) {
  REQUIRE_GPU();
  const AttnCase p = GetParam();
  const int H = 4, hd = p.head_dim, W = H * hd, L = OnThreads() ? std::min(p.length, 12) : p.length, bs = p.block_size;
  const int nblocks = (L + bs - 1) / bs;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const std::vector<float> q = randv(size_t(L) * W), k = randv(size_t(L) * W), v = randv(size_t(L) * W);
  const int rows = p.scheme == relpos::Scheme::kShaw ? 2 * p.param + 1 : std::max(p.param, 1);
  const std::vector<float> tk = randv(size_t(H) * rows * hd), tv = randv(size_t(H) * rows * hd), t5 = randv(H * 32);
  const std::vector<int32_t> t5_table = relpos::T5BucketTable(32, 128, false);
  const std::vector<float> slopes = relpos::AlibiSlopes(H);
  std::vector<int32_t> table(nblocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);

  cpu::RelativeParams crel;
  crel.scheme = p.scheme;
  crel.table_k = tk.data();
  crel.table_v = p.values ? tv.data() : nullptr;
  crel.rows = rows;
  crel.clip_k = p.param;
  crel.block_length = p.block_length;
  crel.t5_bias = t5.data();
  crel.t5_num_buckets = 32;
  crel.t5_bucket_of_distance = t5_table.data();
  crel.t5_table_len = static_cast<int>(t5_table.size());
  crel.alibi_slopes = slopes.data();
  const cpu::AttentionDims dims{H, hd, 0.125f};
  std::vector<float> kpool(size_t(nblocks) * H * bs * hd), vpool(kpool.size());
  cpu::KvView view{kpool.data(), vpool.data(), table.data(), bs, H, hd};
  cpu::WriteKv(view, k.data(), v.data(), 0, L);
  std::vector<float> want32(size_t(L) * W);
  cpu::AttentionPrefill(dims, crel, view, q.data(), 0, L, want32.data());
  std::vector<uint16_t> kpool16(kpool.size()), vpool16(kpool.size());
  cpu::KvView view16{kpool16.data(), vpool16.data(), table.data(), bs, H, hd, cpu::KvType::kBf16};
  cpu::WriteKv(view16, k.data(), v.data(), 0, L);
  std::vector<float> want16(size_t(L) * W);
  cpu::AttentionPrefill(dims, crel, view16, q.data(), 0, L, want16.data());
  // The bf16 bound above, per (row, head, dim), in float64; maxima over keys 0..i as i grows.
  std::vector<double> bound(size_t(L) * W);
  for (int h = 0; h < H; ++h) {
    std::vector<double> vmax(hd, 0.0), v16max(hd, 0.0);
    for (int i = 0; i < L; ++i) {
      const size_t at = size_t(i) * W + h * hd;
      for (int d = 0; d < hd; ++d) {
        double extra = 0;  // Shaw's value rows, any distance
        for (int row = 0; p.scheme == relpos::Scheme::kShaw && p.values && row < rows; ++row) {
          extra = std::max(extra, std::abs(double(tv[(size_t(h) * rows + row) * hd + d])));
        }
        vmax[d] = std::max(vmax[d], std::abs(double(v[at + d])));
        v16max[d] = std::max(v16max[d], std::abs(testing::Bf16Value(v[at + d])) + extra);
      }
      double dotmax = 0;
      for (int j = 0; j <= i; ++j) {
        double sum = 0;
        for (int d = 0; d < hd; ++d) sum += std::abs(double(q[at + d]) * k[size_t(j) * W + h * hd + d]);
        dotmax = std::max(dotmax, sum);
      }
      const double delta = 0.125 * kBf16Roundoff * dotmax;
      for (int d = 0; d < hd; ++d) bound[at + d] = std::expm1(2 * delta) * v16max[d] + kBf16Roundoff * vmax[d];
    }
  }

  cuda::Relative grel;
  grel.scheme = p.scheme;
  grel.table_k = Upload(tk);
  grel.table_v = p.values ? Upload(tv) : nullptr;
  grel.rows = rows;
  grel.clip_k = p.param;
  grel.block_length = p.block_length;
  grel.t5_bias = Upload(t5);
  grel.t5_num_buckets = 32;
  grel.t5_bucket_of_distance = Upload(t5_table);
  grel.t5_table_len = static_cast<int>(t5_table.size());
  grel.alibi_slopes = Upload(slopes);
  std::vector<int32_t> position(L), offset(L, 0);
  std::iota(position.begin(), position.end(), 0);
  cuda::Rows r{L, Upload(position), Upload(offset), Upload(table)};
  float* dq = Upload(q);
  float *dk = Upload(k), *dv = Upload(v);
  // A step of mixed rows for the tiled (prefill) kernel: runs of this sequence's rows (A), of a
  // second sequence B reading the same pool through another block table, and single rows, so that
  // the kernel's 4-row blocks straddle sequences, and (local attention) window starts.
  std::vector<int32_t> table_b = table;
  std::shuffle(table_b.begin(), table_b.end(), rng);
  std::vector<int32_t> both = table;
  both.insert(both.end(), table_b.begin(), table_b.end());
  std::vector<int32_t> mixed_position, mixed_offset;
  auto add = [&](int from, int to, int seq) {
    for (int pos = from; pos < std::min(to, L); ++pos) {
      mixed_position.push_back(pos);
      mixed_offset.push_back(seq * nblocks);
    }
  };
  if (!OnThreads()) {  // there a block is 128 OS threads: the whole sequence's tiles only
    add(3, 43, 0);
    add(0, 6, 1);
    add(L - 1, L, 0);
    add(L / 2, L / 2 + 1, 0);
    add(std::max(0, L - 7), L, 1);
    add(0, 3, 0);
  }
  const int M = static_cast<int>(mixed_position.size());
  std::vector<float> mixed_q;
  for (const int pos : mixed_position) mixed_q.insert(mixed_q.end(), q.begin() + size_t(pos) * W, q.begin() + size_t(pos + 1) * W);
  cuda::Rows mixed{M, Upload(mixed_position), Upload(mixed_offset), Upload(both)};
  float* dmq = Upload(mixed_q);
  for (const cuda::KvElem type : {cuda::KvElem::kF32, cuda::KvElem::kBf16}) {
    const bool bf16 = type == cuda::KvElem::kBf16;
    SCOPED_TRACE(bf16 ? "bf16 cache" : "f32 cache");
    // Poisoned: NaN in either type (0xffff is a bf16 NaN).
    const size_t pool_bytes = kpool.size() * (bf16 ? 2 : 4);
    cuda::KvPool pool{Upload(std::vector<uint8_t>(pool_bytes, 0xff)), Upload(std::vector<uint8_t>(pool_bytes, 0xff)),
                      bs, H, hd, type};
    ASSERT_EQ(cuda::WriteKv(pool, r, dk, dv, nullptr), cudaSuccess);
    const std::vector<float>& want = bf16 ? want16 : want32;
    // Several key splits per row; and one split, where a warp takes several 32-key tiles (rows past
    // 128 keys) and rescales its running softmax between them.
    std::vector<int> splits = {OnThreads() ? 4 : kEmulated ? 32 : 128};
    if (!OnThreads()) splits.push_back(L);
    for (const int kps : splits) {
      float* work = Upload(std::vector<float>(std::max<int64_t>(cuda::AttentionWorkspace(std::max(L, M), H, hd, L, kps), 1)));
      float* dout = Upload(std::vector<float>(size_t(L) * W, NAN));
      ASSERT_EQ(cuda::Attention(dq, r, L, 0.125f, grel, pool, dout, work, kps, nullptr), cudaSuccess);
      std::vector<float> got(size_t(L) * W);
      ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      double moved = 0;  // from the f32 cache's output
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::abs(want[i]))) << "keys per split " << kps << ", element " << i;
        if (!bf16) continue;
        ASSERT_LE(std::abs(double(got[i]) - want32[i]), bound[i] + 1e-4 * (1 + std::abs(want32[i])))
            << "keys per split " << kps << ", element " << i;
        moved = std::max(moved, std::abs(double(got[i]) - want32[i]));
      }
      if (bf16) EXPECT_GT(moved, 1e-4) << "the bf16 cache in effect";
      // The tiled kernel: every row bit for bit the per-row kernel's, over the whole sequence and
      // over the mixed step; the per-row kernel's rows of A there are those of the sequence alone.
      auto run = [&](const float* dq_rows, const cuda::Rows& rows, int n, bool tiled) {
        float* o = Upload(std::vector<float>(size_t(n) * W, NAN));
        EXPECT_EQ(cuda::Attention(dq_rows, rows, L, 0.125f, grel, pool, o, work, kps, nullptr, tiled), cudaSuccess);
        std::vector<float> host(size_t(n) * W);
        EXPECT_EQ(cudaMemcpy(host.data(), o, host.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(o);
        return host;
      };
      const std::vector<float> tiled = run(dq, r, L, true);
      ASSERT_EQ(std::memcmp(tiled.data(), got.data(), got.size() * sizeof(float)), 0) << "keys per split " << kps;
      if (M > 0) {
        const std::vector<float> mixed_rows = run(dmq, mixed, M, false), mixed_tiled = run(dmq, mixed, M, true);
        for (int i = 0; i < M; ++i) {
          SCOPED_TRACE(::testing::Message() << "keys per split " << kps << ", mixed row " << i << " (position "
                                            << mixed_position[i] << (mixed_offset[i] > 0 ? ", B)" : ", A)"));
          ASSERT_EQ(std::memcmp(&mixed_tiled[size_t(i) * W], &mixed_rows[size_t(i) * W], W * sizeof(float)), 0);
          if (mixed_offset[i] == 0) {
            ASSERT_EQ(std::memcmp(&mixed_rows[size_t(i) * W], &got[size_t(mixed_position[i]) * W], W * sizeof(float)), 0);
          }
        }
      }
      cudaFree(work);
      cudaFree(dout);
    }
    cudaFree(pool.k);
    cudaFree(pool.v);
  }
}

#if !RELGEN_SIMT_EMULATOR
INSTANTIATE_TEST_SUITE_P(
    Schemes, CudaAttentionTest,
    ::testing::Values(AttnCase{relpos::Scheme::kNone, 0, 0, false, 37, 7}, AttnCase{relpos::Scheme::kSkew, 20, 0, false, 300, 16},
                      AttnCase{relpos::Scheme::kSkew, 1000, 0, false, 701, 5}, AttnCase{relpos::Scheme::kSkewLocal, 64, 32, false, 333, 16},
                      AttnCase{relpos::Scheme::kShaw, 8, 0, true, 129, 3}, AttnCase{relpos::Scheme::kShaw, 300, 0, false, 513, 16},
                      AttnCase{relpos::Scheme::kT5, 0, 0, false, 257, 1}, AttnCase{relpos::Scheme::kAlibi, 0, 0, false, 999, 16},
                      AttnCase{relpos::Scheme::kShaw, 6, 0, true, 145, 5, 20}, AttnCase{relpos::Scheme::kSkew, 30, 0, false, 140, 3, 7}));
#else
// Each case keeps what it tests: skew with M < L (zero beyond M) and M > L, local with several
// blocks, Shaw clipped on both sides with and without values, T5 past its table (> 128), ALiBi.
INSTANTIATE_TEST_SUITE_P(
    Schemes, CudaAttentionTest,
    ::testing::Values(AttnCase{relpos::Scheme::kNone, 0, 0, false, 37, 7}, AttnCase{relpos::Scheme::kSkew, 20, 0, false, 96, 16},
                      AttnCase{relpos::Scheme::kSkew, 200, 0, false, 130, 5}, AttnCase{relpos::Scheme::kSkewLocal, 24, 16, false, 80, 16},
                      AttnCase{relpos::Scheme::kShaw, 8, 0, true, 70, 3}, AttnCase{relpos::Scheme::kShaw, 50, 0, false, 130, 16},
                      AttnCase{relpos::Scheme::kT5, 0, 0, false, 150, 1}, AttnCase{relpos::Scheme::kAlibi, 0, 0, false, 140, 16},
                      AttnCase{relpos::Scheme::kShaw, 6, 0, true, 45, 5, 20}, AttnCase{relpos::Scheme::kSkew, 30, 0, false, 40, 3, 7}));
#endif

// cuda::AttentionMma, attention on tensor cores, against the CPU twin with the same bf16 cache:
// within the bound its roundings allow (u = 2^-8 each; decoder_kernels.h), derived here per (row,
// head, dim) from the case's own data:
//   each score moves by at most delta = scale * u * max_j sum_d |q_d k'_jd|
//                                      + c * (2u + u^2) * max_e sum_d |q_d e_d|  (skew, Shaw keys)
//   (k' the cache's bf16 key, e any E row, c the relative term's factor); each weight's ratio to
//   the twin's then lies within e^(+-2 delta) and its bf16 rounding multiplies it by 1 +- u, so
//   |out - want| <= (e^(2 delta) (1 + u) - 1) * max_j |v'_jd + x_jd|  (x: Shaw's value rows),
// plus float32's summation noise (1e-4 relative). And bit for bit: prefill (16 rows a block) ==
// decode (a row a block) over the whole sequence, and every row of a mixed step (runs of two
// sequences reading the same pool, single rows, a window start inside a run) == that row decoded
// alone; the pool is poisoned (NaN) past what the step wrote.
struct MmaAttnCase {
  relpos::Scheme scheme;
  int param;  // skew M / Shaw k
  int block_length;
  bool values;
  int length;
  int block_size;
  int head_dim;
  bool bidirectional = false;
};

class CudaAttentionMmaTest : public ::testing::TestWithParam<MmaAttnCase> {};

TEST_P(CudaAttentionMmaTest, WithinTheBf16BoundAndTheSameBitsHoweverBatched) {
  REQUIRE_GPU();
  const MmaAttnCase p = GetParam();
  const int H = 2, hd = p.head_dim, W = H * hd, L = OnThreads() ? std::min(p.length, 12) : p.length, bs = p.block_size;
  const int nblocks = (L + bs - 1) / bs;
  const float scale = 1.f / std::sqrt(float(hd));
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const std::vector<float> q = randv(size_t(L) * W), k = randv(size_t(L) * W), v = randv(size_t(L) * W);
  const int rows = p.scheme == relpos::Scheme::kShaw ? 2 * p.param + 1 : std::max(p.param, 1);
  const std::vector<float> tk = randv(size_t(H) * rows * hd), tv = randv(size_t(H) * rows * hd), t5 = randv(H * 32);
  const std::vector<int32_t> t5_table =
      p.bidirectional ? relpos::T5SignedBucketTable(32, 40) : relpos::T5BucketTable(32, 40, false);
  const std::vector<float> slopes = relpos::AlibiSlopes(H);
  std::vector<int32_t> table(nblocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);

  cpu::RelativeParams crel;
  crel.scheme = p.scheme;
  crel.table_k = tk.data();
  crel.table_v = p.values ? tv.data() : nullptr;
  crel.rows = rows;
  crel.clip_k = p.param;
  crel.block_length = p.block_length;
  crel.t5_bias = t5.data();
  crel.t5_num_buckets = 32;
  crel.t5_bucket_of_distance = t5_table.data();
  crel.t5_table_len = static_cast<int>(t5_table.size());
  crel.alibi_slopes = slopes.data();
  const cpu::AttentionDims dims{H, hd, scale};
  std::vector<uint16_t> kpool16(size_t(nblocks) * H * bs * hd), vpool16(kpool16.size());
  cpu::KvView view16{kpool16.data(), vpool16.data(), table.data(), bs, H, hd, cpu::KvType::kBf16};
  cpu::WriteKv(view16, k.data(), v.data(), 0, L);
  std::vector<float> want(size_t(L) * W);
  if (p.bidirectional) {
    cpu::AttentionBidirectional(dims, crel, view16, q.data(), L, want.data());
  } else {
    cpu::AttentionPrefill(dims, crel, view16, q.data(), 0, L, want.data());
  }
  const bool rel_k = p.scheme == relpos::Scheme::kSkew || p.scheme == relpos::Scheme::kSkewLocal ||
                     p.scheme == relpos::Scheme::kShaw;
  std::vector<double> bound(size_t(L) * W);
  for (int h = 0; h < H; ++h) {
    double qe = 0;  // max over rows i and E rows of sum_d |q_d e_d|, per row below
    std::vector<double> vmax(hd, 0.0);
    auto widen = [](float x) { return double(testing::Bf16Value(x)); };
    for (int i = 0; i < L; ++i) {
      const size_t at = size_t(i) * W + h * hd;
      const int last = p.bidirectional ? L - 1 : i;
      std::fill(vmax.begin(), vmax.end(), 0.0);
      double dotmax = 0;
      for (int j = 0; j <= last; ++j) {
        double sum = 0;
        for (int d = 0; d < hd; ++d) {
          sum += std::abs(double(q[at + d]) * widen(k[size_t(j) * W + h * hd + d]));
          vmax[d] = std::max(vmax[d], std::abs(widen(v[size_t(j) * W + h * hd + d])));
        }
        dotmax = std::max(dotmax, sum);
      }
      qe = 0;
      for (int e = 0; rel_k && e < rows; ++e) {
        double sum = 0;
        for (int d = 0; d < hd; ++d) sum += std::abs(double(q[at + d]) * tk[(size_t(h) * rows + e) * hd + d]);
        qe = std::max(qe, sum);
      }
      const double u = kBf16Roundoff;
      const double delta = scale * u * dotmax + scale * (2 * u + u * u) * qe;
      for (int d = 0; d < hd; ++d) {
        double extra = 0;
        for (int e = 0; p.values && e < rows; ++e) extra = std::max(extra, std::abs(double(tv[(size_t(h) * rows + e) * hd + d])));
        bound[at + d] = (std::exp(2 * delta) * (1 + u) - 1) * (vmax[d] + extra);
      }
    }
  }

  cuda::Relative grel;
  grel.scheme = p.scheme;
  grel.table_k = Upload(tk);
  grel.table_v = p.values ? Upload(tv) : nullptr;
  grel.rows = rows;
  grel.clip_k = p.param;
  grel.block_length = p.block_length;
  grel.t5_bias = Upload(t5);
  grel.t5_num_buckets = 32;
  grel.t5_bucket_of_distance = Upload(t5_table);
  grel.t5_table_len = static_cast<int>(t5_table.size());
  grel.alibi_slopes = Upload(slopes);
  std::vector<int32_t> position(L), offset(L, 0), keys(L, L);
  std::iota(position.begin(), position.end(), 0);
  cuda::Rows r{L, Upload(position), Upload(offset), Upload(table), p.bidirectional ? Upload(keys) : nullptr};
  // The mixed step: runs of A, of B (the same pool through another table), single rows. B's last
  // block is A's, so B too sees written keys only: a 16-row tile multiplies every key below its
  // rows' last end (with weight 0 past a row's own), which the engine has always written.
  std::vector<int32_t> table_b = table;
  std::shuffle(table_b.begin(), table_b.end() - 1, rng);
  std::vector<int32_t> both = table;
  both.insert(both.end(), table_b.begin(), table_b.end());
  std::vector<int32_t> mixed_position, mixed_offset;
  auto add = [&](int from, int to, int seq) {
    for (int pos = from; pos < std::min(to, L); ++pos) {
      mixed_position.push_back(pos);
      mixed_offset.push_back(seq * nblocks);
    }
  };
  if (!OnThreads()) {
    add(3, 43, 0);
    add(0, 6, 1);
    add(L - 1, L, 0);
    add(L / 2, L / 2 + 1, 0);
    add(std::max(0, L - 21), L, 1);
    add(0, 3, 0);
  } else {
    add(2, 7, 1);
    add(L - 1, L, 0);
  }
  const int M = static_cast<int>(mixed_position.size());
  std::vector<float> mixed_q;
  for (const int pos : mixed_position) mixed_q.insert(mixed_q.end(), q.begin() + size_t(pos) * W, q.begin() + size_t(pos + 1) * W);
  std::vector<int32_t> mixed_keys(M, L);
  cuda::Rows mixed{M, Upload(mixed_position), Upload(mixed_offset), Upload(both),
                   p.bidirectional ? Upload(mixed_keys) : nullptr};
  float* dq = Upload(q);
  float* dmq = Upload(mixed_q);
  const size_t pool_bytes = kpool16.size() * 2;
  cuda::KvPool pool{Upload(std::vector<uint8_t>(pool_bytes, 0xff)), Upload(std::vector<uint8_t>(pool_bytes, 0xff)),
                    bs, H, hd, cuda::KvElem::kBf16};
  ASSERT_TRUE(cuda::AttentionMmaSupported(pool));
  ASSERT_EQ(cudaMemcpy(pool.k, kpool16.data(), pool_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(pool.v, vpool16.data(), pool_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  // Poison what no row may read: the pool's blocks past the sequence's last position.
  for (int pos = L; pos < nblocks * bs; ++pos) {
    for (int h = 0; h < H; ++h) {
      const size_t at = ((size_t(table[pos / bs]) * H + h) * bs + pos % bs) * hd;
      ASSERT_EQ(cudaMemset(static_cast<uint16_t*>(pool.k) + at, 0xff, hd * 2), cudaSuccess);
      ASSERT_EQ(cudaMemset(static_cast<uint16_t*>(pool.v) + at, 0xff, hd * 2), cudaSuccess);
    }
  }
  // Several splits, and (not on threads, where a block is 128 OS threads, nor under a sanitizer)
  // one split.
  std::vector<int> splits = {OnThreads() ? 4 : 40};
  if (!OnThreads() && !kSanitized) splits.push_back(L);
  for (const int kps : splits) {
    SCOPED_TRACE(::testing::Message() << "keys per split " << kps);
    float* work = Upload(std::vector<float>(std::max<int64_t>(cuda::AttentionWorkspace(std::max(L, M), H, hd, L, kps), 1)));
    auto run = [&](const float* dq_rows, const cuda::Rows& rs, int n, bool tiled) {
      float* o = Upload(std::vector<float>(size_t(n) * W, NAN));
      EXPECT_EQ(cuda::AttentionMma(dq_rows, rs, L, scale, grel, pool, o, work, kps, nullptr, tiled, p.bidirectional),
                cudaSuccess);
      std::vector<float> host(size_t(n) * W);
      EXPECT_EQ(cudaMemcpy(host.data(), o, host.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      cudaFree(o);
      return host;
    };
    const std::vector<float> decode = run(dq, r, L, false);
    double moved = 0;
    for (size_t i = 0; i < decode.size(); ++i) {
      ASSERT_LE(std::abs(double(decode[i]) - want[i]), bound[i] + 1e-4 * (1 + std::abs(want[i]))) << "element " << i;
      moved = std::max(moved, std::abs(double(decode[i]) - want[i]));
    }
    EXPECT_GT(moved, 1e-4) << "q and the weights in bf16: the tensor-core path in effect";
    const std::vector<float> prefill = run(dq, r, L, true);
    ASSERT_EQ(std::memcmp(prefill.data(), decode.data(), decode.size() * sizeof(float)), 0) << "prefill vs decode";
    if (M > 0) {
      const std::vector<float> mixed_rows = run(dmq, mixed, M, false), mixed_tiled = run(dmq, mixed, M, true);
      for (int i = 0; i < M; ++i) {
        SCOPED_TRACE(::testing::Message() << "mixed row " << i << " (position " << mixed_position[i]
                                          << (mixed_offset[i] > 0 ? ", B)" : ", A)"));
        ASSERT_EQ(std::memcmp(&mixed_tiled[size_t(i) * W], &mixed_rows[size_t(i) * W], W * sizeof(float)), 0);
        if (mixed_offset[i] == 0) {  // B's keys are other positions' rows of the pool
          ASSERT_EQ(std::memcmp(&mixed_rows[size_t(i) * W], &decode[size_t(mixed_position[i]) * W], W * sizeof(float)), 0);
        }
      }
    }
    cudaFree(work);
  }
}

// Head sizes 64 and 128 (bloom-560m and flan-t5-base; mpt-7b), and 16 and 32, every scheme: skew with M below and
// above the length, local attention (window starts inside the 16-row tiles), Shaw clipped on both
// sides with and without value rows, T5 past its table, ALiBi, the encoder's signed T5 buckets.
INSTANTIATE_TEST_SUITE_P(
    Schemes, CudaAttentionMmaTest,
    ::testing::Values(MmaAttnCase{relpos::Scheme::kNone, 0, 0, false, 77, 16, 64},
                      MmaAttnCase{relpos::Scheme::kSkew, 20, 0, false, 70, 16, 64},
                      MmaAttnCase{relpos::Scheme::kSkew, 100, 0, false, 90, 8, 128},
                      MmaAttnCase{relpos::Scheme::kSkewLocal, 24, 16, false, 75, 16, 64},
                      MmaAttnCase{relpos::Scheme::kShaw, 6, 0, true, 70, 16, 64},
                      MmaAttnCase{relpos::Scheme::kShaw, 9, 0, false, 66, 16, 128},
                      MmaAttnCase{relpos::Scheme::kT5, 0, 0, false, 99, 16, 64},
                      MmaAttnCase{relpos::Scheme::kAlibi, 0, 0, false, 81, 16, 128},
                      MmaAttnCase{relpos::Scheme::kT5, 0, 0, false, 60, 16, 64, true},
                      MmaAttnCase{relpos::Scheme::kNone, 0, 0, false, 50, 16, 128, true},
                      MmaAttnCase{relpos::Scheme::kSkewLocal, 40, 8, false, 60, 8, 16},
                      MmaAttnCase{relpos::Scheme::kShaw, 5, 0, true, 55, 16, 32}));

// What the tensor-core kernel does not take is refused, not computed some other way.
TEST(CudaKernelsTest, AttentionMmaRefusesWhatItDoesNotTake) {
  REQUIRE_GPU();
  cuda::KvPool f32{nullptr, nullptr, 16, 2, 64, cuda::KvElem::kF32}, hd80{nullptr, nullptr, 16, 2, 80, cuda::KvElem::kBf16};
  EXPECT_FALSE(cuda::AttentionMmaSupported(f32));
  EXPECT_FALSE(cuda::AttentionMmaSupported(hd80));
  cuda::Rows none;
  EXPECT_EQ(cuda::AttentionMma(nullptr, none, 0, 1.f, cuda::Relative{}, f32, nullptr, nullptr, 128, nullptr, true),
            cudaErrorInvalidValue);
  cuda::KvPool ok{nullptr, nullptr, 16, 2, 64, cuda::KvElem::kBf16};
  cuda::Relative skew;
  skew.scheme = relpos::Scheme::kSkew;
  EXPECT_EQ(cuda::AttentionMma(nullptr, none, 0, 1.f, skew, ok, nullptr, nullptr, 128, nullptr, true, true),
            cudaErrorInvalidValue);
}

// A golden case's first `len` tokens and their float64 logits [len, vocab].
struct Golden {
  std::vector<int32_t> tokens;
  std::vector<double> logits;
};
Golden LoadGolden(const std::string& dir, int len) {
  auto file = *SafetensorsFile::Open(dir + "/golden.safetensors");
  const TensorInfo* t = file->Find("tokens_" + std::to_string(len));
  const TensorInfo* l = file->Find("logits_" + std::to_string(len));
  Golden g{std::vector<int32_t>(len), std::vector<double>(l->numel())};
  std::memcpy(g.tokens.data(), t->data, len * sizeof(int32_t));
  std::memcpy(g.logits.data(), l->data, l->nbytes);
  return g;
}

// Every position's logits of `tokens`, fed `chunk` tokens per Forward through a reversed block
// table of 16 blocks.
std::vector<float> ForwardInChunks(Backend& backend, const std::vector<int32_t>& tokens, int chunk) {
  std::vector<int32_t> table(16);
  std::iota(table.begin(), table.end(), 0);
  std::reverse(table.begin(), table.end());
  std::vector<float> all, part;
  const int len = static_cast<int>(tokens.size());
  for (int pos = 0; pos < len; pos += chunk) {
    const int n = std::min(chunk, len - pos);
    SequenceStep s{absl::MakeConstSpan(tokens).subspan(pos, n), pos, table, true};
    EXPECT_TRUE(ForwardLogits(backend, {&s, 1}, &part).ok());
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

class CudaParityTest : public ::testing::TestWithParam<std::string> {};

// The CUDA backend's logits against the PyTorch goldens, whole and token by token; with relgen's
// projections (the default) and, at one length, with cuBLAS's.
TEST_P(CudaParityTest, MatchesReference) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  auto model = *Model::Load(dir);
  const int vocab = model->config().vocab_size;
  // Emulated under a sanitizer: still past a KV block (16), whole and token by token.
  const std::vector<int> lengths = !kEmulated ? std::vector<int>{1, 17, 129}
                                   : kSanitized ? std::vector<int>{1, 17}
                                                : std::vector<int>{1, 17, 64};
  for (const bool cublas : {false, true}) {
    SCOPED_TRACE(cublas ? "cuBLAS projections" : "relgen's projections");
    CudaOptions o;
    o.num_blocks = 64;
    o.cublas_gemms = cublas;
    auto backend = NewCudaBackend(model, o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    for (int len : cublas ? std::vector<int>{17} : lengths) {
      const Golden g = LoadGolden(dir, len);
      std::vector<std::vector<float>> runs;
      for (int chunk : {len, 1}) {
        runs.push_back(ForwardInChunks(**backend, g.tokens, chunk));
        testing::ExpectRowsClose(runs.back().data(), g.logits.data(), len, vocab, 1e-4,
                                 GetParam() + " chunk " + std::to_string(chunk));
      }
      // relgen's projections and the tiled prefill attention keep every row's arithmetic whatever
      // rows run beside it: one prefill and token-by-token decode give the same bits.
      if (!cublas) {
        EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)), 0)
            << GetParam() << " length " << len << ": prefill and decode differ";
      }
    }
  }
}

// The bf16 cache end to end, whole and token by token: the CUDA backend's logits against the CPU
// backend's with a bf16 cache (one rounding rule, float32 arithmetic in both), and against the
// float64 golden of the f32 model, from which bf16 K/V must move them (the cache type in effect).
// Tolerances, relative to the row's largest logit. CPU twin: the two backends' float32 sums differ
// in order, so a K or V element within an ulp of a bf16 rounding boundary may round the other way
// on one of them (that element moved by up to 2^-8 of itself): seen up to 3.5e-4 on the goldens
// (skew_long_range), 1e-6 where nothing flips. Golden: every K and V element moved by up to
// u = 2^-8 (kBf16Roundoff), so each attention output by O(u) of its scale (the kernel bound in
// CudaAttentionTest), and the logits with it: 2.5 u; seen up to 2.8e-3 (0.7 u).
constexpr double kBf16TwinTol = 2e-3, kBf16GoldenTol = 2.5 * kBf16Roundoff;
TEST_P(CudaParityTest, Bf16CacheMatchesCpuTwin) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  auto model = *Model::Load(dir);
  CudaOptions o;
  o.num_blocks = 64;
  o.kv_type = cpu::KvType::kBf16;
  auto backend = NewCudaBackend(model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto twin = NewCpuBackend(model, KvCacheConfig{16, 64}, 1, cpu::WeightType::kF32, cpu::KvType::kBf16);
  ASSERT_TRUE(twin.ok()) << twin.status();
  const int vocab = model->config().vocab_size;
  const int len = kSanitized ? 17 : 64;
  const Golden g = LoadGolden(dir, len);
  const std::vector<double>& want = g.logits;
  for (int chunk : {len, 1}) {
    const std::string what = GetParam() + " chunk " + std::to_string(chunk);
    const std::vector<float> all = ForwardInChunks(**backend, g.tokens, chunk);
    const std::vector<float> cpu_all = ForwardInChunks(**twin, g.tokens, chunk);
    const std::vector<double> cpu_wide(cpu_all.begin(), cpu_all.end());
    double moved = 0;
    for (size_t i = 0; i < all.size(); ++i) moved = std::max(moved, std::abs(all[i] - want[i]));
    testing::ExpectRowsClose(all.data(), cpu_wide.data(), len, vocab, kBf16TwinTol, what + " vs the CPU's bf16 cache");
    testing::ExpectRowsClose(all.data(), want.data(), len, vocab, kBf16GoldenTol, what + " vs the f32 golden");
    EXPECT_GT(moved, 1e-5) << what << ": the bf16 cache in effect";
  }
}

// bf16 weights end to end, whole and token by token: the CUDA backend's logits against the CPU
// backend's with bf16 weights (one rounding rule for the weights, float32 sums in both, in different
// orders: 1e-4 of the row's largest logit, as the float32 parity), moved from the float32 model's
// golden (the weights' type in effect) or, for goldens stored in bf16, bitwise the float32 weights'
// logits; and prefill equal to decode bit for bit.
TEST_P(CudaParityTest, Bf16WeightsMatchCpuTwin) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  auto model = *Model::Load(dir);
  CudaOptions o;
  o.num_blocks = 64;
  o.weight_type = cpu::WeightType::kBf16;
  auto backend = NewCudaBackend(model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto twin = NewCpuBackend(model, KvCacheConfig{16, 64}, 1, cpu::WeightType::kBf16, cpu::KvType::kF32);
  ASSERT_TRUE(twin.ok()) << twin.status();
  CudaOptions f32_options;
  f32_options.num_blocks = 64;
  auto plain = NewCudaBackend(model, f32_options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  // Some goldens are stored in bf16 (checkpoint dtype): their weights round to themselves.
  const ModelConfig& c = model->config();
  const std::vector<float> wq = model->layer(0).wq->ToFloat();
  bool stored_bf16 = true;
  for (int64_t i = 0; i < int64_t{c.qkv_width()} * c.d_model; ++i) stored_bf16 &= testing::Bf16Value(wq[i]) == wq[i];
  const int vocab = c.vocab_size;
  const int len = 17;
  const Golden g = LoadGolden(dir, len);
  std::vector<std::vector<float>> runs;
  for (int chunk : {len, 1}) {
    const std::string what = GetParam() + " chunk " + std::to_string(chunk);
    runs.push_back(ForwardInChunks(**backend, g.tokens, chunk));
    const std::vector<float>& all = runs.back();
    const std::vector<float> cpu_all = ForwardInChunks(**twin, g.tokens, chunk);
    const std::vector<double> cpu_wide(cpu_all.begin(), cpu_all.end());
    testing::ExpectRowsClose(all.data(), cpu_wide.data(), len, vocab, 1e-4, what + " vs the CPU's bf16 weights");
    if (stored_bf16) {
      // Rounding is the identity there and the sums keep their order: the float32 weights' bits.
      const std::vector<float> f32 = ForwardInChunks(**plain, g.tokens, chunk);
      EXPECT_EQ(std::memcmp(all.data(), f32.data(), all.size() * sizeof(float)), 0) << what;
      continue;
    }
    double moved = 0, largest = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      moved = std::max(moved, std::abs(all[i] - g.logits[i]));
      largest = std::max(largest, std::abs(g.logits[i]));
    }
    EXPECT_GT(moved, 1e-4 * largest) << what << ": the bf16 weights in effect";
  }
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)), 0) << GetParam();
}

// The same logits: bitwise on the emulator (its GEMM sums each element in one order whatever the
// shape); within float rounding on a GPU, where cuBLAS may pick another kernel for another shape.
void ExpectSameLogits(const float* got, const float* want, int rows, int vocab, const std::string& what) {
  if (kEmulated) {
    EXPECT_EQ(std::memcmp(got, want, sizeof(float) * rows * vocab), 0) << what;
    return;
  }
  const std::vector<double> w(want, want + int64_t{rows} * vocab);
  testing::ExpectRowsClose(got, w.data(), rows, vocab, 1e-5, what);
}

// The largest over rows of max |a - b| / max |b| in the row.
double WorstRowError(const std::vector<float>& a, const std::vector<float>& b, int cols) {
  double worst = 0;
  for (size_t r = 0; r < a.size() / cols; ++r) {
    double ref = 0, err = 0;
    for (int c = 0; c < cols; ++c) {
      const size_t k = r * cols + c;
      ref = std::max(ref, double(std::abs(b[k])));
      err = std::max(err, double(std::abs(a[k] - b[k])));
    }
    worst = std::max(worst, err / ref);
  }
  return worst;
}

// Tensor cores against their CPU twin: bf16 weights with every projection's input rounded to bf16
// (NewCpuBackend's ProjectionInputs::kBf16), each product exact in float32 on both. Where the float32
// work before a projection agrees (on the emulator, mostly) the two agree bit for bit; where it
// differs in its last bits (another attention kernel), an activation near a rounding midpoint can
// round to the other bf16 neighbour, and from there the two move apart. Such flips are a few of
// the roundings, so per case they move the logits by no more than rounding every activation does:
// the twin's distance from float32 activations (plain), measured here, bounds the tensor cores'
// distance from the twin. `run` gives a backend's logits for a case; the tensor cores' go to
// `got_out` when given. `some_rows_equal`: on the emulator some row equals the twin's bit for bit
// (not where k is split into ranges, which the CPU sums in one chain). `cublas`: cuBLAS's bf16 GEMM
// (--cuda_gemm cublas, bf16 weights) in place of relgen's tensor-core kernel: the same rounded
// operands and exact products, the sums in an order cuBLAS picks per shape (on the emulator, in
// float64 then rounded once).
template <typename Case, typename Run>
void ExpectTensorCoresMatchTheCpuTwin(const std::shared_ptr<const Model>& model, std::vector<Case> cases, int blocks,
                                      const std::string& what, Run run,
                                      std::vector<std::vector<float>>* got_out = nullptr, bool some_rows_equal = true,
                                      bool cublas = false) {
  CudaOptions o;
  o.num_blocks = blocks;
  o.weight_type = cpu::WeightType::kBf16;
  o.tensor_cores = !cublas;
  o.cublas_gemms = cublas;
  auto backend = NewCudaBackend(model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const KvCacheConfig kv{o.block_size, blocks};
  auto twin = NewCpuBackend(model, kv, 1, cpu::WeightType::kBf16, cpu::KvType::kF32, ProjectionInputs::kBf16);
  ASSERT_TRUE(twin.ok()) << twin.status();
  auto plain = NewCpuBackend(model, kv, 1, cpu::WeightType::kBf16, cpu::KvType::kF32);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const int vocab = model->config().vocab_size;
  int same_rows = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string name = what + " case " + std::to_string(i);
    const std::vector<float> got = run(**backend, cases[i], name), want = run(**twin, cases[i], name + " (twin)"),
                             unrounded = run(**plain, cases[i], name + " (float32 activations)");
    ASSERT_FALSE(got.empty()) << name;
    ASSERT_EQ(got.size(), want.size()) << name;
    ASSERT_EQ(got.size(), unrounded.size()) << name;
    const double rounding = WorstRowError(want, unrounded, vocab);
    EXPECT_GT(rounding, 0) << name << ": the activations' rounding in effect on the twin";
    EXPECT_GT(WorstRowError(got, unrounded, vocab), 0) << name << ": the activations' rounding in effect";
    EXPECT_LE(WorstRowError(got, want, vocab), rounding) << name << " vs the CPU twin";
    for (size_t r = 0; r < got.size() / vocab; ++r) {
      same_rows += std::memcmp(got.data() + r * vocab, want.data() + r * vocab, vocab * sizeof(float)) == 0;
    }
    if (got_out != nullptr) got_out->push_back(got);
  }
  // The emulator runs the float32 work before the first projections as the CPU does.
  if (kEmulated && some_rows_equal) EXPECT_GT(same_rows, 0) << what << ": no row equal to the twin's";
}

// The goldens on tensor cores, whole and token by token, and prefill equal to decode bit for bit
// (the tiles' rows are independent).
TEST_P(CudaParityTest, TensorCoresMatchTheCpuTwin) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  auto model = *Model::Load(dir);
  const Golden g = LoadGolden(dir, 17);
  std::vector<std::vector<float>> cuda_runs;
  ExpectTensorCoresMatchTheCpuTwin(
      model, std::vector<int>{17, 1}, 64, GetParam(),
      [&](Backend& b, int chunk, const std::string&) { return ForwardInChunks(b, g.tokens, chunk); }, &cuda_runs);
  ASSERT_EQ(cuda_runs.size(), 2u);
  EXPECT_EQ(std::memcmp(cuda_runs[0].data(), cuda_runs[1].data(), cuda_runs[0].size() * sizeof(float)), 0)
      << GetParam();
}

// cuBLAS's bf16 GEMM on the goldens, whole and token by token, against the same twin and bound. Its
// rows are not batch invariant on a GPU; on the emulator, whose GEMM sums every element in one
// order whatever the shape, prefill equals decode bit for bit.
TEST_P(CudaParityTest, CublasBf16MatchesTheCpuTwin) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  auto model = *Model::Load(dir);
  const Golden g = LoadGolden(dir, 17);
  std::vector<std::vector<float>> runs;
  ExpectTensorCoresMatchTheCpuTwin(
      model, std::vector<int>{17, 1}, 64, GetParam() + " (cublas bf16)",
      [&](Backend& b, int chunk, const std::string&) { return ForwardInChunks(b, g.tokens, chunk); }, &runs,
      /*some_rows_equal=*/false, /*cublas=*/true);
  ASSERT_EQ(runs.size(), 2u);
  ExpectSameLogits(runs[0].data(), runs[1].data(), 17, model->config().vocab_size, GetParam() + " prefill vs decode");
}

// A wider model (d 256, ffn 1024, head_dim 64), whose down projection splits k into two ranges
// (the workspace shared with attention), on tensor cores against the twin, whole and token by token.
TEST(CudaTensorCoresTest, RangesOfKMatchTheCpuTwin) {
  REQUIRE_GPU();
  auto model = *Model::Load(testing::GoldenDir() + "/engine/server");
  const ModelConfig& c = model->config();
  ASSERT_GT(cuda::LinearMmaSplits(c.ffn_dim, c.d_model, 1), 1) << "the case needs a split projection";
  std::vector<int32_t> tokens(kSanitized ? 5 : 12);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((37 * i + 11) % 256);
  std::vector<std::vector<float>> runs;
  ExpectTensorCoresMatchTheCpuTwin(
      model, std::vector<int>{static_cast<int>(tokens.size()), 1}, 64, "engine/server",
      [&](Backend& b, int chunk, const std::string&) { return ForwardInChunks(b, tokens, chunk); }, &runs,
      /*some_rows_equal=*/false);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)), 0);
}

// A checkpoint's cases with attention on tensor cores (bf16 cache) against the CPU twin with the
// same bf16 cache: at most 4x as far as that cache's own rounding moves the CPU's logits from the
// float32 cache's (q and the weights are rounded as K and V are: twice the cache's roundings, to
// first order, and a margin). Where the checkpoint's head size is one the kernel does not take, the
// float32 kernels run: the same bits as without the option. `run` gives a backend's logits for a case.
template <typename Case, typename Run>
void ExpectAttentionOnTensorCoresNearTheTwin(const std::shared_ptr<const Model>& model, const std::vector<Case>& cases,
                                             int blocks, const std::string& what, Run run) {
  auto cuda_backend = [&](bool mma) {
    CudaOptions o;
    o.num_blocks = blocks;
    o.kv_type = cpu::KvType::kBf16;
    o.attention_tensor_cores = mma;
    return NewCudaBackend(model, o);
  };
  auto mma = cuda_backend(true), simt = cuda_backend(false);
  ASSERT_TRUE(mma.ok() && simt.ok());
  const KvCacheConfig kv{16, blocks};
  auto cpu16 = NewCpuBackend(model, kv, 1, cpu::WeightType::kF32, cpu::KvType::kBf16);
  auto cpu32 = NewCpuBackend(model, kv, 1, cpu::WeightType::kF32, cpu::KvType::kF32);
  ASSERT_TRUE(cpu16.ok() && cpu32.ok());
  const bool taken = cuda::AttentionMmaSupported(
      cuda::KvPool{nullptr, nullptr, 16, model->config().n_heads, model->config().head_dim, cuda::KvElem::kBf16});
  const int vocab = model->config().vocab_size;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string name = what + " case " + std::to_string(i);
    const std::vector<float> got = run(**mma, cases[i], name);
    ASSERT_FALSE(got.empty()) << name;
    if (!taken) {
      const std::vector<float> simt_got = run(**simt, cases[i], name + " (float32 attention)");
      ASSERT_EQ(got.size(), simt_got.size()) << name;
      EXPECT_EQ(std::memcmp(got.data(), simt_got.data(), got.size() * sizeof(float)), 0) << name << ": the fallback";
      continue;
    }
    const std::vector<float> twin = run(**cpu16, cases[i], name + " (twin)");
    ASSERT_EQ(got.size(), twin.size()) << name;
    const double rounding = WorstRowError(twin, run(**cpu32, cases[i], name + " (float32 cache)"), vocab);
    ASSERT_GT(rounding, 0) << name;
    const double moved = WorstRowError(got, twin, vocab);
    EXPECT_GT(moved, 0) << name << ": the tensor-core kernel in effect";
    EXPECT_LE(moved, 4 * rounding) << name;
  }
}

// The backend with attention on tensor cores (--cuda_attention mma) and the bf16 cache: a prompt
// whole, token by token and in chunks of 5 gives the same logits bit for bit; and they stay near the
// CPU twin with the same cache, as ExpectAttentionOnTensorCoresNearTheTwin's bound says.
void ExpectAttentionOnTensorCores(const std::shared_ptr<const Model>& model, const std::vector<int32_t>& tokens,
                                  const std::string& what) {
  const int n = static_cast<int>(tokens.size()), vocab = model->config().vocab_size;
  auto logits = [&](bool mma, int chunk) {
    CudaOptions o;
    o.num_blocks = 64;
    o.kv_type = cpu::KvType::kBf16;
    o.attention_tensor_cores = mma;
    auto backend = NewCudaBackend(model, o);
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? ForwardInChunks(**backend, tokens, chunk) : std::vector<float>{};
  };
  const std::vector<float> whole = logits(true, n);
  ASSERT_EQ(whole.size(), size_t(n) * vocab) << what;
  if (!cuda::AttentionMmaSupported(cuda::KvPool{nullptr, nullptr, 16, model->config().n_heads,
                                                model->config().head_dim, cuda::KvElem::kBf16})) {
    // A head size the kernel does not take: the float32 kernels, the same bits.
    const std::vector<float> simt = logits(false, n);
    EXPECT_EQ(std::memcmp(whole.data(), simt.data(), whole.size() * sizeof(float)), 0) << what << ": the fallback";
    return;
  }
  for (const int chunk : {1, 5}) {
    const std::vector<float> got = logits(true, chunk);
    ASSERT_EQ(got.size(), whole.size());
    EXPECT_EQ(std::memcmp(got.data(), whole.data(), whole.size() * sizeof(float)), 0) << what << ", chunks of " << chunk;
  }
  const KvCacheConfig kv{16, 64};
  auto cpu16 = NewCpuBackend(model, kv, 1, cpu::WeightType::kF32, cpu::KvType::kBf16);
  auto cpu32 = NewCpuBackend(model, kv, 1, cpu::WeightType::kF32, cpu::KvType::kF32);
  ASSERT_TRUE(cpu16.ok() && cpu32.ok());
  const std::vector<float> twin = ForwardInChunks(**cpu16, tokens, n);
  const double cache_rounding = WorstRowError(twin, ForwardInChunks(**cpu32, tokens, n), vocab);
  ASSERT_GT(cache_rounding, 0) << what;
  const double moved = WorstRowError(whole, twin, vocab);
  EXPECT_GT(moved, 0) << what << ": the tensor-core kernel in effect";
  EXPECT_LE(moved, 4 * cache_rounding) << what;
}

// Every golden scheme (skew, local, Shaw with values, T5, none: head_dim 16; ALiBi's goldens, of
// head sizes the kernel does not take, fall back to the float32 kernels).
TEST_P(CudaParityTest, AttentionOnTensorCores) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  ExpectAttentionOnTensorCores(*Model::Load(dir), LoadGolden(dir, 17).tokens, GetParam());
}

// head_dim 64; and a float32 cache is refused, naming the way out.
TEST(CudaTensorCoresTest, AttentionOnTensorCoresPrefillEqualsDecode) {
  REQUIRE_GPU();
  auto model = *Model::Load(testing::GoldenDir() + "/engine/server");
  ASSERT_EQ(model->config().head_dim, 64);
  std::vector<int32_t> tokens(kSanitized ? 9 : 40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((53 * i + 7) % 256);
  ExpectAttentionOnTensorCores(model, tokens, "engine/server");
  CudaOptions f32;
  f32.num_blocks = 64;
  f32.attention_tensor_cores = true;
  const auto refused = NewCudaBackend(model, f32);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("--kv_cache_dtype bf16"), std::string::npos)
      << refused.status();
}

INSTANTIATE_TEST_SUITE_P(Golden, CudaParityTest, ::testing::ValuesIn(testing::GoldenCases()), [](const auto& i) { return i.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaParityTest);

// Hugging Face BLOOM and MPT checkpoints (embedding norm, fused QKV split at load, ALiBi slopes of
// any head count and bias max, biasless norms) on the CUDA backend: transformers' logits at every
// position and its greedy tokens.
class CudaHfTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaHfTest, MatchesTransformers) {
  REQUIRE_GPU();
  for (const auto& c : testing::HfCases()) {
    if (c["name"] != GetParam()) continue;
    auto model = Model::Load(c["dir"]);
    ASSERT_TRUE(model.ok()) << model.status();
    auto backend = NewCudaBackend(*model, KvCacheConfig{16, 64});
    ASSERT_TRUE(backend.ok()) << backend.status();
    std::vector<testing::HfPrompt> prompts = testing::ReadHfReference(c);
    // Under a sanitizer the emulator is slower: the three shortest prompts, 16 new tokens (past a KV block).
    if (kSanitized) prompts.resize(3);
    testing::ExpectBackendMatchesHf(**backend, prompts, (*model)->config().vocab_size, 1e-4, GetParam(),
                                    kSanitized ? 16 : 1 << 30);
  }
}

// The HF checkpoints on tensor cores: the first three prompts, prefill then decode.
TEST_P(CudaHfTest, TensorCoresMatchTheCpuTwin) {
  REQUIRE_GPU();
  bool found = false;
  for (const auto& c : testing::HfCases()) {
    if (c["name"] != GetParam()) continue;
    found = true;
    auto model = Model::Load(c["dir"]);
    ASSERT_TRUE(model.ok()) << model.status();
    const int max_new = kSanitized ? 8 : 24;
    std::vector<testing::HfPrompt> prompts = testing::ReadHfReference(c);
    prompts.resize(std::min<size_t>(prompts.size(), 3));
    ExpectTensorCoresMatchTheCpuTwin(*model, prompts, 64, GetParam(),
                                    [&](Backend& b, const testing::HfPrompt& p, const std::string& name) {
                                      return testing::TeacherForcedHf(b, p, max_new, name);
                                    });
  }
  EXPECT_TRUE(found) << GetParam();
}

// The HF checkpoints with attention on tensor cores: the first three prompts, prefill then decode.
TEST_P(CudaHfTest, AttentionOnTensorCores) {
  REQUIRE_GPU();
  bool found = false;
  for (const auto& c : testing::HfCases()) {
    if (c["name"] != GetParam()) continue;
    found = true;
    auto model = Model::Load(c["dir"]);
    ASSERT_TRUE(model.ok()) << model.status();
    const int max_new = kSanitized ? 8 : 24;
    std::vector<testing::HfPrompt> prompts = testing::ReadHfReference(c);
    prompts.resize(std::min<size_t>(prompts.size(), kSanitized ? 1 : 3));
    ExpectAttentionOnTensorCoresNearTheTwin(*model, prompts, 64, GetParam(),
                                            [&](Backend& b, const testing::HfPrompt& p, const std::string& name) {
                                              return testing::TeacherForcedHf(b, p, max_new, name);
                                            });
  }
  EXPECT_TRUE(found) << GetParam();
}

std::vector<std::string> HfCaseNames() {
  std::vector<std::string> names;
  for (const auto& c : testing::HfCases()) names.push_back(c["name"]);
  return names;
}
INSTANTIATE_TEST_SUITE_P(Hf, CudaHfTest, ::testing::ValuesIn(HfCaseNames()), [](const auto& i) {
  std::string n = i.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
});
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaHfTest);

// Hugging Face T5 / mT5 encoder-decoder checkpoints (tests/t5_reference.h) on the CUDA backend:
// the encoder (bidirectional attention, T5's signed buckets), cross-attention over the input's K/V in
// the paged pool, the lm_head input scale of tied T5. Transformers' logits at every decoder step and
// its greedy tokens; a decoder chunk (what a preempted sequence recomputes) equal to step by step;
// the inputs encoded together in one step, then decoded together, equal to each alone.
class CudaT5Test : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaT5Test, MatchesTransformers) {
  REQUIRE_GPU();
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] != GetParam()) continue;
    auto model = Model::Load(c["dir"]);
    ASSERT_TRUE(model.ok()) << model.status();
    const ModelConfig& mc = (*model)->config();
    std::vector<testing::T5Input> inputs = testing::ReadT5Reference(c);
    ASSERT_GE(inputs.size(), 3u);
    // Emulated, where the encoder's attention dominates: the inputs of 1, 7 and 64 tokens (64
    // spans KV blocks and passes t5-v1_1's max_distance of 40; CudaKernelsTest covers the signed
    // buckets beyond it on both sides), all new tokens, or under a sanitizer 16 (past a KV block).
    int max_new = 1 << 30;
    if (kEmulated) {
      inputs.resize(std::min<size_t>(inputs.size(), 3));
      if (kSanitized) max_new = 16;
    }
    const int vocab = mc.vocab_size, start = mc.decoder_start_token_id;
    auto stepwise_backend = NewCudaBackend(*model, KvCacheConfig{16, 128});
    ASSERT_TRUE(stepwise_backend.ok()) << stepwise_backend.status();
    const std::vector<float> stepwise =
        testing::ExpectBackendMatchesT5(**stepwise_backend, inputs, vocab, start, 1e-4, GetParam(), false, max_new);
    auto chunked_backend = NewCudaBackend(*model, KvCacheConfig{16, 128});
    ASSERT_TRUE(chunked_backend.ok()) << chunked_backend.status();
    const std::vector<float> chunked = testing::ExpectBackendMatchesT5(**chunked_backend, inputs, vocab, start, 1e-4,
                                                                       GetParam() + " chunked", true, max_new);
    ASSERT_FALSE(stepwise.empty());
    ASSERT_EQ(chunked.size(), stepwise.size());
    const int rows = static_cast<int>(stepwise.size() / vocab);
    ExpectSameLogits(chunked.data(), stepwise.data(), rows, vocab, GetParam() + ": chunked vs stepwise");

    // Every input encoded in one step (rows of different inputs in one launch, each seeing only its
    // own), then one decode step for all: each sequence's rows as alone.
    const int n = static_cast<int>(inputs.size()), per_input = rows / n, bs = 16;
    std::vector<std::vector<int32_t>> dec(n), self(n), cross(n);
    std::vector<SequenceStep> batch(n);
    int next_block = (*stepwise_backend)->Describe().kv_cache.num_blocks - 1;
    for (int i = 0; i < n; ++i) {
      dec[i] = {start, inputs[i].greedy[0]};
      self[i] = {next_block--};
      const int len = static_cast<int>(inputs[i].input.size());
      for (int b = 0; b * bs < len; ++b) cross[i].push_back(next_block--);
      ASSERT_GE(next_block, 0);
      batch[i].tokens = absl::MakeConstSpan(dec[i]).subspan(0, 1);
      batch[i].block_table = self[i];
      batch[i].encoder_tokens = inputs[i].input;
      batch[i].encoder_len = len;
      batch[i].cross_block_table = cross[i];
    }
    std::vector<float> first, second;
    ASSERT_TRUE(ForwardLogits(**stepwise_backend, batch, &first).ok());
    for (int i = 0; i < n; ++i) {
      batch[i].tokens = absl::MakeConstSpan(dec[i]).subspan(1, 1);
      batch[i].start_pos = 1;
      batch[i].encoder_tokens = {};
    }
    ASSERT_TRUE(ForwardLogits(**stepwise_backend, batch, &second).ok());
    ASSERT_EQ(first.size(), size_t{static_cast<size_t>(n)} * vocab);
    ASSERT_EQ(second.size(), first.size());
    for (int i = 0; i < n; ++i) {
      const float* alone = stepwise.data() + int64_t{i} * per_input * vocab;
      const std::string what = GetParam() + " batched, input " + std::to_string(i);
      ExpectSameLogits(first.data() + int64_t{i} * vocab, alone, 1, vocab, what + " step 0");
      ExpectSameLogits(second.data() + int64_t{i} * vocab, alone + vocab, 1, vocab, what + " step 1");
    }
  }
}

// T5 on tensor cores (the encoder's, decoder's and cross-attention's projections, the LM head):
// the first three inputs, encoded, then decoded token by token.
// The T5 checkpoints with attention on tensor cores: the decoder's self- and cross-attention over
// the bf16 cache (the encoder's own float32 K/V keep the float32 kernel).
TEST_P(CudaT5Test, AttentionOnTensorCores) {
  REQUIRE_GPU();
  bool found = false;
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] != GetParam()) continue;
    found = true;
    auto model = Model::Load(c["dir"]);
    ASSERT_TRUE(model.ok()) << model.status();
    const int start = (*model)->config().decoder_start_token_id, max_new = kSanitized ? 8 : 24;
    std::vector<testing::T5Input> inputs = testing::ReadT5Reference(c);
    inputs.resize(std::min<size_t>(inputs.size(), kSanitized ? 1 : 3));
    ExpectAttentionOnTensorCoresNearTheTwin(*model, inputs, 128, GetParam(),
                                            [&](Backend& b, const testing::T5Input& p, const std::string& name) {
                                              return testing::TeacherForcedT5(b, p, start, false, max_new, name);
                                            });
  }
  EXPECT_TRUE(found) << GetParam();
}

TEST_P(CudaT5Test, TensorCoresMatchTheCpuTwin) {
  REQUIRE_GPU();
  bool found = false;
  for (const auto& c : testing::T5Cases()) {
    if (c["name"] != GetParam()) continue;
    found = true;
    auto model = Model::Load(c["dir"]);
    ASSERT_TRUE(model.ok()) << model.status();
    const int start = (*model)->config().decoder_start_token_id, max_new = kSanitized ? 8 : 24;
    std::vector<testing::T5Input> inputs = testing::ReadT5Reference(c);
    inputs.resize(std::min<size_t>(inputs.size(), 3));
    ExpectTensorCoresMatchTheCpuTwin(*model, inputs, 128, GetParam(),
                                    [&](Backend& b, const testing::T5Input& p, const std::string& name) {
                                      return testing::TeacherForcedT5(b, p, start, false, max_new, name);
                                    });
  }
  EXPECT_TRUE(found) << GetParam();
}

std::vector<std::string> T5CaseNames() {
  std::vector<std::string> names;
  for (const auto& c : testing::T5Cases()) names.push_back(c["name"]);
  return names;
}
INSTANTIATE_TEST_SUITE_P(T5, CudaT5Test, ::testing::ValuesIn(T5CaseNames()), [](const auto& i) {
  std::string n = i.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
});
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaT5Test);

// Batched output == single-request output on the GPU engine (greedy, and seeded draws with the
// sampling controls): float32, a bf16 cache, and bf16 weights on tensor cores.
class CudaEngineKvTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaEngineKvTest, BatchedEqualsAlone) {
  REQUIRE_GPU();
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  CudaOptions o;
  o.num_blocks = 512;
  if (GetParam() == "bf16") o.kv_type = cpu::KvType::kBf16;
  if (GetParam() == "mma") {
    o.weight_type = cpu::WeightType::kBf16;
    o.tensor_cores = true;
  }
  if (GetParam() == "mma_attention") {  // the bf16 cache read on tensor cores as well
    o.kv_type = cpu::KvType::kBf16;
    o.weight_type = cpu::WeightType::kBf16;
    o.tensor_cores = true;
    o.attention_tensor_cores = true;
  }
  auto make = [&] { return *Engine::Create(model, *NewCudaBackend(model, o), NewByteTokenizer(), EngineConfig{}); };
  std::vector<Request> work;
  const int requests = kEmulated ? (kSanitized ? 3 : 6) : 16, max_prompt = kEmulated ? 60 : 200,
            new_tokens = kEmulated ? 6 : 20;
  for (int i = 0; i < requests; ++i) {
    Request r;
    for (int t = 0; t < 1 + (i * 37) % max_prompt; ++t) r.prompt.push_back((i * 7 + t) % 256);
    r.stop.max_new_tokens = new_tokens + i;
    r.stop.ignore_eos = true;
    r.sampling.temperature = 0;
    if (i % 2 == 1) {  // seeded draws with the sampling controls, each request its own mix
      r.sampling.temperature = 0.9f;
      r.sampling.seed = 40 + i;
      r.sampling.presence_penalty = 0.6f;
      r.sampling.frequency_penalty = i % 4 == 1 ? 0.4f : 0.0f;
      r.sampling.logit_bias = {{65, 2.0f}, {r.prompt.back(), -3.0f}};
      r.sampling.bad_words = {{r.prompt.back(), 66}, {90}};
      r.sampling.min_p = 0.02f;
      r.sampling.min_tokens = 3;
      r.sampling.no_repeat_ngram_size = i % 4 == 3 ? 2 : 0;
      r.stop.stop_token_ids = {67};
    }
    work.push_back(r);
  }
  auto drain = [](RequestHandle& h) {
    std::vector<int32_t> out;
    Output o;
    while (h.Next(&o)) out.insert(out.end(), o.token_ids.begin(), o.token_ids.end());
    return out;
  };
  auto alone_engine = make();
  std::vector<std::vector<int32_t>> alone;
  for (const Request& r : work) alone.push_back(drain(**alone_engine->Submit(r)));
  auto batch_engine = make();
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (const Request& r : work) hs.push_back(*batch_engine->Submit(r));
  for (size_t i = 0; i < hs.size(); ++i) EXPECT_EQ(drain(*hs[i]), alone[i]) << "request " << i;
}
// A draw whose controls ban every token (only 'A' allowed, 'A' 'A' a bad word) ends its sequence
// after 'A', reason stop; the step launched ahead of it, fed the moot token, harms no one beside it.
TEST(CudaEngineTest, BanningEveryTokenEndsOnlyThatSequence) {
  REQUIRE_GPU();
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  CudaOptions o;
  o.num_blocks = 64;
  auto make = [&] { return *Engine::Create(model, *NewCudaBackend(model, o), NewByteTokenizer(), EngineConfig{}); };
  Request banned;
  banned.prompt = {'x', 'y', 'B'};
  banned.stop.max_new_tokens = 8;
  banned.stop.ignore_eos = true;
  banned.sampling.temperature = 0.7f;
  banned.sampling.allowed_token_ids = {'A'};
  banned.sampling.bad_words = {{'A', 'A'}};
  Request other;
  other.prompt = {'h', 'e', 'l', 'l', 'o'};
  other.stop.max_new_tokens = 6;
  other.stop.ignore_eos = true;
  other.sampling.temperature = 0;
  auto drain = [](RequestHandle& h) {
    std::pair<std::vector<int32_t>, FinishReason> out;
    Output o;
    while (h.Next(&o)) {
      out.first.insert(out.first.end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) out.second = o.finish_reason;
    }
    return out;
  };
  const auto alone = drain(**make()->Submit(other));
  auto engine = make();
  auto a = *engine->Submit(banned);
  auto b = *engine->Submit(other);
  const auto got = drain(*a);
  EXPECT_EQ(got.first, std::vector<int32_t>{'A'});
  EXPECT_EQ(got.second, FinishReason::kStop);
  EXPECT_EQ(drain(*b), alone);
  EXPECT_EQ(alone.second, FinishReason::kLength);
  EXPECT_EQ(engine->Stats().kv_blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Cache, CudaEngineKvTest, ::testing::Values("f32", "bf16", "mma", "mma_attention"),
                         [](const auto& i) { return i.param; });

// T5 through the engine on the GPU backend, its loop driven here: requests admitted while others
// decode (steps that encode some inputs and decode other sequences), an input longer than the step
// budget (encoded in a step of its own); each request's greedy tokens and log-probabilities as it
// alone produces them, and no self or cross block left after.
TEST(CudaEngineTest, T5AdmittedWhileOthersDecodeEqualsAlone) {
  REQUIRE_GPU();
  nlohmann::json c;
  for (const auto& t : testing::T5Cases()) {
    if (t["name"] == "t5-v1_1") c = t;
  }
  if (c.is_null()) GTEST_SKIP() << "no T5 fixture (RELGEN_T5_CASES_DIR)";
  auto model = Model::Load(c["dir"]);
  ASSERT_TRUE(model.ok()) << model.status();
  auto make = [&] {
    EngineConfig config;
    config.background_thread = false;
    config.scheduler.max_batch_tokens = 48;
    auto tokenizer = NewTokenizer((*model)->config(), (*model)->dir());
    EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
    auto e = Engine::Create(*model, *NewCudaBackend(*model, KvCacheConfig{16, 64}), *std::move(tokenizer), config);
    EXPECT_TRUE(e.ok()) << e.status();
    return *std::move(e);
  };
  const std::vector<int> lengths = kSanitized ? std::vector<int>{1, 60, 7, 12} : std::vector<int>{1, 60, 7, 23, 3, 12};
  std::vector<Request> work;
  for (size_t i = 0; i < lengths.size(); ++i) {
    Request r;
    for (int t = 0; t < lengths[i]; ++t) r.prompt.push_back(3 + static_cast<int>((i * 131 + t * 37) % 400));
    r.sampling.temperature = 0;
    r.sampling.logprobs = 0;
    r.stop.max_new_tokens = 5 + static_cast<int>(i);
    r.stop.ignore_eos = true;
    work.push_back(r);
  }
  // Submits work[i] before step i (the rest at once after), steps until all finish.
  auto run = [](Engine& e, const std::vector<Request>& reqs) {
    std::vector<std::shared_ptr<RequestHandle>> hs;
    std::vector<Output> out(reqs.size());
    std::vector<bool> done(reqs.size());
    for (size_t finished = 0, step = 0; finished < reqs.size(); ++step) {
      if (step < reqs.size()) hs.push_back(*e.Submit(reqs[step]));
      e.RunOnce();
      for (size_t i = 0; i < hs.size(); ++i) {
        Output o;
        while (!done[i] && hs[i]->Next(&o, absl::ZeroDuration())) {
          out[i].token_ids.insert(out[i].token_ids.end(), o.token_ids.begin(), o.token_ids.end());
          out[i].logprobs.insert(out[i].logprobs.end(), o.logprobs.begin(), o.logprobs.end());
          if (o.finished) {
            EXPECT_TRUE(o.status.ok()) << o.status;
            done[i] = true;
            ++finished;
          }
        }
      }
      if (step > 1000) {
        ADD_FAILURE() << "requests did not finish";
        break;
      }
    }
    return out;
  };
  auto together_engine = make();
  const std::vector<Output> together = run(*together_engine, work);
  EXPECT_EQ(together_engine->Stats().kv_blocks_used, 0) << "self or cross blocks left after finish";
  for (size_t i = 0; i < work.size(); ++i) {
    auto alone_engine = make();
    const Output alone = run(*alone_engine, {work[i]})[0];
    EXPECT_EQ(together[i].token_ids, alone.token_ids) << "request " << i;
    ASSERT_EQ(together[i].logprobs.size(), alone.logprobs.size()) << "request " << i;
    ASSERT_EQ(static_cast<int>(alone.logprobs.size()), work[i].stop.max_new_tokens) << "request " << i;
    for (size_t t = 0; t < alone.logprobs.size(); ++t) {
      // Bitwise on the emulator; on a GPU cuBLAS may sum another step shape in another order.
      if (kEmulated) {
        EXPECT_EQ(together[i].logprobs[t].logprob, alone.logprobs[t].logprob) << "request " << i << " token " << t;
      } else {
        EXPECT_NEAR(together[i].logprobs[t].logprob, alone.logprobs[t].logprob, 1e-4) << "request " << i;
      }
    }
  }
}

// The device evaluates the shared index functions as the host does (relpos_device.cu).
TEST(CudaRelposTest, DeviceMatchesHost) {
  REQUIRE_GPU();
  const int n = kEmulated ? 40 : 70;
  const std::vector<int32_t> t5 = relpos::T5BucketTable(32, 128, false);
  struct Case {
    relpos::Scheme scheme;
    int param, block;
  };
  for (const Case& c : {Case{relpos::Scheme::kSkew, 20, 0}, Case{relpos::Scheme::kSkewLocal, 40, 16},
                        Case{relpos::Scheme::kShaw, 5, 0}, Case{relpos::Scheme::kT5, 0, 0},
                        Case{relpos::Scheme::kAlibi, 0, 0}}) {
    std::vector<int32_t> got(n * n, -7);
    ASSERT_EQ(cuda::RelIndices(c.scheme, c.param, c.block, n, t5.data(), static_cast<int>(t5.size()), got.data()),
              cudaSuccess);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        int want = -2;
        if (j <= i && j >= relpos::WindowStart(c.scheme, i, c.block)) {
          if (c.scheme == relpos::Scheme::kShaw) {
            want = relpos::ShawRow(i, j, c.param);
          } else if (c.scheme == relpos::Scheme::kT5) {
            want = relpos::T5Bucket(j - i, 32, 128, false);
          } else if (c.scheme == relpos::Scheme::kAlibi) {
            want = i - j;
          } else {
            want = relpos::SkewRow(i - j, c.param);
          }
        }
        ASSERT_EQ(got[i * n + j], want) << i << "," << j;
      }
    }
  }
}

// The row kernels (block reductions through shared memory and warp shuffles, elementwise ones)
// against their CPU twins, with a width that is not a multiple of the block.
// cuda::WriteKv lays the paged pool out as cpu::KvView documents ([num_blocks, n_heads, block_size,
// head_dim] through a shuffled block table), element for element: the attention kernel reads through
// the same page walk, so only the layout itself shows a slot shifted inside a page.
TEST(CudaKernelsTest, WriteKvMatchesTheCpuPoolLayout) {
  REQUIRE_GPU();
  const int heads = 2, hd = 8, width = heads * hd, len = 23, bs = 5, nblocks = (len + bs - 1) / bs + 2;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t{len} * width), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  k[0] = 1.0f + 1.0f / 256;  // bf16 ties: rounds down to even (1.0),
  k[1] = 1.0f + 3.0f / 256;  // and up to even (1 + 2^-6)
  v[2] = std::numeric_limits<float>::quiet_NaN();
  std::vector<int32_t> table(nblocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const size_t pool = size_t{static_cast<size_t>(nblocks)} * heads * bs * hd;
  std::vector<float> kwant(pool, NAN), vwant(pool, NAN);
  cpu::KvView view{kwant.data(), vwant.data(), table.data(), bs, heads, hd};
  cpu::WriteKv(view, k.data(), v.data(), 0, len);

  std::vector<int32_t> position(len), offset(len, 0);
  std::iota(position.begin(), position.end(), 0);
  cuda::Rows r{len, Upload(position), Upload(offset), Upload(table)};
  cuda::KvPool p{Upload(std::vector<float>(pool, NAN)), Upload(std::vector<float>(pool, NAN)), bs, heads, hd};
  ASSERT_EQ(cuda::WriteKv(p, r, Upload(k), Upload(v), nullptr), cudaSuccess);
  std::vector<float> kgot(pool), vgot(pool);
  ASSERT_EQ(cudaMemcpy(kgot.data(), p.k, pool * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(vgot.data(), p.v, pool * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < pool; ++i) {
    ASSERT_TRUE(std::isnan(kwant[i]) ? std::isnan(kgot[i]) : kgot[i] == kwant[i]) << "K pool element " << i;
    ASSERT_TRUE(std::isnan(vwant[i]) ? std::isnan(vgot[i]) : vgot[i] == vwant[i]) << "V pool element " << i;
  }
  for (void* d : {p.k, p.v}) cudaFree(d);

  // A bf16 pool: the same slots, each element rounded to nearest even (testing::Bf16Value, an
  // independent rule), bit for bit what the CPU's bf16 cache stores; untouched slots keep their
  // poison. The data has two ties and a NaN.
  std::vector<uint16_t> k16(pool, 0xffff), v16(pool, 0xffff);
  cpu::KvView view16{k16.data(), v16.data(), table.data(), bs, heads, hd, cpu::KvType::kBf16};
  cpu::WriteKv(view16, k.data(), v.data(), 0, len);
  cuda::KvPool p16{Upload(std::vector<uint16_t>(pool, 0xffff)), Upload(std::vector<uint16_t>(pool, 0xffff)), bs, heads,
                   hd, cuda::KvElem::kBf16};
  ASSERT_EQ(cuda::WriteKv(p16, r, Upload(k), Upload(v), nullptr), cudaSuccess);
  std::vector<uint16_t> kgot16(pool), vgot16(pool);
  ASSERT_EQ(cudaMemcpy(kgot16.data(), p16.k, pool * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(vgot16.data(), p16.v, pool * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(kgot16, k16);
  EXPECT_EQ(vgot16, v16);
  auto value = [](uint16_t h) {
    const uint32_t u = uint32_t{h} << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  int nan_values = 0;
  for (size_t i = 0; i < pool; ++i) {
    const bool written = !std::isnan(kwant[i]);
    ASSERT_EQ(written, kgot16[i] != 0xffff) << "K slot " << i;
    if (written) ASSERT_EQ(double(value(kgot16[i])), testing::Bf16Value(kwant[i])) << "K slot " << i;
    if (!written) {
      ASSERT_EQ(vgot16[i], 0xffff) << "V slot " << i;
    } else if (std::isnan(vwant[i])) {
      ++nan_values;
      ASSERT_TRUE(std::isnan(value(vgot16[i]))) << "V slot " << i;
    } else {
      ASSERT_EQ(double(value(vgot16[i])), testing::Bf16Value(vwant[i])) << "V slot " << i;
    }
  }
  EXPECT_EQ(nan_values, 1);
  const int64_t first = cpu::KvView{nullptr, nullptr, table.data(), bs, heads, hd}.RowOffset(0, 0);
  EXPECT_EQ(value(kgot16[first]), 1.0f);
  EXPECT_EQ(value(kgot16[first + 1]), 1.0f + 1.0f / 64);
  for (void* d : {p16.k, p16.v}) cudaFree(d);
}

// Three products in one launch (a fused QKV, `linear` with batch 3 into dy3, ystride apart) each
// equal their own launch, bit for bit, and none writes past its rows. Returns the fused output.
template <typename TW, typename LinearFn>
std::vector<float> ExpectFusedEqualsThreeLaunches(LinearFn linear, const float* dx, const TW* dw, const float* db,
                                                  int rows, int in, int out, float* dy3, int64_t ystride) {
  EXPECT_EQ(linear(dx, rows, in, dw, out, db, -1, false, 1.f, dy3, nullptr, 3, int64_t{out} * in, out, ystride),
            cudaSuccess);
  std::vector<float> three(size_t(3 * ystride)), one(size_t(rows) * out);
  EXPECT_EQ(cudaMemcpy(three.data(), dy3, three.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  float* dy1 = Upload(one);
  for (int z = 0; z < 3; ++z) {
    EXPECT_EQ(linear(dx, rows, in, dw + size_t(z) * out * in, out, db + z * out, -1, false, 1.f, dy1, nullptr, 1, 0, 0, 0),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(one.data(), dy1, one.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(one.data(), three.data() + z * ystride, one.size() * sizeof(float)), 0) << "product " << z;
    EXPECT_TRUE(std::all_of(one.begin(), one.end(), [](float v) { return std::isfinite(v); }))
        << "product " << z << " read past its inputs";
    EXPECT_TRUE(std::isnan(three[z * ystride + size_t(rows) * out])) << "product " << z << " wrote past its rows";
  }
  cudaFree(dy1);
  return three;
}

// cuda::Linear, the projections' kernel: every row's bits are the same whether it runs alone, in a
// batch, or at another place in one (other rows per pass, per block); the values match a float64
// product within float32 rounding; bias, activation, residual and alpha in the epilogue; three
// products in one launch equal three launches. In-widths with 16-byte rows (64, 200: a lane's last
// piece partly past the row's end) and without (7).
TEST(CudaKernelsTest, LinearRowsAreBatchInvariant) {
  REQUIRE_GPU();
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  const int rows = 40, out = 37;  // 3 blocks of rows, a last warp with one output
  // On OS threads (the race check) one width and two epilogues. 2196: a lane's 18 pieces of k
  // come in rounds of 8 (one row) and of 2 (several), with a short last round for both.
  for (const int in : OnThreads() ? std::vector<int>{64} : std::vector<int>{64, 200, 7, 2196}) {
    SCOPED_TRACE("in " + std::to_string(in));
    std::vector<float> x(size_t(rows) * in), w(size_t(3) * out * in), bias(3 * out), y0(size_t(rows) * out);
    for (auto* v : {&x, &w, &bias, &y0}) {
      for (float& e : *v) e = nd(rng);
    }
    float *dx = Upload(x), *dw = Upload(w), *db = Upload(bias);
    struct Epilogue {
      const float* bias;
      int act;
      bool residual;
      float alpha;
    };
    std::vector<Epilogue> epilogues = {Epilogue{db, -1, true, 1.f}, Epilogue{db, 1, false, 1.f}};
    if (!OnThreads()) {
      epilogues.insert(epilogues.end(), {Epilogue{nullptr, -1, false, 1.f}, Epilogue{db, 3, false, 1.f},
                                         Epilogue{nullptr, -1, false, 0.125f}});
    }
    for (const Epilogue& e : epilogues) {
      SCOPED_TRACE("act " + std::to_string(e.act) + (e.residual ? " residual" : "") + (e.bias ? " bias" : ""));
      // Rows [first, first + n) as one launch, y starting from y0's rows.
      auto run = [&](int first, int n) {
        float* dy = Upload(std::vector<float>(y0.begin() + size_t(first) * out, y0.begin() + size_t(first + n) * out));
        EXPECT_EQ(cuda::Linear(dx + size_t(first) * in, n, in, dw, out, e.bias, e.act, e.residual, e.alpha, dy, nullptr),
                  cudaSuccess);
        std::vector<float> h(size_t(n) * out);
        EXPECT_EQ(cudaMemcpy(h.data(), dy, h.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(dy);
        return h;
      };
      const std::vector<float> all = run(0, rows);
      for (int r = 0; r < rows; ++r) {
        for (int o = 0; o < out; ++o) {
          double sum = 0, mag = 0;
          for (int k = 0; k < in; ++k) {
            sum += double(x[size_t(r) * in + k]) * w[size_t(o) * in + k];
            mag += std::abs(double(x[size_t(r) * in + k]) * w[size_t(o) * in + k]);
          }
          double want = e.alpha * sum + (e.bias != nullptr ? bias[o] : 0.0);
          if (e.act == 1) want = 0.5 * want * (1 + std::erf(want / std::sqrt(2.0)));
          if (e.act == 3) want = want / (1 + std::exp(-want));
          if (e.residual) want += y0[size_t(r) * out + o];
          // Summation error of float32 at most about in * 2^-24 of the terms' magnitudes.
          const double tol = (in + 16) * 6e-8 * (1 + mag + std::abs(y0[size_t(r) * out + o]));
          ASSERT_NEAR(all[size_t(r) * out + o], want, tol) << "row " << r << ", output " << o;
        }
      }
      for (const auto [first, n] : {std::pair{0, 1}, std::pair{5, 1}, std::pair{39, 1}, std::pair{3, 17}, std::pair{1, 38}}) {
        const std::vector<float> part = run(first, n);
        ASSERT_EQ(std::memcmp(part.data(), all.data() + size_t(first) * out, part.size() * sizeof(float)), 0)
            << "rows " << first << ".." << first + n - 1 << " alone differ from the same rows in the batch of " << rows;
      }
    }
    // Three products in one launch (a fused QKV): each equals its own launch, bit for bit.
    const int64_t ystride = int64_t{rows} * out + 5;
    float* dy3 = Upload(std::vector<float>(size_t(3 * ystride), NAN));
    const std::vector<float> three = ExpectFusedEqualsThreeLaunches(
        [](auto... a) { return cuda::Linear(a...); }, dx, dw, db, rows, in, out, dy3, ystride);
    // bf16 weights (bits rounded here by testing::Bf16Value's rule): the float32 kernel's sums over
    // the widened weights, bit for bit, fused and alone.
    std::vector<uint16_t> w16(w.size());
    std::vector<float> widened(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      widened[i] = static_cast<float>(testing::Bf16Value(w[i]));
      uint32_t bits;
      std::memcpy(&bits, &widened[i], sizeof(bits));
      ASSERT_EQ(bits & 0xffffu, 0u);
      w16[i] = static_cast<uint16_t>(bits >> 16);
    }
    uint16_t* dw16 = Upload(w16);
    float* dwide = Upload(widened);
    std::vector<float> narrow(three.size()), wide(three.size()), unrounded(three.size());
    for (auto [weights, host] : {std::pair{0, &narrow}, std::pair{1, &wide}, std::pair{2, &unrounded}}) {
      ASSERT_EQ(cudaMemset(dy3, 0, three.size() * sizeof(float)), cudaSuccess);
      const int64_t ws = int64_t{out} * in;
      const cudaError_t e =
          weights == 0 ? cuda::Linear(dx, rows, in, dw16, out, db, 1, true, 1.f, dy3, nullptr, 3, ws, out, ystride)
                       : cuda::Linear(dx, rows, in, weights == 1 ? dwide : dw, out, db, 1, true, 1.f, dy3, nullptr, 3,
                                      ws, out, ystride);
      ASSERT_EQ(e, cudaSuccess);
      ASSERT_EQ(cudaMemcpy(host->data(), dy3, three.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    ASSERT_EQ(std::memcmp(narrow.data(), wide.data(), narrow.size() * sizeof(float)), 0) << "bf16 weights";
    ASSERT_NE(std::memcmp(narrow.data(), unrounded.data(), narrow.size() * sizeof(float)), 0) << "rounding in effect";
    for (void* d : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(db), static_cast<void*>(dy3),
                    static_cast<void*>(dw16), static_cast<void*>(dwide)}) {
      cudaFree(d);
    }
  }
}

// cuda::LinearMma, the tensor-core projection with bf16 weights: values within the derived bound
// of float64 (against x rounded to bf16: float accumulation only; against x itself: plus 2^-8 of
// the terms' magnitudes); on the emulator, bit for bit the documented order (k in steps of 16,
// fmaf within); every row's bits the same alone, in any batch and at any place in one (1..260
// rows: 32-row tiles below 64 rows, 64-row tiles from there); nothing written past the rows; the
// epilogue as Linear's; three products in one launch equal three launches. In-widths that are and
// are not multiples of 16.
TEST(CudaKernelsTest, LinearMmaRowsAreBatchInvariantAndWithinTheBf16Bound) {
  REQUIRE_GPU();
  std::mt19937 rng(29);
  std::normal_distribution<float> nd;
  const int rows = OnThreads() ? 70 : 260, out = 37;  // 9 tiles of 32 rows (the last of 4) or 5 of 64, 2 of outputs
  auto bf16 = [](float f) { return static_cast<float>(testing::Bf16Value(f)); };
  // Widths: whole 64-deep stages (64), whole ones then a part (200, 120: 56 left, 8 short of a
  // stage), less than one (7, 48), four ranges of k (1100: 320, 320, 320 and 140, each ending in a
  // part stage).
  for (const int in : OnThreads() ? std::vector<int>{40} : std::vector<int>{64, 200, 7, 48, 120, 1100}) {
    SCOPED_TRACE("in " + std::to_string(in));
    std::vector<float> x(size_t(rows) * in), w(size_t(3) * out * in), bias(3 * out), y0(size_t(rows) * out);
    for (auto* v : {&x, &w, &bias, &y0}) {
      for (float& e : *v) e = nd(rng);
    }
    std::vector<uint16_t> w16(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      w16[i] = cpu::ToBf16(w[i]);
      w[i] = bf16(w[i]);  // the weights as stored
    }
    // A row of NaN past x and past the weights: a read beyond `in` (the other operand's zero times
    // NaN) turns an output NaN.
    std::vector<float> x_guarded = x;
    x_guarded.resize(x.size() + in, NAN);
    std::vector<uint16_t> w_guarded = w16;
    w_guarded.resize(w16.size() + in, cpu::ToBf16(NAN));
    float *dx = Upload(x_guarded), *db = Upload(bias);
    uint16_t* dw = Upload(w_guarded);
    // The ranges of k: their count is the shape's, whatever the rows (the fused launch's too).
    const int splits = cuda::LinearMmaSplits(in, out, 1);
    EXPECT_EQ(splits, in == 1100 ? 4 : 1);
    EXPECT_EQ(cuda::LinearMmaSplits(in, out, 3), splits);
    const int range = ((in + splits - 1) / splits + 63) / 64 * 64;
    float* dws = Upload(std::vector<float>(std::max<int64_t>(1, cuda::LinearMmaWorkspace(rows, in, out, 3)), NAN));
    // The tiles' tickets: zero to start with, and zero again after every launch (the next one, and
    // a graph's replay, count from there).
    const int64_t tickets = cuda::LinearMmaTickets(rows, in, out, 3);
    EXPECT_EQ(tickets, splits > 1 ? int64_t{(rows + 31) / 32} * ((out + 31) / 32) * 3 : 0);
    unsigned* dtk = Upload(std::vector<unsigned>(std::max<int64_t>(1, tickets), 0u));
    auto expect_tickets_zero = [&] {
      std::vector<unsigned> h(std::max<int64_t>(1, tickets));
      ASSERT_EQ(cudaMemcpy(h.data(), dtk, h.size() * sizeof(unsigned), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(std::count(h.begin(), h.end(), 0u), static_cast<int64_t>(h.size())) << "a ticket left counted";
    };
    struct Epilogue {
      const float* bias;
      int act;
      bool residual;
      float alpha;
    };
    std::vector<Epilogue> epilogues = {Epilogue{nullptr, -1, false, 1.f}, Epilogue{db, 1, true, 1.f}};
    if (!OnThreads()) epilogues.insert(epilogues.end(), {Epilogue{db, 3, false, 1.f}, Epilogue{db, -1, false, 0.125f}});
    for (const Epilogue& e : epilogues) {
      SCOPED_TRACE("act " + std::to_string(e.act) + (e.residual ? " residual" : "") + (e.bias ? " bias" : ""));
      // Rows [first, first + n) as one launch, y from y0's rows, then a row and 8 more of NaN guards.
      const int guards = out + 8;
      auto run = [&](int first, int n) {
        std::vector<float> init(y0.begin() + size_t(first) * out, y0.begin() + size_t(first + n) * out);
        init.resize(init.size() + guards, NAN);
        float* dy = Upload(init);
        EXPECT_EQ(cuda::LinearMma(dx + size_t(first) * in, n, in, dw, out, e.bias, e.act, e.residual, e.alpha, dy, nullptr,
                                  1, 0, 0, 0, dws, dtk),
                  cudaSuccess);
        expect_tickets_zero();
        std::vector<float> h(init.size());
        EXPECT_EQ(cudaMemcpy(h.data(), dy, h.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(dy);
        for (int g = 0; g < guards; ++g) EXPECT_TRUE(std::isnan(h[size_t(n) * out + g])) << "written past the rows";
        h.resize(size_t(n) * out);
        return h;
      };
      const std::vector<float> all = run(0, rows);
      for (int r = 0; r < rows; ++r) {
        for (int o = 0; o < out; ++o) {
          double rounded = 0, exact = 0, mag = 0;
          // The emulator's order: within each range k ascending, one fmaf each; the ranges added in order.
          float ordered = 0.f, in_range = 0.f;
          for (int k = 0; k < in; ++k) {
            const float xk = x[size_t(r) * in + k], wk = w[size_t(o) * in + k];
            rounded += double(bf16(xk)) * wk;
            exact += double(xk) * wk;
            mag += std::abs(double(xk) * wk);
            in_range = std::fmaf(bf16(xk), wk, in_range);
            if ((k + 1) % range == 0 || k + 1 == in) {
              ordered = k < range ? in_range : ordered + in_range;
              in_range = 0.f;
            }
          }
          auto epilogue = [&](double sum) {
            double v = e.alpha * sum + (e.bias != nullptr ? bias[o] : 0.0);
            if (e.act == 1) v = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
            if (e.act == 3) v = v / (1 + std::exp(-v));
            return e.residual ? v + y0[size_t(r) * out + o] : v;
          };
          const float got = all[size_t(r) * out + o];
          const double scale = 1 + mag + std::abs(y0[size_t(r) * out + o]);
          ASSERT_NEAR(got, epilogue(rounded), (in + 16) * 6e-8 * scale) << "row " << r << ", output " << o;
          ASSERT_NEAR(got, epilogue(exact), (kBf16Roundoff + (in + 16) * 6e-8) * scale)
              << "row " << r << ", output " << o;
          if (kEmulated && e.bias == nullptr && e.act < 0 && !e.residual && e.alpha == 1.f) {
            ASSERT_EQ(got, ordered) << "row " << r << ", output " << o;
          }
        }
      }
      for (const auto [first, n] : {std::pair{0, 1}, std::pair{5, 1}, std::pair{rows - 1, 1}, std::pair{3, 17},
                                    std::pair{31, 2}, std::pair{1, rows - 2}, std::pair{33, rows - 34}}) {
        const std::vector<float> part = run(first, n);
        ASSERT_EQ(std::memcmp(part.data(), all.data() + size_t(first) * out, part.size() * sizeof(float)), 0)
            << "rows " << first << ".." << first + n - 1 << " alone differ from the same rows in the batch of " << rows;
      }
    }
    // Three products in one launch (a fused QKV): each equals its own launch, bit for bit.
    const int64_t ystride = int64_t{rows} * out + 5;
    float* dy3 = Upload(std::vector<float>(size_t(3 * ystride), NAN));
    ExpectFusedEqualsThreeLaunches([dws, dtk](auto... a) { return cuda::LinearMma(a..., dws, dtk); }, dx, dw, db, rows,
                                   in, out, dy3, ystride);
    expect_tickets_zero();
    if (splits > 1) {
      EXPECT_EQ(cuda::LinearMma(dx, rows, in, dw, out, db, -1, false, 1.f, dy3, nullptr), cudaErrorInvalidValue)
          << "two ranges need a workspace";
      EXPECT_EQ(cuda::LinearMma(dx, rows, in, dw, out, db, -1, false, 1.f, dy3, nullptr, 1, 0, 0, 0, dws),
                cudaErrorInvalidValue)
          << "two ranges need tickets";
    }
    for (void* d : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(db), static_cast<void*>(dy3),
                    static_cast<void*>(dws), static_cast<void*>(dtk)}) {
      cudaFree(d);
    }
  }
}

// The fused projection that writes k and v into the cache: q, and the pool's bits (f32 and bf16,
// scattered pages, rows at several positions of two sequences), equal Linear's three products then
// WriteKv; bf16 weights too, and on tensor cores (LinearMma); a pool whose width is not the
// projection's is refused.
TEST(CudaKernelsTest, QkvToCacheEqualsLinearThenWriteKv) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  std::normal_distribution<float> nd;
  const int rows = 21, in = 48, heads = 3, hd = 8, width = heads * hd, bs = 4, nblocks = 12;
  std::vector<float> x(size_t(rows) * in), w(size_t(3) * width * in), bias(3 * width);
  for (auto* v : {&x, &w, &bias}) {
    for (float& e : *v) e = nd(rng);
  }
  std::vector<uint16_t> w16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w16[i] = cpu::ToBf16(w[i]);
  // Rows 0..12: sequence A at positions 3..15; rows 13..20: sequence B at 0..7 (another table).
  std::vector<int32_t> position, offset, tables(2 * 6);
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);
  for (int r = 0; r < rows; ++r) {
    position.push_back(r < 13 ? r + 3 : r - 13);
    offset.push_back(r < 13 ? 0 : 6);
  }
  const cuda::Rows kv_rows{rows, Upload(position), Upload(offset), Upload(tables)};
  float *dx = Upload(x), *dw = Upload(w), *db = Upload(bias);
  uint16_t* dw16 = Upload(w16);
  const int64_t stride = int64_t{rows} * width;
  float* qkv = Upload(std::vector<float>(static_cast<size_t>(3 * stride)));
  float* q = Upload(std::vector<float>(static_cast<size_t>(stride)));
  for (const cuda::KvElem type : {cuda::KvElem::kF32, cuda::KvElem::kBf16}) {
    for (const int mode : {0, 1, 2}) {  // f32 weights, bf16 weights, bf16 weights on tensor cores
      const bool bf16_weights = mode > 0, mma = mode == 2;
      SCOPED_TRACE(std::string(type == cuda::KvElem::kBf16 ? "bf16" : "f32") + " pool, " +
                   (bf16_weights ? "bf16" : "f32") + " weights" + (mma ? ", tensor cores" : ""));
      const size_t pool_bytes = size_t{nblocks} * heads * bs * hd * (type == cuda::KvElem::kBf16 ? 2 : 4);
      std::vector<std::vector<uint8_t>> pools;  // [k, v] of each way
      for (const bool fused : {false, true}) {
        // Poisoned, so a slot either way leaves alone must stay poisoned in both.
        cuda::KvPool kv{Upload(std::vector<uint8_t>(pool_bytes, 0xa5)), Upload(std::vector<uint8_t>(pool_bytes, 0xa5)),
                        bs, heads, hd, type};
        if (fused) {
          ASSERT_EQ(mma            ? cuda::QkvToCacheMma(dx, rows, in, dw16, width, db, q, kv, kv_rows, nullptr)
                    : bf16_weights ? cuda::QkvToCache(dx, rows, in, dw16, width, db, q, kv, kv_rows, nullptr)
                                   : cuda::QkvToCache(dx, rows, in, dw, width, db, q, kv, kv_rows, nullptr),
                    cudaSuccess);
        } else {
          const int64_t ws = int64_t{width} * in;
          ASSERT_EQ(mma ? cuda::LinearMma(dx, rows, in, dw16, width, db, -1, false, 1.f, qkv, nullptr, 3, ws, width, stride)
                    : bf16_weights
                        ? cuda::Linear(dx, rows, in, dw16, width, db, -1, false, 1.f, qkv, nullptr, 3, ws, width, stride)
                        : cuda::Linear(dx, rows, in, dw, width, db, -1, false, 1.f, qkv, nullptr, 3, ws, width, stride),
                    cudaSuccess);
          ASSERT_EQ(cuda::WriteKv(kv, kv_rows, qkv + stride, qkv + 2 * stride, nullptr), cudaSuccess);
        }
        for (void* pool : {kv.k, kv.v}) {
          std::vector<uint8_t> host(pool_bytes);
          ASSERT_EQ(cudaMemcpy(host.data(), pool, pool_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
          pools.push_back(host);
          cudaFree(pool);
        }
      }
      EXPECT_EQ(pools[0], pools[2]) << "K";
      EXPECT_EQ(pools[1], pools[3]) << "V";
      EXPECT_NE(pools[0], std::vector<uint8_t>(pool_bytes, 0xa5)) << "K written";
      std::vector<float> want(static_cast<size_t>(stride)), got(static_cast<size_t>(stride));
      ASSERT_EQ(cudaMemcpy(want.data(), qkv, want.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got.data(), q, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0) << "q";
    }
  }
  const cuda::KvPool narrow{qkv, qkv, bs, heads - 1, hd};
  EXPECT_EQ(cuda::QkvToCache(dx, rows, in, dw, width, db, q, narrow, kv_rows, nullptr), cudaErrorInvalidValue);
  for (const void* d : {static_cast<const void*>(dx), static_cast<const void*>(dw), static_cast<const void*>(db),
                        static_cast<const void*>(dw16), static_cast<const void*>(qkv), static_cast<const void*>(q),
                        static_cast<const void*>(kv_rows.position), static_cast<const void*>(kv_rows.table_offset),
                        static_cast<const void*>(kv_rows.block_tables)}) {
    cudaFree(const_cast<void*>(d));
  }
}

// Attention's grid spanning more key splits than the rows need (as a captured decode graph's, sized
// for max_seq_len) gives the same bits: split boundaries do not depend on the count, and an empty
// split merges as nothing. Decode rows before, at and past the 512-key split, ALiBi's bias on.
TEST(CudaKernelsTest, AttentionGridSpanLeavesTheBits) {
  REQUIRE_GPU();
  const int heads = 2, hd = 16, width = heads * hd, bs = 16, nblocks = 40, span = 2048;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const size_t pool = size_t{nblocks} * heads * bs * hd;
  std::vector<float> k(pool), v(pool);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<int32_t> table(nblocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const std::vector<int32_t> position = {600, 100, 511, 512}, offset(position.size(), 0);
  const int n = static_cast<int>(position.size());
  std::vector<float> q(static_cast<size_t>(n) * width);
  for (float& x : q) x = nd(rng);
  cuda::Relative rel;
  rel.scheme = relpos::Scheme::kAlibi;
  rel.alibi_slopes = Upload(std::vector<float>{0.25f, 0.0625f});
  const cuda::KvPool kv{Upload(k), Upload(v), bs, heads, hd};
  float* work = Upload(std::vector<float>(cuda::AttentionWorkspace(n, heads, hd, span, 512), 0.f));
  float* dq = Upload(q);
  // Each row alone with the fewest splits it needs, then all rows in a grid spanning `span` keys.
  std::vector<float> tight(q.size()), wide(q.size());
  for (int r = 0; r < n; ++r) {
    cuda::Rows rows{1, Upload(std::vector<int32_t>{position[r]}), Upload(std::vector<int32_t>{0}), Upload(table)};
    float* out = Upload(std::vector<float>(width, NAN));
    ASSERT_EQ(cuda::Attention(dq + r * width, rows, position[r] + 1, 0.25f, rel, kv, out, work, 512, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(tight.data() + r * width, out, width * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    for (const void* p : {static_cast<const void*>(rows.position), static_cast<const void*>(rows.table_offset),
                          static_cast<const void*>(rows.block_tables), static_cast<const void*>(out)}) {
      cudaFree(const_cast<void*>(p));
    }
  }
  cuda::Rows rows{n, Upload(position), Upload(offset), Upload(table)};
  float* out = Upload(std::vector<float>(q.size(), NAN));
  ASSERT_EQ(cuda::Attention(dq, rows, span, 0.25f, rel, kv, out, work, 512, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(wide.data(), out, wide.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_TRUE(std::isfinite(tight[i])) << i;
    ASSERT_EQ(std::memcmp(&tight[i], &wide[i], sizeof(float)), 0) << "row " << i / width << " element " << i % width;
  }
  for (const void* p : {static_cast<const void*>(rows.position), static_cast<const void*>(rows.table_offset),
                        static_cast<const void*>(rows.block_tables), static_cast<const void*>(out),
                        static_cast<const void*>(kv.k), static_cast<const void*>(kv.v), static_cast<const void*>(work),
                        static_cast<const void*>(dq), static_cast<const void*>(rel.alibi_slopes)}) {
    cudaFree(const_cast<void*>(p));
  }
}

// The encoder's bidirectional attention against cpu::AttentionBidirectional: inputs of several
// lengths packed in one launch (each row sees only its own input, before and after it), their K/V
// read in place as the backend lays them ([rows, width] as a pool of one-token blocks), T5's signed
// buckets past max_distance on both sides, key splits (some empty for the short inputs), a head_dim
// that is not a multiple of the warp.
TEST(CudaKernelsTest, BidirectionalAttentionMatchesCpuTwin) {
  REQUIRE_GPU();
  const int H = 3, hd = 40, W = H * hd, buckets = 16, max_distance = 20;
  const std::vector<int> lengths = OnThreads() ? std::vector<int>{1, 9, 6} : std::vector<int>{1, 5, 47, 30, 2};
  const int kps = OnThreads() ? 4 : 8;
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const int total = std::accumulate(lengths.begin(), lengths.end(), 0);
  const int longest = *std::max_element(lengths.begin(), lengths.end());
  const std::vector<float> q = randv(size_t(total) * W), k = randv(size_t(total) * W), v = randv(size_t(total) * W);
  const std::vector<float> bias = randv(size_t(H) * buckets);
  const std::vector<int32_t> table = relpos::T5SignedBucketTable(buckets, max_distance);
  std::vector<int32_t> position, first, keys, identity(total);
  std::iota(identity.begin(), identity.end(), 0);
  for (int len : lengths) {
    for (int i = 0; i < len; ++i) {
      position.push_back(i);
      first.push_back(static_cast<int32_t>(position.size()) - 1 - i);
      keys.push_back(len);
    }
  }
  cuda::Rows r{total, Upload(position), Upload(first), Upload(identity), Upload(keys)};
  const cuda::KvPool pool{Upload(k), Upload(v), 1, H, hd};
  float* dq = Upload(q);
  float* work = Upload(std::vector<float>(std::max<int64_t>(cuda::AttentionWorkspace(total, H, hd, longest, kps), 1)));
  for (relpos::Scheme scheme : {relpos::Scheme::kT5, relpos::Scheme::kNone}) {
    cpu::RelativeParams crel;
    crel.scheme = scheme;
    crel.t5_bias = bias.data();
    crel.t5_num_buckets = buckets;
    crel.t5_bucket_of_distance = table.data();
    crel.t5_table_len = static_cast<int>(table.size());
    const cpu::AttentionDims dims{H, hd, 0.3f};
    std::vector<float> want(size_t(total) * W);
    for (size_t j = 0, row = 0; j < lengths.size(); row += lengths[j], ++j) {
      // One contiguous block per input, as the CPU backend's encoder keeps them.
      std::vector<float> kb(size_t(lengths[j]) * W), vb(kb.size());
      static const int32_t kOneBlock[1] = {0};
      const cpu::KvView view{kb.data(), vb.data(), kOneBlock, lengths[j], H, hd};
      cpu::WriteKv(view, k.data() + row * W, v.data() + row * W, 0, lengths[j]);
      cpu::AttentionBidirectional(dims, crel, view, q.data() + row * W, lengths[j], want.data() + row * W);
    }
    cuda::Relative grel;
    grel.scheme = scheme;
    grel.t5_bias = Upload(bias);
    grel.t5_num_buckets = buckets;
    grel.t5_bucket_of_distance = Upload(table);
    grel.t5_table_len = static_cast<int>(table.size());
    float* dout = Upload(std::vector<float>(size_t(total) * W, NAN));
    ASSERT_EQ(cuda::AttentionBidirectional(dq, r, longest, dims.scale, grel, pool, dout, work, kps, nullptr),
              cudaSuccess);
    std::vector<float> got(size_t(total) * W);
    ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::abs(want[i]))) << "scheme " << static_cast<int>(scheme) << " " << i;
    }
  }
  // Only T5's buckets or nothing: another scheme is refused, not computed as if causal.
  cuda::Relative skew;
  skew.scheme = relpos::Scheme::kSkew;
  EXPECT_EQ(cuda::AttentionBidirectional(dq, r, longest, 1.f, skew, pool, dq, work, kps, nullptr),
            cudaErrorInvalidValue);
}

TEST(CudaKernelsTest, RowKernelsMatchCpuTwins) {
  REQUIRE_GPU();
  const int rows = 5, dim = 300;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.5f, 2.f);
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const std::vector<float> x = randv(rows * dim), w = randv(dim), b = randv(dim), g = randv(rows * dim);
  auto download = [](const float* d, size_t n) {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  };
  auto expect_close = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::abs(want[i]))) << what << " " << i;
  };
  for (bool layernorm : {true, false}) {
    std::vector<float> want(x.size());
    if (layernorm) {
      cpu::LayerNorm(x.data(), rows, dim, w.data(), b.data(), 1e-5f, want.data());
    } else {
      cpu::RmsNorm(x.data(), rows, dim, w.data(), 1e-5f, want.data());
    }
    float* dy = Upload(std::vector<float>(x.size(), NAN));
    ASSERT_EQ(cuda::Norm(layernorm, Upload(x), rows, dim, Upload(w), layernorm ? Upload(b) : nullptr, 1e-5f, dy, nullptr),
              cudaSuccess);
    expect_close(download(dy, x.size()), want, layernorm ? "layernorm" : "rmsnorm");
  }
  for (cpu::Activation act : {cpu::Activation::kRelu, cpu::Activation::kGelu, cpu::Activation::kGeluTanh,
                              cpu::Activation::kSilu}) {
    const int code = static_cast<int>(act == cpu::Activation::kRelu       ? 0
                                      : act == cpu::Activation::kGelu     ? 1
                                      : act == cpu::Activation::kGeluTanh ? 2
                                                                          : 3);
    std::vector<float> want = x;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < dim; ++c) want[r * dim + c] += b[c];
    }
    cpu::Activate(act, want.data(), static_cast<int64_t>(want.size()));
    float* dy = Upload(x);
    ASSERT_EQ(cuda::BiasActivate(dy, rows, dim, Upload(b), code, nullptr), cudaSuccess);
    expect_close(download(dy, x.size()), want, "bias+activation");
    std::vector<float> gated = x;
    cpu::ActivateGated(act, gated.data(), g.data(), static_cast<int64_t>(gated.size()));
    float* dx = Upload(x);
    ASSERT_EQ(cuda::ActivateGated(code, dx, Upload(g), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
    expect_close(download(dx, x.size()), gated, "gated");
  }
  std::vector<float> sum = x;
  cpu::AddInPlace(sum.data(), g.data(), static_cast<int64_t>(sum.size()));
  float* dsum = Upload(x);
  ASSERT_EQ(cuda::AddInPlace(dsum, Upload(g), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
  expect_close(download(dsum, x.size()), sum, "add");
  const std::vector<int32_t> ids = {3, 0, 4, 4, 1};
  std::vector<float> emb(ids.size() * dim);
  cpu::Embedding(x.data(), dim, ids.data(), static_cast<int>(ids.size()), 0.5f, emb.data());
  float* demb = Upload(std::vector<float>(emb.size(), NAN));
  ASSERT_EQ(cuda::Embedding(Upload(ids), static_cast<int>(ids.size()), Upload(x), dim, 0.5f, demb, nullptr), cudaSuccess);
  expect_close(download(demb, emb.size()), emb, "embedding");
}

// ---- sampling on the device --------------------------------------------------------------

// Runs AnswerRows on `logits` [rows, vocab]; u: per query, or empty for Philox's.
std::vector<cuda::DeviceAnswer> AnswerOnDevice(const std::vector<float>& logits, int vocab,
                                               const std::vector<cuda::DeviceQuery>& queries,
                                               const std::vector<int32_t>& history, const std::vector<double>& u) {
  auto up = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)), cudaSuccess);
    if (!v.empty()) EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  };
  void* dl = up(logits);
  void* dq = up(queries);
  void* dh = up(history);
  void* draw_ = up(std::vector<float>(history.size()));
  void* du = u.empty() ? nullptr : up(u);
  void* da = nullptr;
  EXPECT_EQ(cudaMalloc(&da, queries.size() * sizeof(cuda::DeviceAnswer)), cudaSuccess);
  EXPECT_EQ(cuda::AnswerRows(static_cast<float*>(dl), vocab, static_cast<const cuda::DeviceQuery*>(dq),
                             static_cast<int>(queries.size()), static_cast<const int32_t*>(dh), static_cast<float*>(draw_),
                             static_cast<const double*>(du), static_cast<cuda::DeviceAnswer*>(da), nullptr),
            cudaSuccess);
  std::vector<cuda::DeviceAnswer> out(queries.size());
  EXPECT_EQ(cudaMemcpy(out.data(), da, out.size() * sizeof(cuda::DeviceAnswer), cudaMemcpyDeviceToHost), cudaSuccess);
  for (void* d : {dl, dq, dh, draw_, du, da}) {
    if (d != nullptr) cudaFree(d);
  }
  return out;
}

cuda::DeviceQuery DrawQuery(const SamplingParams& p, int row, int history_len) {
  cuda::DeviceQuery q;
  q.row = row;
  q.draw = 1;
  q.top_n = p.logprobs;
  q.temperature = p.temperature;
  q.top_p = p.top_p;
  q.repetition_penalty = p.repetition_penalty;
  q.top_k = p.top_k;
  q.seed = p.seed;
  q.history_len = history_len;
  return q;
}

// Every control alone and combined: a draw at the middle of each token's interval of the reference's
// cumulative distribution (kept tokens in id order) returns that token, so the kept set and every
// kept probability are the reference's; a cut token is never returned.
TEST(CudaSamplerTest, ExactDistributionPerControl) {
  REQUIRE_GPU();
  const int v = 48;
  const std::vector<float> logits = NormalLogits(v, 21, 1.5f);
  const std::vector<int32_t> history = {3, 17, 17, 40, 5, 3, 47};
  struct Case {
    float temperature;
    int top_k;
    float top_p;
    float penalty;
  };
  const std::vector<Case> cases = {{1.0f, 0, 1.0f, 1.0f}, {0.7f, 0, 1.0f, 1.0f},  {1.0f, 9, 1.0f, 1.0f},
                                   {1.0f, 0, 0.9f, 1.0f}, {1.0f, 0, 0.35f, 1.0f}, {1.0f, 0, 1.0f, 1.8f},
                                   {0.8f, 12, 0.9f, 1.0f}, {0.6f, 20, 0.8f, 1.3f}, {1.5f, 30, 0.95f, 0.7f},
                                   {0.9f, 1, 1.0f, 1.0f}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.temperature << " top_k " << c.top_k << " top_p " << c.top_p
                                      << " penalty " << c.penalty);
    SamplingParams p;
    p.temperature = c.temperature;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.repetition_penalty = c.penalty;
    const std::vector<double> ref = ReferenceProbs(logits, p, history);
    std::vector<cuda::DeviceQuery> queries;
    std::vector<double> u;
    std::vector<int32_t> want;
    double cum = 0;
    for (int t = 0; t < v; ++t) {
      if (ref[t] == 0) continue;
      queries.push_back(DrawQuery(p, 0, static_cast<int>(history.size())));
      u.push_back(cum + ref[t] / 2);
      want.push_back(t);
      cum += ref[t];
    }
    ASSERT_FALSE(queries.empty());
    // A draw penalises its own row and history in place: each query gets its copies.
    std::vector<float> rows;
    std::vector<int32_t> histories;
    for (size_t i = 0; i < queries.size(); ++i) {
      queries[i].row = static_cast<int>(i);
      queries[i].history_offset = static_cast<int>(histories.size());
      rows.insert(rows.end(), logits.begin(), logits.end());
      histories.insert(histories.end(), history.begin(), history.end());
    }
    const std::vector<cuda::DeviceAnswer> got = AnswerOnDevice(rows, v, queries, histories, u);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].token, want[i]) << "u " << u[i];
  }
}

// A query's controls laid out for the device by hand (sampler_kernels.h, DeviceQuery::controls_offset).
std::vector<int32_t> DeviceControls(const SamplingParams& p, int index) {
  std::vector<int32_t> c = {static_cast<int32_t>(p.logit_bias.size())};
  for (const auto& [t, b] : p.logit_bias) {
    int32_t bits;
    std::memcpy(&bits, &b, sizeof(bits));
    c.insert(c.end(), {t, bits});
  }
  c.push_back(static_cast<int32_t>(p.allowed_token_ids.size()));
  c.insert(c.end(), p.allowed_token_ids.begin(), p.allowed_token_ids.end());
  const bool bans = index < p.min_tokens;
  c.push_back(bans ? static_cast<int32_t>(p.min_tokens_banned.size()) : 0);
  if (bans) c.insert(c.end(), p.min_tokens_banned.begin(), p.min_tokens_banned.end());
  c.push_back(static_cast<int32_t>(p.bad_words.size()));
  for (const auto& w : p.bad_words) {
    c.push_back(static_cast<int32_t>(w.size()));
    c.insert(c.end(), w.begin(), w.end());
  }
  return c;
}

// The controls of tests/sampling_reference.h's ControlCases on the device: each kept token's
// midpoint draw returns it, a greedy query the reference's argmax, as
// SamplerTest.ControlsMatchTheReference on the host.
TEST(CudaSamplerTest, ControlsMatchTheReference) {
  REQUIRE_GPU();
  const int v = 48;
  const std::vector<float> logits = NormalLogits(v, 5 + v, 1.5f);
  auto controls = DeviceControls;
  for (const SamplingParams& p : ControlCases()) {
    SCOPED_TRACE(Describe(p));
    const std::vector<double> ref = ReferenceProbs(logits, p, kControlHistory, kControlIndex);
    std::vector<double> u;
    std::vector<int32_t> want;
    double cum = 0;
    for (int t = 0; t < v; ++t) {
      // The device counts mass in units of 2^-40 of the largest weight: a token far below one
      // (the -100 bias) is never drawn there, and its interval is too thin to aim at.
      if (ref[t] > 1e-9) {
        u.push_back(cum + ref[t] / 2);
        want.push_back(t);
      }
      cum += ref[t];
    }
    ASSERT_FALSE(want.empty());
    // Each query its own row, history and controls (a draw processes them in place).
    std::vector<float> rows;
    std::vector<int32_t> words;
    std::vector<cuda::DeviceQuery> queries;
    for (size_t i = 0; i < want.size(); ++i) {
      cuda::DeviceQuery q = DrawQuery(p, static_cast<int>(i), static_cast<int>(kControlHistory.size()));
      q.index = kControlIndex;
      q.presence_penalty = p.presence_penalty;
      q.frequency_penalty = p.frequency_penalty;
      q.min_p = p.min_p;
      q.no_repeat_ngram_size = p.no_repeat_ngram_size;
      q.history_offset = static_cast<int>(words.size());
      words.insert(words.end(), kControlHistory.begin(), kControlHistory.end());
      q.controls_offset = static_cast<int>(words.size());
      const std::vector<int32_t> c = controls(p, kControlIndex);
      words.insert(words.end(), c.begin(), c.end());
      rows.insert(rows.end(), logits.begin(), logits.end());
      queries.push_back(q);
    }
    const std::vector<cuda::DeviceAnswer> got = AnswerOnDevice(rows, v, queries, words, u);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].token, want[i]) << "u " << u[i];
  }
  // no_repeat_ngram_size 2 and 3 where the history repeats (5 7 5 7 5): each bans 7, the argmax.
  for (int n : {2, 3}) {
    std::vector<float> row(v, 0.0f);
    row[7] = 3.0f;
    row[11] = 2.0f;
    SamplingParams p;
    p.temperature = 0;
    p.no_repeat_ngram_size = n;
    const std::vector<int32_t> history = {5, 7, 5, 7, 5};
    const std::vector<double> ref = ReferenceProbs(row, p, history, 2);
    ASSERT_EQ(ref[11], 1.0) << n;
    cuda::DeviceQuery q = DrawQuery(p, 0, static_cast<int>(history.size()));
    q.index = 2;
    q.no_repeat_ngram_size = n;
    EXPECT_EQ(AnswerOnDevice(row, v, {q}, history, {0.5})[0].token, 11) << n;
  }
  // Every token banned: the answer is -1.
  SamplingParams p;
  p.temperature = 0;
  p.allowed_token_ids = {7};
  p.bad_words = {{7}};
  cuda::DeviceQuery q = DrawQuery(p, 0, 0);
  q.controls_offset = 0;
  const std::vector<cuda::DeviceAnswer> banned = AnswerOnDevice(logits, v, {q}, controls(p, 0), {0.5});
  EXPECT_EQ(banned[0].token, -1);
}

// Beam search's candidates (draw 2) under every control case, all in one batch (each query its own
// row, history and controls): the reference's tokens in its order, their log-probabilities within
// float rounding, as SamplerTest.BeamCandidatesMatchTheReference on the host.
TEST(CudaSamplerTest, BeamCandidatesMatchTheReference) {
  REQUIRE_GPU();
  const int v = 48;
  const std::vector<float> logits = NormalLogits(v, 7 + v, 2.0f);
  const std::vector<SamplingParams> cases = ControlCases();
  std::vector<float> rows;
  std::vector<int32_t> words;
  std::vector<cuda::DeviceQuery> queries;
  std::vector<std::vector<TokenLogprob>> want;
  for (const SamplingParams& p : cases) {
    for (int n : {1, 32}) {
      cuda::DeviceQuery q = DrawQuery(p, static_cast<int>(queries.size()), static_cast<int>(kControlHistory.size()));
      q.draw = 2;
      q.top_n = n;
      q.index = kControlIndex;
      q.presence_penalty = p.presence_penalty;
      q.frequency_penalty = p.frequency_penalty;
      q.no_repeat_ngram_size = p.no_repeat_ngram_size;
      q.history_offset = static_cast<int>(words.size());
      words.insert(words.end(), kControlHistory.begin(), kControlHistory.end());
      q.controls_offset = static_cast<int>(words.size());
      const std::vector<int32_t> c = DeviceControls(p, kControlIndex);
      words.insert(words.end(), c.begin(), c.end());
      rows.insert(rows.end(), logits.begin(), logits.end());
      queries.push_back(q);
      want.push_back(ReferenceBeamCandidates(logits, p, kControlHistory, kControlIndex, n));
    }
  }
  const std::vector<cuda::DeviceAnswer> got = AnswerOnDevice(rows, v, queries, words, {});
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "query " << i << " " << Describe(cases[i / 2]));
    ASSERT_EQ(got[i].num_top, static_cast<int>(want[i].size()));
    for (size_t j = 0; j < want[i].size(); ++j) {
      EXPECT_EQ(got[i].top_token[j], want[i][j].token) << j;
      EXPECT_NEAR(got[i].top_logprob[j], want[i][j].logprob, 2e-6) << j;
    }
    EXPECT_EQ(got[i].token, want[i].empty() ? -1 : want[i][0].token);
  }
}

// Greedy (with the penalty), log-probabilities of the raw logits with their alternatives, scores of
// given tokens, and Philox's draw: each against the float64 reference, and each the same alone as in
// a batch beside the others (rows of one seed differ by their index alone).
TEST(CudaSamplerTest, AnswersMatchTheReferenceAloneAndBatched) {
  REQUIRE_GPU();
  // One OS thread per CUDA thread: two draws beside two scores, on a smaller vocabulary.
  const int v = OnThreads() ? 64 : 300, rows = OnThreads() ? 2 : 6;
  std::vector<float> logits;
  for (int r = 0; r < 2 * rows; ++r) {  // draws read rows 0..5, scores rows 6..11
    const std::vector<float> row = NormalLogits(v, 100 + r, 2.0f);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  const std::vector<int32_t> one_history = {1, 5, 9, 5, 37 % v, 250 % v};
  std::vector<int32_t> history;  // each draw's own copy
  for (int r = 0; r < rows; ++r) history.insert(history.end(), one_history.begin(), one_history.end());
  std::vector<cuda::DeviceQuery> queries;
  std::vector<SamplingParams> params;
  for (int r = 0; r < rows; ++r) {
    SamplingParams p;
    p.temperature = r % 3 == 0 ? 0.0f : 0.7f + 0.1f * r;
    p.top_k = r % 2 ? 40 : 0;
    p.top_p = r % 4 == 1 ? 0.9f : 1.0f;
    p.repetition_penalty = 1.25f;
    p.seed = 500 + r / 3;
    p.logprobs = r % 3 == 2 ? -1 : 3 + r;
    params.push_back(p);
    cuda::DeviceQuery q = DrawQuery(p, r, static_cast<int>(one_history.size()));
    q.history_offset = r * static_cast<int>(one_history.size());
    q.index = 2 + r % 3;
    queries.push_back(q);
    cuda::DeviceQuery s;  // a score beside each draw, on another row
    s.row = rows + (r + 1) % rows;
    s.token = (37 * r + 1) % v;
    s.top_n = r % 4;
    queries.push_back(s);
  }
  const std::vector<cuda::DeviceAnswer> batched = AnswerOnDevice(logits, v, queries, history, {});
  for (size_t i = 0; i < queries.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "query " << i);
    const cuda::DeviceQuery& q = queries[i];
    const std::vector<cuda::DeviceAnswer> alone = AnswerOnDevice(logits, v, {q}, history, {});  // fresh copies
    EXPECT_EQ(alone[0].token, batched[i].token);
    EXPECT_EQ(alone[0].logprob, batched[i].logprob);
    ASSERT_EQ(alone[0].num_top, batched[i].num_top);
    for (int k = 0; k < alone[0].num_top; ++k) {
      EXPECT_EQ(alone[0].top_token[k], batched[i].top_token[k]);
      EXPECT_EQ(alone[0].top_logprob[k], batched[i].top_logprob[k]);
    }
    const std::vector<float> row(logits.begin() + static_cast<size_t>(q.row) * v,
                                 logits.begin() + static_cast<size_t>(q.row + 1) * v);
    double mx = -INFINITY, z = 0;
    for (float l : row) mx = std::max<double>(mx, l);
    for (float l : row) z += std::exp(l - mx);
    const double log_z = mx + std::log(z);
    int32_t token = q.token;
    if (q.draw) {
      const SamplingParams& p = params[i / 2];
      const std::vector<double> ref = ReferenceProbs(row, p, one_history);
      if (p.temperature == 0) {
        token = static_cast<int32_t>(std::max_element(ref.begin(), ref.end()) - ref.begin());
      } else {
        const double u = philox::Uniform(p.seed, static_cast<uint64_t>(q.index));
        double cum = 0;
        for (token = 0; token < v; ++token) {
          if ((cum += ref[token]) > u && ref[token] > 0) break;
        }
      }
      EXPECT_EQ(batched[i].token, token);
    }
    const int n = q.draw ? std::max(q.top_n, 0) : q.top_n;
    if (q.top_n < 0) continue;
    EXPECT_NEAR(batched[i].logprob, row[token] - log_z, 1e-5);
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
    ASSERT_EQ(batched[i].num_top, n);
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(batched[i].top_token[k], order[k]);
      EXPECT_NEAR(batched[i].top_logprob[k], row[order[k]] - log_z, 1e-5);
    }
  }
}

// Launching ahead: each step is launched before the previous one is collected, its decode token
// (and, under a repetition penalty, its history's last token) fed from the previous launch's
// draw, never seen by the host. The answers equal those of steps run one at a time with the drawn
// tokens given, bit for bit; and a third launch while two are outstanding is refused.
void ExpectLaunchAheadEqualsOneAtATime(const std::function<std::unique_ptr<Backend>()>& make) {
  std::unique_ptr<Backend> ahead = make(), alone = make();
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}, {9, 8, 7}, {42}};
  const std::vector<std::vector<int32_t>> tables = {{0, 1}, {2, 3}, {4, 5}};
  SamplingParams greedy;
  greedy.temperature = 0;
  SamplingParams penalised;
  penalised.temperature = 0.8f;
  penalised.seed = 7;
  penalised.repetition_penalty = 1.5f;
  penalised.logprobs = 2;
  // The controls that read the output (the fed draws) and those that do not.
  penalised.presence_penalty = 0.6f;
  penalised.frequency_penalty = 0.3f;
  penalised.bad_words = {{9, 8}, {7, 7, 3}};
  penalised.no_repeat_ngram_size = 2;
  SamplingParams top_p = penalised;
  top_p.repetition_penalty = 1.0f;
  top_p.presence_penalty = top_p.frequency_penalty = 0.0f;
  top_p.top_p = 0.9f;
  top_p.min_p = 0.05f;
  top_p.logit_bias = {{3, 1.5f}, {100, -2.0f}};
  top_p.min_tokens = 3;
  top_p.min_tokens_banned = {0, 3};
  const SamplingParams* params[] = {&greedy, &penalised, &top_p};
  constexpr int kSteps = 5;  // the prefill, then four decode steps
  const int n = static_cast<int>(prompts.size());
  // Host-side copies as the engine keeps them: placeholders (0) where a draw is not yet known.
  std::vector<std::vector<int32_t>> seq_ahead = prompts, seq_alone = prompts;
  auto build = [&](int step, std::vector<std::vector<int32_t>>& seq, bool fed, std::vector<SequenceStep>* steps,
                   std::vector<RowQuery>* queries) {
    steps->clear();
    queries->clear();
    for (int i = 0; i < n; ++i) {
      const int len = static_cast<int>(seq[i].size());
      SequenceStep st;
      st.tokens = step == 0 ? absl::MakeConstSpan(seq[i]) : absl::MakeConstSpan(seq[i]).subspan(len - 1);
      st.start_pos = step == 0 ? 0 : len - 1;
      st.block_table = tables[i];
      RowQuery q;
      q.row = i;
      q.params = params[i];
      q.history = seq[i];
      q.index = step;
      if (fed && step > 0) st.fed_query = q.fed_query = i;
      steps->push_back(st);
      queries->push_back(q);
    }
  };
  std::vector<SequenceStep> steps;
  std::vector<RowQuery> queries;
  // One at a time, each draw appended before the next step is built.
  std::vector<std::vector<SampleResult>> want(kSteps);
  for (int step = 0; step < kSteps; ++step) {
    build(step, seq_alone, false, &steps, &queries);
    ASSERT_TRUE(RunStep(*alone, steps, queries, &want[step]).ok());
    ASSERT_EQ(want[step].size(), static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) seq_alone[i].push_back(want[step][i].token);
  }
  // Ahead: launch k + 1, then collect k.
  std::vector<std::vector<SampleResult>> got(kSteps);
  for (int step = 0; step < kSteps; ++step) {
    build(step, seq_ahead, true, &steps, &queries);
    const absl::Status st = ahead->Launch(steps, queries);
    ASSERT_TRUE(st.ok()) << st;
    for (int i = 0; i < n; ++i) seq_ahead[i].push_back(0);
    if (step == 1) {
      EXPECT_EQ(ahead->Launch(steps, queries).code(), absl::StatusCode::kFailedPrecondition);
    }
    if (step > 0) {
      ASSERT_TRUE(ahead->Collect(&got[step - 1]).ok());
      ASSERT_EQ(got[step - 1].size(), static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) seq_ahead[i][seq_ahead[i].size() - 2] = got[step - 1][i].token;
    }
  }
  ASSERT_TRUE(ahead->Collect(&got[kSteps - 1]).ok());
  EXPECT_EQ(ahead->Collect(&got[0]).code(), absl::StatusCode::kFailedPrecondition);
  for (int step = 0; step < kSteps; ++step) {
    ASSERT_EQ(got[step].size(), want[step].size());
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(got[step][i].token, want[step][i].token) << "step " << step << " sequence " << i;
      EXPECT_EQ(got[step][i].logprob, want[step][i].logprob) << "step " << step << " sequence " << i;
      EXPECT_EQ(got[step][i].top.size(), want[step][i].top.size());
    }
  }
  // The draws vary (the test is not of a constant).
  std::set<int32_t> drawn;
  for (const auto& step : want) drawn.insert(step[1].token);
  EXPECT_GT(drawn.size(), 1u);
}

TEST(LaunchAheadTest, CpuBackendFeedsTheHeldDraws) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  ExpectLaunchAheadEqualsOneAtATime([&] {
    auto b = NewCpuBackend(model, KvCacheConfig{16, 16}, 2, cpu::WeightType::kF32, cpu::KvType::kF32);
    EXPECT_TRUE(b.ok()) << b.status();
    return *std::move(b);
  });
}

TEST(LaunchAheadTest, CudaBackendFeedsTheDrawsOnTheDevice) {
  REQUIRE_GPU();
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
#if RELGEN_SIMT_EMULATOR
  const int64_t hazards = simt::GetCounters().stream_hazards;
#endif
  ExpectLaunchAheadEqualsOneAtATime([&] {
    CudaOptions o;
    o.num_blocks = 16;
    auto b = NewCudaBackend(model, o);
    EXPECT_TRUE(b.ok()) << b.status();
    return *std::move(b);
  });
#if RELGEN_SIMT_EMULATOR
  // Two launches in flight never share their page-locked staging (the emulator faults if they do).
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards);
#endif
}

#if RELGEN_SIMT_EMULATOR
// The backend built on the emulator says so wherever it names its device.
TEST(CudaEmulatorTest, ReportsEmulatedDevice) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  for (const char* device : {"cuda", "auto", "cuda:0"}) {
    DeviceOptions o;
    o.device = device;
    o.kv_cache_tokens = 1024;
    auto backend = NewBackend(model, o);
    ASSERT_TRUE(backend.ok()) << device << ": " << backend.status();
    EXPECT_EQ((*backend)->Describe().name, "cuda");
    EXPECT_EQ((*backend)->Describe().device, "simt-emulator:0") << device;
  }
  EXPECT_FALSE(NewBackend(model, DeviceOptions{"cuda:1", 1024}).ok());
  // int8 weights are the CPU's alone; bf16 weights go through any of the three projection paths.
  {
    DeviceOptions o{"cuda", 1024};
    o.weights_dtype = "int8";
    const auto refused = NewBackend(model, o);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("stores f32 or bf16 weights"), absl::string_view::npos) << refused.status();
    o.weights_dtype = "bf16";
    o.cuda_gemm = "cublas";
    const auto taken = NewBackend(model, o);
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ((*taken)->Describe().weights_dtype, "bf16");
    EXPECT_EQ((*taken)->Describe().projections, "cublas bf16 tensor-core projections, not batch invariant");
    DeviceOptions bad_split{"cuda", 1024};
    bad_split.cuda_split_keys = 0;
    const auto refused3 = NewBackend(model, bad_split);
    EXPECT_EQ(refused3.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused3.status().message().find("allowed >= 1"), absl::string_view::npos) << refused3.status();
  }
  // The attention split reaches the kernels: 16 keys a split against the default 128 on a 40-token
  // prompt, the same logits within float32 rounding but not the same bits (another merge order).
  {
    std::vector<float> logits[2];
    std::vector<int32_t> prompt(40), table = {0, 1, 2};
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((7 * i + 3) % 256);
    for (const int i : {0, 1}) {
      DeviceOptions o{"cuda", 1024};
      o.cuda_split_keys = i == 0 ? 128 : 16;
      auto backend = NewBackend(model, o);
      ASSERT_TRUE(backend.ok()) << backend.status();
      SequenceStep s{prompt, 0, table, false};
      ASSERT_TRUE(ForwardLogits(**backend, {&s, 1}, &logits[i]).ok());
    }
    ASSERT_EQ(logits[0].size(), logits[1].size());
    for (size_t i = 0; i < logits[0].size(); ++i) ASSERT_NEAR(logits[0][i], logits[1][i], 1e-4) << i;
    EXPECT_NE(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0);
  }
  // --weights_dtype bf16 reaches it: every projection matrix and the LM head in 2 bytes an element
  // (a tied head gets a bf16 copy beside the float32 embedding table the lookup reads).
  {
    const ModelConfig& c = model->config();
    int64_t weights[2] = {0, 0};
    for (const int i : {0, 1}) {
      DeviceOptions o{"cuda", 1024};
      o.weights_dtype = i == 0 ? "f32" : "bf16";
      auto backend = NewBackend(model, o);
      ASSERT_TRUE(backend.ok()) << backend.status();
      weights[i] = (*backend)->Describe().memory.weights;
    }
    const int64_t d = c.d_model, w = c.qkv_width(), f = c.ffn_dim, vd = int64_t{c.vocab_size} * d;
    const int64_t projections = c.n_layers * (4 * w * d + (c.ffn_gated ? 3 : 2) * f * d);
    EXPECT_EQ(weights[0] - weights[1], 2 * projections + (c.tie_embeddings ? -2 * vd : 2 * vd));
  }
  // --kv_cache_dtype bf16 reaches it: the same tokens in half the pool's bytes.
  int64_t bytes[2] = {0, 0};
  for (const int i : {0, 1}) {
    DeviceOptions o{"cuda", 1024};
    o.kv_cache_dtype = i == 0 ? "f32" : "bf16";
    auto backend = NewBackend(model, o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ(int64_t{(*backend)->Describe().kv_cache.num_blocks} * (*backend)->Describe().kv_cache.block_size, 1024);
    bytes[i] = (*backend)->Describe().memory.kv_cache;
  }
  const ModelConfig& c = model->config();
  EXPECT_EQ(bytes[0], 1024 * CudaKvBytesPerToken(c));
  EXPECT_EQ(bytes[1] * 2, bytes[0]);
  EXPECT_EQ(CudaKvBytesPerToken(c, cpu::KvType::kBf16), int64_t{2} * c.n_layers * c.n_heads * c.head_dim * 2);
}

// Every buffer a step can need is allocated at start, for the scheduler's limits: a mix of decode,
// a chunked prefill, prompt log-probabilities (every row's logits, up to a whole step's tokens) and
// decodes of several batch sizes allocates nothing more and never drops a captured graph.
TEST(CudaEmulatorTest, AllocatesNothingAfterStart) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const ModelConfig& c = model->config();
  CudaOptions o;
  o.num_blocks = 64;
  o.max_step_tokens = 48;  // the scheduler's --max_batch_tokens
  o.max_step_seqs = 4;     // --max_num_seqs
  auto backend = NewCudaBackend(model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::mt19937 rng(7);
  std::vector<int32_t> t(200);
  for (auto& x : t) x = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<std::vector<int32_t>> tables(4);
  for (int s = 0; s < 4; ++s) {
    for (int b = 0; b < 12; ++b) tables[s].push_back(s * 12 + b);
  }
  auto span = [&](int from, int n) { return absl::MakeConstSpan(t).subspan(from, n); };
  std::vector<float> logits;
  simt::ResetCounters();
  // A whole step of one prompt's rows, every row's logits kept (prompt_logprobs / Score).
  SequenceStep all{span(0, 48), 0, tables[0], true};
  ASSERT_TRUE(ForwardLogits(**backend, {&all, 1}, &logits).ok());
  EXPECT_EQ(logits.size(), size_t{48} * c.vocab_size);
  // A chunk of another prompt beside three decodes; then decode steps of 1..4 sequences, twice.
  std::vector<SequenceStep> mixed = {{span(48, 1), 48, tables[0], false},
                                     {span(0, 45), 0, tables[1], true},
                                     {span(10, 1), 0, tables[2], false},
                                     {span(11, 1), 0, tables[3], false}};
  ASSERT_TRUE(ForwardLogits(**backend, mixed, &logits).ok());
  std::vector<int> pos = {49, 45, 1, 1};
  for (int round = 0; round < 2; ++round) {
    for (int n = 1; n <= 4; ++n) {
      std::vector<SequenceStep> steps;
      for (int s = 0; s < n; ++s) steps.push_back({span(pos[s], 1), pos[s], tables[s], false});
      ASSERT_TRUE(ForwardLogits(**backend, steps, &logits).ok());
      for (int s = 0; s < n; ++s) ++pos[s];
      // A decode graph is captured once per batch size, in the first round only.
      if (round == 1) EXPECT_EQ(simt::GetCounters().captured, 0) << n << " rows";
      if (round == 1) simt::ResetCounters();
    }
    if (round == 0) {
      EXPECT_EQ(simt::GetCounters().mallocs, 0) << "a buffer was allocated after start";
      simt::ResetCounters();
    }
  }
  EXPECT_EQ(simt::GetCounters().mallocs, 0);
}

// One forward's work as the emulator counts it: every projection is one GEMM, memory comes back.
TEST(CudaEmulatorTest, CountsWork) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const ModelConfig& c = model->config();
  const int64_t before = simt::GetCounters().bytes_in_use;
  for (const bool cublas : {false, true}) {
    SCOPED_TRACE(cublas ? "cuBLAS projections" : "relgen's projections");
    CudaOptions o;
    o.num_blocks = 8;
    o.cublas_gemms = cublas;
    auto backend = NewCudaBackend(model, o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    simt::ResetCounters();
    const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
    const std::vector<int32_t> table = {3, 1};
    SequenceStep s{tokens, 0, table, false};
    std::vector<float> logits;
    ASSERT_TRUE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
    const simt::Counters n = simt::GetCounters();
    // Every projection and the LM head: a cuBLAS GEMM, or none of them.
    EXPECT_EQ(n.gemms, cublas ? c.n_layers * (4 + (c.ffn_gated ? 3 : 2)) + 1 : 0);
    EXPECT_GT(n.launches, 0);
    EXPECT_GT(n.syncthreads, 0);
    EXPECT_GT(n.warp_collectives, 0);
    EXPECT_GT(n.bytes_h2d, 0);
    EXPECT_EQ(n.bytes_d2h, int64_t{c.vocab_size} * static_cast<int64_t>(sizeof(float)));
    EXPECT_EQ(n.launch_errors, 0);
  }
  EXPECT_EQ(simt::GetCounters().bytes_in_use, before);
}

// A decode step answered on the device sends one copy back, into page-locked memory: the answers
// (ids and the log-probabilities asked for), not the logits; what goes up comes from page-locked
// memory too. The ids are the host sampler's
// greedy choices and the log-probabilities the host's within float rounding.
TEST(CudaEmulatorTest, DecodeStepCopiesBackOnlyTheAnswers) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const ModelConfig& c = model->config();
  CudaOptions o;
  o.num_blocks = 16;
  auto backend = NewCudaBackend(model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}, {9, 8, 7}, {42}};
  const std::vector<std::vector<int32_t>> tables = {{0, 1}, {2, 3}, {4, 5}};
  SamplingParams greedy;
  greedy.temperature = 0;
  SamplingParams with_lp = greedy;
  with_lp.logprobs = 3;
  with_lp.repetition_penalty = 1.3f;
  // The other controls, packed by the backend: the host's choices on the same logits.
  with_lp.presence_penalty = 1.1f;
  with_lp.frequency_penalty = 0.7f;
  with_lp.logit_bias = {{5, 2.0f}, {8, -3.0f}};
  with_lp.bad_words = {{7, 11}, {13}};
  with_lp.allowed_token_ids = {};
  with_lp.min_tokens = 2;
  with_lp.min_tokens_banned = {0};
  std::vector<SequenceStep> prefill;
  for (size_t i = 0; i < prompts.size(); ++i) prefill.push_back({prompts[i], 0, tables[i], false});
  std::vector<RowQuery> queries(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    queries[i].row = static_cast<int>(i);
    queries[i].params = i == 1 ? &with_lp : &greedy;
    queries[i].history = prompts[i];
  }
  std::vector<SampleResult> first;
  ASSERT_TRUE(RunStep(**backend, prefill, queries, &first).ok());
  ASSERT_EQ(first.size(), prompts.size());
  // The decode step: each sequence's sampled token at its next position.
  std::vector<std::vector<int32_t>> next(prompts.size());
  std::vector<SequenceStep> decode;
  for (size_t i = 0; i < prompts.size(); ++i) {
    next[i] = {first[i].token};
    decode.push_back({next[i], static_cast<int>(prompts[i].size()), tables[i], false});
  }
  simt::ResetCounters();
  std::vector<SampleResult> answers;
  ASSERT_TRUE(RunStep(**backend, decode, queries, &answers).ok());
  const simt::Counters n = simt::GetCounters();
  EXPECT_EQ(n.copies_d2h, 1);
  EXPECT_EQ(n.bytes_d2h, static_cast<int64_t>(prompts.size() * sizeof(cuda::DeviceAnswer)));
  EXPECT_LT(n.bytes_d2h, int64_t{c.vocab_size} * 4);
  EXPECT_EQ(n.bytes_d2h_pageable, 0);
  // Up: the step's metadata, the queries (and the penalty's history), from page-locked memory.
  EXPECT_GT(n.bytes_h2d, 0);
  EXPECT_EQ(n.bytes_h2d_pageable, 0);
  // The same step's logits (a fresh backend, the same steps) sampled on the host.
  auto twin = NewCudaBackend(model, o);
  ASSERT_TRUE(twin.ok());
  std::vector<float> logits;
  ASSERT_TRUE(ForwardLogits(**twin, prefill, &logits).ok());
  ASSERT_TRUE(ForwardLogits(**twin, decode, &logits).ok());
  std::vector<SampleResult> host;
  AnswerQueries(logits.data(), c.vocab_size, queries, &host);
  ASSERT_EQ(answers.size(), host.size());
  for (size_t i = 0; i < host.size(); ++i) {
    EXPECT_EQ(answers[i].token, host[i].token) << i;
    EXPECT_NEAR(answers[i].logprob, host[i].logprob, 1e-5) << i;
    ASSERT_EQ(answers[i].top.size(), host[i].top.size()) << i;
    for (size_t k = 0; k < host[i].top.size(); ++k) {
      EXPECT_EQ(answers[i].top[k].token, host[i].top[k].token);
      EXPECT_NEAR(answers[i].top[k].logprob, host[i].top[k].logprob, 1e-5);
    }
  }
  EXPECT_EQ(answers[1].top.size(), 3u);
}

// A decode step (one token per sequence) is one graph launch, captured once per batch size and
// replayed at any context length (its attention grids span max_seq_len; that this leaves the bits
// alone is AttentionGridSpanLeavesTheBits): the same logits bit for bit as the step launched kernel
// by kernel, batch sizes changing back and forth. The CPU-side parity of these steps is
// CudaParityTest's and CudaEngineTest's (decode runs through the graphs by default).
TEST(CudaEmulatorTest, DecodeStepIsOneGraphLaunchWithTheSameBits) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/server");
  const ModelConfig& c = model->config();
  ASSERT_GT(c.max_seq_len, 1024);
  CudaOptions on;
  on.num_blocks = 80;
  CudaOptions off = on;
  off.graphs = false;
  auto graphed = NewCudaBackend(model, on);
  auto direct = NewCudaBackend(model, off);
  ASSERT_TRUE(graphed.ok() && direct.ok()) << graphed.status() << direct.status();
  std::mt19937 rng(7);
  std::vector<int32_t> a(40), b(9);
  for (auto& t : a) t = static_cast<int32_t>(rng() % c.vocab_size);
  for (auto& t : b) t = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<int32_t> table_a(4), table_b(2);
  std::iota(table_a.begin(), table_a.end(), 0);
  std::iota(table_b.begin(), table_b.end(), 60);
  int len_a = 0, len_b = 0;
  // Runs `steps` on both backends; the logits must agree bitwise.
  auto both = [&](std::vector<SequenceStep> steps, simt::Counters* graphed_counts, simt::Counters* direct_counts) {
    std::vector<float> x, y;
    simt::ResetCounters();
    ASSERT_TRUE(ForwardLogits(**graphed, steps, &x).ok());
    *graphed_counts = simt::GetCounters();
    simt::ResetCounters();
    ASSERT_TRUE(ForwardLogits(**direct, steps, &y).ok());
    *direct_counts = simt::GetCounters();
    ASSERT_EQ(x.size(), y.size());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << "graph replay changed the logits";
  };
  simt::Counters g, d;
  both({SequenceStep{absl::MakeConstSpan(a).subspan(0, a.size() - 12), 0, table_a, false},
        SequenceStep{absl::MakeConstSpan(b).subspan(0, 4), 0, table_b, false}},
       &g, &d);
  EXPECT_EQ(g.graph_launches, 0) << "a prefill step is not a decode step";
  len_a = static_cast<int>(a.size()) - 12;
  len_b = 4;
  // (batch of two) x 3, (A alone) x 4, (two) x 2.
  const std::vector<int> batches = {2, 2, 2, 1, 1, 1, 1, 2, 2};
  for (size_t i = 0; i < batches.size(); ++i) {
    std::vector<SequenceStep> steps = {SequenceStep{absl::MakeConstSpan(a).subspan(len_a, 1), len_a, table_a, false}};
    if (batches[i] == 2) steps.push_back(SequenceStep{absl::MakeConstSpan(b).subspan(len_b, 1), len_b, table_b, false});
    both(steps, &g, &d);
    EXPECT_EQ(g.host_launches, 1) << "step " << i;
    EXPECT_EQ(g.graph_launches, 1) << "step " << i;
    const bool first_of_size = i == 0 || i == 3;
    EXPECT_EQ(g.captured > 0, first_of_size) << "step " << i << ": a graph is captured once per batch size";
    EXPECT_EQ(g.gemms, d.gemms);
    // Kernel by kernel (this pre-norm model with biases, keys in one split): the embedding; per
    // layer the norm, one launch for q, k and v with their biases writing k and v into the cache,
    // attention, the output projection with its bias and the residual, the norm, the FFN's up
    // (bias, GELU) and down (bias, residual); the kept rows, the final norm, the LM head.
    ASSERT_FALSE(c.ffn_gated || c.norm_placement != NormPlacement::kPre || c.embedding_norm);
    EXPECT_EQ(d.host_launches, 1 + 7 * c.n_layers + 3);
    EXPECT_EQ(d.launches, d.host_launches);
    EXPECT_EQ(d.gemms, 0);
    if (i == 0) std::printf("decode step of %d rows, launched kernel by kernel: %lld launches\n", batches[i],
                            static_cast<long long>(d.host_launches));
    EXPECT_EQ(g.launch_errors + d.launch_errors, 0);
    ++len_a;
    if (batches[i] == 2) ++len_b;
  }
  // With cuBLAS projections, kernel by kernel: each projection a GEMM and a bias launch, q, k and v
  // one strided-batched GEMM (three run) with one bias launch; 12 submissions per layer.
  CudaOptions cublas_opts = off;
  cublas_opts.cublas_gemms = true;
  auto cublas = NewCudaBackend(model, cublas_opts);
  ASSERT_TRUE(cublas.ok()) << cublas.status();
  std::vector<float> x;
  SequenceStep prefill{absl::MakeConstSpan(a).subspan(0, len_a), 0, table_a, false};
  ASSERT_TRUE(ForwardLogits(**cublas, {&prefill, 1}, &x).ok());
  simt::ResetCounters();
  SequenceStep step{absl::MakeConstSpan(a).subspan(len_a, 1), len_a, table_a, false};
  ASSERT_TRUE(ForwardLogits(**cublas, {&step, 1}, &x).ok());
  const simt::Counters n = simt::GetCounters();
  EXPECT_EQ(n.host_launches, 1 + 12 * c.n_layers + 3);
  EXPECT_EQ(n.launches + n.gemms - n.host_launches, 2 * c.n_layers);

  // cuBLAS over bf16 weights: each GEMM's input rounded to bf16 by a launch of its own, then GemmEx
  // (4 per layer and the LM head). The decode graph captures them on the backend's own cuBLAS
  // workspace (the emulator refuses a GEMM captured without one) and replays the same bits.
  CudaOptions bf16_direct = cublas_opts;
  bf16_direct.weight_type = cpu::WeightType::kBf16;
  CudaOptions bf16_graphed = bf16_direct;
  bf16_graphed.graphs = true;
  auto direct16 = NewCudaBackend(model, bf16_direct);
  auto graphed16 = NewCudaBackend(model, bf16_graphed);
  ASSERT_TRUE(direct16.ok() && graphed16.ok()) << direct16.status() << graphed16.status();
  EXPECT_EQ((*graphed16)->Describe().projections, "cublas bf16 tensor-core projections, not batch invariant");
  std::vector<float> p16, q16;
  ASSERT_TRUE(ForwardLogits(**direct16, {&prefill, 1}, &p16).ok());
  ASSERT_TRUE(ForwardLogits(**graphed16, {&prefill, 1}, &q16).ok());
  for (int i = 0; i < 3; ++i) {
    SequenceStep st{absl::MakeConstSpan(a).subspan(len_a + i, 1), len_a + i, table_a, false};
    simt::ResetCounters();
    ASSERT_TRUE(ForwardLogits(**direct16, {&st, 1}, &p16).ok());
    const simt::Counters k = simt::GetCounters();
    EXPECT_EQ(k.host_launches, 1 + 16 * c.n_layers + 4) << "step " << i;
    EXPECT_EQ(k.gemms, 6 * c.n_layers + 1) << "step " << i;  // q, k, v (three), output, up, down; the head
    simt::ResetCounters();
    ASSERT_TRUE(ForwardLogits(**graphed16, {&st, 1}, &q16).ok());
    const simt::Counters gr = simt::GetCounters();
    EXPECT_EQ(gr.host_launches, 1) << "step " << i;
    EXPECT_EQ(gr.graph_launches, 1) << "step " << i;
    EXPECT_EQ(gr.gemms, k.gemms) << "step " << i;
    EXPECT_EQ(gr.launch_errors + k.launch_errors, 0);
    ASSERT_EQ(p16.size(), q16.size());
    EXPECT_EQ(std::memcmp(p16.data(), q16.data(), p16.size() * sizeof(float)), 0) << "step " << i;
  }
}

// A decode step of more rows than the largest step the backend was sized for grows its buffers,
// the replayed graph's attention workspace (which spans max_seq_len keys) included: the same bits
// as kernel by kernel.
TEST(CudaEmulatorTest, DecodeRowsPastTheLargestStepReplayTheSameBits) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/server");
  CudaOptions on;
  on.num_blocks = 40;
  on.max_step_tokens = 3;
  on.max_step_seqs = 12;
  CudaOptions off = on;
  off.graphs = false;
  auto graphed = NewCudaBackend(model, on);
  auto direct = NewCudaBackend(model, off);
  ASSERT_TRUE(graphed.ok() && direct.ok()) << graphed.status() << direct.status();
  const int n = 12;
  std::vector<std::vector<int32_t>> tokens(n), tables(n);
  for (int i = 0; i < n; ++i) {
    tokens[i] = {static_cast<int32_t>(7 * i + 1), static_cast<int32_t>(11 * i + 2), static_cast<int32_t>(i + 40),
                 static_cast<int32_t>(3 * i + 5), static_cast<int32_t>(5 * i + 9)};
    tables[i] = {3 * i, 3 * i + 1, 3 * i + 2};
  }
  std::vector<float> x, y;
  for (int i = 0; i < n; ++i) {  // prompts of 3 tokens, one at a time (the largest step)
    SequenceStep s{absl::MakeConstSpan(tokens[i]).subspan(0, 3), 0, tables[i], false};
    ASSERT_TRUE(ForwardLogits(**graphed, {&s, 1}, &x).ok());
    ASSERT_TRUE(ForwardLogits(**direct, {&s, 1}, &y).ok());
  }
  for (int pos = 3; pos < 5; ++pos) {
    std::vector<SequenceStep> steps;
    for (int i = 0; i < n; ++i) steps.push_back({absl::MakeConstSpan(tokens[i]).subspan(pos, 1), pos, tables[i], false});
    ASSERT_TRUE(ForwardLogits(**graphed, steps, &x).ok()) << pos;
    ASSERT_TRUE(ForwardLogits(**direct, steps, &y).ok()) << pos;
    ASSERT_EQ(x.size(), y.size());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << "position " << pos;
  }
}

// An encoder-decoder forward as the emulator counts it: the step that encodes an input runs the
// encoder's projections, every decoder layer's cross K/V, then the decoder with cross-attention;
// the next step only the decoder. No hazard, no refused launch; a start that fails part-way and a
// backend that ends give all their memory back (the signed bucket table included).
TEST(CudaEmulatorTest, T5CountsWorkAndReturnsMemory) {
  nlohmann::json t5;
  for (const auto& t : testing::T5Cases()) {
    if (t["name"] == "t5-v1_1") t5 = t;
  }
  if (t5.is_null()) GTEST_SKIP() << "no T5 fixture (RELGEN_T5_CASES_DIR)";
  auto model = *Model::Load(t5["dir"]);
  const ModelConfig& c = model->config();
  ASSERT_TRUE(c.encoder_decoder);
  const int ffn = c.ffn_gated ? 3 : 2;
  const int64_t before = simt::GetCounters().bytes_in_use;
  for (const bool cublas : {true, false}) {
    SCOPED_TRACE(cublas ? "cuBLAS projections (counted as GEMMs)" : "relgen's projections (no GEMM)");
    CudaOptions o;
    o.num_blocks = 8;
    o.cublas_gemms = cublas;
    auto backend = NewCudaBackend(model, o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    simt::ResetCounters();
    const std::vector<int32_t> input = {5, 9, 2, 44, 1}, dec = {c.decoder_start_token_id, 7}, self = {3}, cross = {6};
    SequenceStep s;
    s.tokens = absl::MakeConstSpan(dec).subspan(0, 1);
    s.block_table = self;
    s.encoder_tokens = input;
    s.encoder_len = static_cast<int>(input.size());
    s.cross_block_table = cross;
    std::vector<float> logits;
    ASSERT_TRUE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
    const int64_t decoder = c.n_layers * (4 + 2 + ffn) + 1;  // self q/k/v/o, cross q/o, FFN; lm_head
    simt::Counters n = simt::GetCounters();
    EXPECT_EQ(n.gemms, cublas ? c.n_encoder_layers * (4 + ffn) + 2 * c.n_layers + decoder : 0);
    EXPECT_EQ(n.launch_errors, 0);
    EXPECT_EQ(n.stream_hazards, 0) << simt::LastFault();
    EXPECT_EQ(n.bytes_d2h, int64_t{c.vocab_size} * static_cast<int64_t>(sizeof(float)));
    simt::ResetCounters();
    s.tokens = absl::MakeConstSpan(dec).subspan(1, 1);
    s.start_pos = 1;
    s.encoder_tokens = {};
    ASSERT_TRUE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
    n = simt::GetCounters();
    EXPECT_EQ(n.gemms, cublas ? decoder : 0) << "a decode step encodes nothing";
    EXPECT_EQ(n.launch_errors, 0);
    // An input without cross blocks for its K/V: refused, and the backend stays usable.
    s.cross_block_table = {};
    EXPECT_EQ(ForwardLogits(**backend, {&s, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE((*backend)->Broken().ok());
    s.cross_block_table = cross;
    EXPECT_TRUE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
  }
  EXPECT_EQ(simt::GetCounters().bytes_in_use, before);
  const int64_t limit = simt::MemoryLimit();
  simt::SetMemoryLimit(before + model->float_bytes() + 4096);
  auto failed = NewCudaBackend(model, KvCacheConfig{16, 4096});
  simt::SetMemoryLimit(limit);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(simt::GetCounters().bytes_in_use, before) << "bytes left allocated by a failed start";
}

// Device memory is capped: the backend reports an allocation that does not fit, and frees the rest.
TEST(CudaEmulatorTest, OutOfDeviceMemory) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const int64_t limit = simt::MemoryLimit();
  const int64_t before = simt::GetCounters().bytes_in_use;
  simt::SetMemoryLimit(before + model->float_bytes() + 4096);
  auto backend = NewCudaBackend(model, KvCacheConfig{16, 4096});
  simt::SetMemoryLimit(limit);
  ASSERT_FALSE(backend.ok());
  EXPECT_NE(backend.status().message().find("out of memory"), std::string::npos) << backend.status();
  EXPECT_EQ(simt::GetCounters().bytes_in_use, before);
  size_t free = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  EXPECT_EQ(static_cast<int64_t>(total), limit);

  // A Forward beyond the largest step that cannot allocate its activations fails alone: the next
  // one runs (the failed allocation's error must not come back from the next kernel launch's check).
  CudaOptions so;
  so.num_blocks = 8;
  so.max_step_tokens = 16;
  so.max_step_seqs = 1;
  auto small = NewCudaBackend(model, so);
  ASSERT_TRUE(small.ok()) << small.status();
  const std::vector<int32_t> tokens(100, 7), table = {0, 1, 2, 3, 4, 5, 6};
  SequenceStep s{tokens, 0, table, false};
  std::vector<float> logits;
  simt::SetMemoryLimit(simt::GetCounters().bytes_in_use);
  const absl::Status failed = ForwardLogits(**small, {&s, 1}, &logits);
  simt::SetMemoryLimit(limit);
  EXPECT_NE(failed.message().find("out of memory"), std::string::npos) << failed;
  EXPECT_TRUE((*small)->Broken().ok()) << "out of memory is not a broken device";
  const absl::Status next = ForwardLogits(**small, {&s, 1}, &logits);
  EXPECT_TRUE(next.ok()) << next;
}

// A start that fails part-way (here: layer 0's V pool, after its K pool) frees everything it made.
TEST(CudaEmulatorTest, FailedStartFreesWhatItAllocated) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const ModelConfig& c = model->config();
  const KvCacheConfig kv{16, 512};
  const int64_t pool = int64_t{kv.num_blocks} * kv.block_size * c.n_heads * c.head_dim * sizeof(float);
  const int64_t limit = simt::MemoryLimit();
  const int64_t before = simt::GetCounters().bytes_in_use;
  simt::SetMemoryLimit(before + model->float_bytes() + pool + pool / 2);
  auto backend = NewCudaBackend(model, kv);
  simt::SetMemoryLimit(limit);
  ASSERT_FALSE(backend.ok());
  EXPECT_NE(backend.status().message().find("out of memory"), std::string::npos) << backend.status();
  EXPECT_EQ(simt::GetCounters().bytes_in_use, before) << "bytes left allocated by a failed start";
}

// A pool sized by memory fraction leaves the largest step the scheduler forms its room: here the
// pool takes 98% of a small device, and a step of max_step_tokens tokens still runs.
TEST(CudaEmulatorTest, PoolByFractionLeavesRoomForTheLargestStep) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  const int64_t limit = simt::MemoryLimit();
  const int64_t before = simt::GetCounters().bytes_in_use;
  CudaOptions o;
  o.kv_memory_fraction = 0.98;
  o.max_step_tokens = 96;
  o.max_step_seqs = 4;
  o.headroom_bytes = 256 << 10;
  const int64_t room = 4 << 20;  // beside the weights
  simt::SetMemoryLimit(before + model->float_bytes() + room);
  {
    auto backend = NewCudaBackend(model, o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    const BackendMemory m = (*backend)->Describe().memory;
    EXPECT_GT(m.activations, 0);
    // The pool has what the step buffers and the headroom leave, to within the fraction and a block.
    EXPECT_GE(m.kv_cache, static_cast<int64_t>(0.97 * (room - m.activations - o.headroom_bytes)));
    EXPECT_LE(m.weights + m.activations + m.kv_cache + o.headroom_bytes, room + model->float_bytes());
    const std::vector<int32_t> tokens(o.max_step_tokens, 7);
    std::vector<int32_t> table;
    for (int b = 0; b * o.block_size < o.max_step_tokens; ++b) table.push_back(b);
    SequenceStep s{tokens, 0, table, false};
    std::vector<float> logits;
    const absl::Status st = ForwardLogits(**backend, {&s, 1}, &logits);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ((*backend)->Describe().memory.activations, m.activations) << "a step grew the buffers";
  }
  // Where the weights and the largest step do not fit, the start fails and says why.
  simt::SetMemoryLimit(before + model->float_bytes() + (64 << 10));
  auto tight = NewCudaBackend(model, o);
  simt::SetMemoryLimit(limit);
  ASSERT_FALSE(tight.ok());
  EXPECT_EQ(tight.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(tight.status().message().find("the largest step the scheduler can form (96 tokens, 4 sequences"),
            std::string::npos)
      << tight.status();
  EXPECT_EQ(simt::GetCounters().bytes_in_use, before);
  o.kv_memory_fraction = 1.5;
  EXPECT_EQ(NewCudaBackend(model, o).status().code(), absl::StatusCode::kInvalidArgument);
}

// A fault the device keeps (as a GPU keeps an asynchronous fault) breaks the backend for good; an
// out-of-memory does not (OutOfDeviceMemory).
TEST(CudaEmulatorTest, DeviceFaultBreaksTheBackend) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  auto backend = NewCudaBackend(model, KvCacheConfig{16, 8});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::vector<int32_t> tokens = {1, 2, 3}, table = {0};
  SequenceStep s{tokens, 0, table, false};
  std::vector<float> logits;
  ASSERT_TRUE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
  EXPECT_TRUE((*backend)->Broken().ok());
  simt::FaultAtLaunch(1);
  EXPECT_FALSE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
  EXPECT_NE((*backend)->Broken().message().find("an illegal memory access"), std::string::npos)
      << (*backend)->Broken();
  EXPECT_FALSE(ForwardLogits(**backend, {&s, 1}, &logits).ok());
  simt::ResetDevice();
}

// When the device breaks, the engine fails everything outstanding UNAVAILABLE, naming the fault,
// and refuses new work: it cannot recover, the process must restart.
TEST(CudaEngineTest, DeviceFaultFailsEverythingUnavailable) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  auto engine = *Engine::Create(model, *NewCudaBackend(model, KvCacheConfig{16, 64}), NewByteTokenizer(), EngineConfig{});
  auto final_of = [](RequestHandle& h) {
    Output o, last;
    while (h.Next(&o)) last = o;
    return last;
  };
  Request r;
  r.prompt = {1, 2, 3};
  r.stop.max_new_tokens = 2;
  r.stop.ignore_eos = true;
  r.sampling.temperature = 0;
  ASSERT_TRUE(final_of(**engine->Submit(r)).status.ok());
  engine->Pause();  // the next step takes all three at once, and faults on its first kernel
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < 3; ++i) hs.push_back(*engine->Submit(r));
  simt::FaultAtLaunch(1);
  engine->Resume();
  for (auto& h : hs) {
    const Output o = final_of(*h);
    EXPECT_EQ(o.status.code(), absl::StatusCode::kUnavailable) << o.status;
    EXPECT_NE(o.status.message().find("the device failed"), std::string::npos) << o.status;
  }
  EXPECT_EQ(engine->Failure().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine->Submit(r).status().code(), absl::StatusCode::kUnavailable);
  simt::ResetDevice();
}

// The weights are copied before the first forward reads them: the copies and the forward are on
// one stream, or synchronized (a copy on the legacy stream does not order the non-blocking work
// stream; the emulator faults on the hazard).
TEST(CudaEmulatorTest, WeightsAreOnTheDeviceBeforeTheFirstForward) {
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  simt::ResetCounters();
  auto backend = NewCudaBackend(model, KvCacheConfig{16, 8});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::vector<int32_t> tokens = {1, 2, 3}, table = {0};
  SequenceStep s{tokens, 0, table, false};
  std::vector<float> logits;
  const absl::Status st = ForwardLogits(**backend, {&s, 1}, &logits);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(simt::GetCounters().stream_hazards, 0) << simt::LastFault();
  if (!simt::LastFault().empty()) simt::ResetDevice();  // keep the process usable for later tests
}
#endif

}  // namespace
}  // namespace relgen
