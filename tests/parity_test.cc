// The engine's logits against the PyTorch reference (tools/relgen_ref.py) for every scheme, and the
// three ways of feeding a sequence (whole, token by token, irregular chunks) against each other.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/backends/backend.h"
#include "engine/core/kv_cache.h"
#include "engine/backends/cpu_backend.h"
#include "engine/backends/step_sync.h"
#include "engine/model/model.h"
#include "engine/model/safetensors.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

constexpr double kRtol = 1e-4;  // float32 engine vs float64 reference
constexpr int kBlockSize = 16;
constexpr int kBlocks = 64;

class ParityTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = testing::GoldenDir() + "/" + GetParam();
    auto model = Model::Load(dir);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *model;
    auto backend = NewCpuBackend(model_, KvCacheConfig{kBlockSize, kBlocks});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    auto golden = SafetensorsFile::Open(dir + "/golden.safetensors");
    ASSERT_TRUE(golden.ok()) << golden.status();
    golden_ = *std::move(golden);
    const nlohmann::json manifest = testing::ReadJson(testing::GoldenDir() + "/manifest.json");
    for (const auto& l : manifest["lengths"]) lengths_.push_back(l);
  }

  std::vector<int32_t> Tokens(int len) {
    const TensorInfo* t = golden_->Find("tokens_" + std::to_string(len));
    std::vector<int32_t> out(len);
    std::memcpy(out.data(), t->data, len * sizeof(int32_t));
    return out;
  }
  std::vector<double> Logits(int len) {
    const TensorInfo* t = golden_->Find("logits_" + std::to_string(len));
    std::vector<double> out(t->numel());
    std::memcpy(out.data(), t->data, t->nbytes);
    return out;
  }

  // Grows `table` to cover `tokens` positions, taking every other free block so that a sequence's
  // blocks are scattered through the pool.
  void Grow(std::vector<int32_t>* table, int tokens) {
    const int need = BlocksForTokens(tokens, kBlockSize) - static_cast<int>(table->size());
    for (int i = 0; i < need; ++i) {
      std::vector<int32_t> spare;
      ASSERT_TRUE(allocator_.Allocate(1, &spare));
      ASSERT_TRUE(allocator_.Allocate(1, table));
      spares_.insert(spares_.end(), spare.begin(), spare.end());
    }
  }

  // Feeds `tokens` in chunks of the given sizes (cycled), collecting every token's logits.
  std::vector<float> Run(const std::vector<int32_t>& tokens, const std::vector<int>& chunks) {
    std::vector<int32_t> table;
    std::vector<float> all, part;
    size_t pos = 0;
    for (size_t c = 0; pos < tokens.size(); ++c) {
      const size_t n = std::min<size_t>(chunks[c % chunks.size()], tokens.size() - pos);
      Grow(&table, static_cast<int>(pos + n));
      SequenceStep step;
      step.tokens = absl::MakeConstSpan(tokens).subspan(pos, n);
      step.start_pos = static_cast<int>(pos);
      step.block_table = table;
      step.all_logits = true;
      const absl::Status s = ForwardLogits(*backend_, {&step, 1}, &part);
      EXPECT_TRUE(s.ok()) << s;
      all.insert(all.end(), part.begin(), part.end());
      pos += n;
    }
    allocator_.Free(&table);
    allocator_.Free(&spares_);
    EXPECT_EQ(allocator_.num_free(), kBlocks);
    return all;
  }

  BlockAllocator allocator_{kBlocks};
  std::vector<int32_t> spares_;
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<SafetensorsFile> golden_;
  std::vector<int> lengths_;
};

TEST_P(ParityTest, FullSequenceMatchesReference) {
  const int vocab = model_->config().vocab_size;
  for (int len : lengths_) {
    const std::vector<float> got = Run(Tokens(len), {len});
    ASSERT_EQ(got.size(), size_t(len) * vocab);
    testing::ExpectRowsClose(got.data(), Logits(len).data(), len, vocab, kRtol,
                             "full, length " + std::to_string(len));
  }
}

TEST_P(ParityTest, TokenByTokenMatchesReference) {
  const int vocab = model_->config().vocab_size;
  for (int len : lengths_) {
    const std::vector<float> got = Run(Tokens(len), {1});
    testing::ExpectRowsClose(got.data(), Logits(len).data(), len, vocab, kRtol,
                             "incremental, length " + std::to_string(len));
  }
}

TEST_P(ParityTest, IrregularChunksMatchReference) {
  const int vocab = model_->config().vocab_size;
  for (int len : lengths_) {
    const std::vector<float> got = Run(Tokens(len), {3, 5, 1, 7, 2, 16, 1, 33});
    testing::ExpectRowsClose(got.data(), Logits(len).data(), len, vocab, kRtol,
                             "chunked, length " + std::to_string(len));
  }
}

// One Forward over several sequences at once (a prompt, a chunk, single decode tokens) gives each
// sequence what it gets alone.
TEST_P(ParityTest, MixedBatchMatchesReference) {
  const int vocab = model_->config().vocab_size;
  const std::vector<int> lens = {129, 64, 17};
  std::vector<std::vector<int32_t>> toks, tables(lens.size());
  for (int len : lens) toks.push_back(Tokens(len));
  // Sequence 0 is prefilled in two halves; 1 and 2 decode one token per step meanwhile.
  std::vector<std::vector<float>> got(lens.size());
  std::vector<int> pos(lens.size(), 0);
  std::vector<float> logits;
  while (pos[0] < lens[0] || pos[1] < lens[1] || pos[2] < lens[2]) {
    std::vector<SequenceStep> steps;
    std::vector<int> which;
    for (size_t s = 0; s < lens.size(); ++s) {
      if (pos[s] == lens[s]) continue;
      const int n = s == 0 ? std::min(65, lens[s] - pos[s]) : 1;
      SequenceStep st;
      st.tokens = absl::MakeConstSpan(toks[s]).subspan(pos[s], n);
      st.start_pos = pos[s];
      Grow(&tables[s], pos[s] + n);
      st.block_table = tables[s];
      st.all_logits = true;
      steps.push_back(st);
      which.push_back(static_cast<int>(s));
    }
    ASSERT_TRUE(ForwardLogits(*backend_, steps, &logits).ok());
    size_t off = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const size_t n = steps[i].tokens.size() * vocab;
      got[which[i]].insert(got[which[i]].end(), logits.begin() + off, logits.begin() + off + n);
      off += n;
      pos[which[i]] += static_cast<int>(steps[i].tokens.size());
    }
  }
  for (size_t s = 0; s < lens.size(); ++s) {
    testing::ExpectRowsClose(got[s].data(), Logits(lens[s]).data(), lens[s], vocab, kRtol,
                             "batched sequence " + std::to_string(s));
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, ParityTest, ::testing::ValuesIn(testing::GoldenCases()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ParityTest);

TEST(ParityManifest, GoldenFilesArePresent) {
  ASSERT_FALSE(testing::GoldenDir().empty()) << "RELGEN_GOLDEN_DIR is not set";
  EXPECT_GE(testing::GoldenCases().size(), 16u);
}

}  // namespace
}  // namespace relgen
