// The CUDA backend and kernels against their CPU twins and the PyTorch goldens. Every test skips
// where no CUDA device is present (these machines build the CUDA code but have no GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "engine/cpu_backend.h"
#include "engine/cuda_backend.h"
#include "engine/engine.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/relpos_host.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

#define REQUIRE_GPU() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device"

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
};

class CudaAttentionTest : public ::testing::TestWithParam<AttnCase> {};

// Every row of a sequence at once (as a prefill) on the GPU == the CPU twin, scattered pages.
TEST_P(CudaAttentionTest, MatchesCpuTwin) {
  REQUIRE_GPU();
  const AttnCase p = GetParam();
  const int H = 4, hd = 64, W = H * hd, L = p.length, bs = p.block_size;
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
  std::vector<float> kpool(size_t(nblocks) * H * bs * hd), vpool(kpool.size());
  cpu::KvView view{kpool.data(), vpool.data(), table.data(), bs, H, hd};
  cpu::WriteKv(view, k.data(), v.data(), 0, L);
  std::vector<float> want(size_t(L) * W);
  const cpu::AttentionDims dims{H, hd, 0.125f};
  cpu::AttentionPrefill(dims, crel, view, q.data(), 0, L, want.data());

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
  cuda::KvPool pool{Upload(std::vector<float>(kpool.size(), NAN)), Upload(std::vector<float>(kpool.size(), NAN)), bs, H, hd};
  float* dq = Upload(q);
  ASSERT_EQ(cuda::WriteKv(pool, r, Upload(k), Upload(v), nullptr), cudaSuccess);
  const int kps = 128;
  float* work = Upload(std::vector<float>(std::max<int64_t>(cuda::AttentionWorkspace(L, H, hd, L, kps), 1)));
  float* dout = Upload(std::vector<float>(size_t(L) * W, NAN));
  ASSERT_EQ(cuda::Attention(dq, r, L, 0.125f, grel, pool, dout, work, kps, nullptr), cudaSuccess);
  std::vector<float> got(size_t(L) * W);
  ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::abs(want[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, CudaAttentionTest,
    ::testing::Values(AttnCase{relpos::Scheme::kNone, 0, 0, false, 37, 7}, AttnCase{relpos::Scheme::kSkew, 20, 0, false, 300, 16},
                      AttnCase{relpos::Scheme::kSkew, 1000, 0, false, 701, 5}, AttnCase{relpos::Scheme::kSkewLocal, 64, 32, false, 333, 16},
                      AttnCase{relpos::Scheme::kShaw, 8, 0, true, 129, 3}, AttnCase{relpos::Scheme::kShaw, 300, 0, false, 513, 16},
                      AttnCase{relpos::Scheme::kT5, 0, 0, false, 257, 1}, AttnCase{relpos::Scheme::kAlibi, 0, 0, false, 999, 16}));

std::vector<std::string> Cases() {
  const std::string dir = testing::GoldenDir();
  if (dir.empty()) return {};
  std::vector<std::string> out;
  const nlohmann::json manifest = testing::ReadJson(dir + "/manifest.json");
  for (const auto& c : manifest["cases"]) out.push_back(c);
  return out;
}

class CudaParityTest : public ::testing::TestWithParam<std::string> {};

// The CUDA backend's logits against the PyTorch goldens, whole and token by token.
TEST_P(CudaParityTest, MatchesReference) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenDir() + "/" + GetParam();
  auto model = *Model::Load(dir);
  auto backend = NewCudaBackend(model, KvCacheConfig{16, 64});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto golden = *SafetensorsFile::Open(dir + "/golden.safetensors");
  const int vocab = model->config().vocab_size;
  for (int len : {1, 17, 129}) {
    const TensorInfo* t = golden->Find("tokens_" + std::to_string(len));
    const TensorInfo* l = golden->Find("logits_" + std::to_string(len));
    std::vector<int32_t> tokens(len);
    std::memcpy(tokens.data(), t->data, len * sizeof(int32_t));
    std::vector<double> want(l->numel());
    std::memcpy(want.data(), l->data, l->nbytes);
    std::vector<int32_t> table(16);
    std::iota(table.begin(), table.end(), 0);
    std::reverse(table.begin(), table.end());
    for (int chunk : {len, 1}) {
      std::vector<float> all, part;
      for (int pos = 0; pos < len; pos += chunk) {
        const int n = std::min(chunk, len - pos);
        SequenceStep s{absl::MakeConstSpan(tokens).subspan(pos, n), pos, table, true};
        ASSERT_TRUE((*backend)->Forward({&s, 1}, &part).ok());
        all.insert(all.end(), part.begin(), part.end());
      }
      testing::ExpectRowsClose(all.data(), want.data(), len, vocab, 1e-4, GetParam() + " chunk " + std::to_string(chunk));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, CudaParityTest, ::testing::ValuesIn(Cases()), [](const auto& i) { return i.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaParityTest);

// Batched output == single-request output on the GPU engine (greedy, float32).
TEST(CudaEngineTest, BatchedEqualsAlone) {
  REQUIRE_GPU();
  auto model = *Model::Load(testing::GoldenDir() + "/engine/skew");
  auto make = [&] {
    return *Engine::Create(model, *NewCudaBackend(model, KvCacheConfig{16, 512}), NewByteTokenizer(), EngineConfig{});
  };
  std::vector<Request> work;
  for (int i = 0; i < 16; ++i) {
    Request r;
    for (int t = 0; t < 1 + (i * 37) % 200; ++t) r.prompt.push_back((i * 7 + t) % 256);
    r.stop.max_new_tokens = 20 + i;
    r.stop.ignore_eos = true;
    r.sampling.temperature = 0;
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

}  // namespace
}  // namespace relgen
