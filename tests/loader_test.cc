// Bad model input is refused at load with a message naming what is wrong; never a crash.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "engine/model/config.h"
#include "engine/model/model.h"
#include "engine/model/safetensors.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

// A valid model directory (a golden case) copied to a scratch directory for mutation.
class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(testing::GoldenDir().empty()) << "RELGEN_GOLDEN_DIR is not set";
    src_ = testing::GoldenDir() + "/skew_short_range";
    dir_ = testing::TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    config_ = testing::ReadJson(src_ + "/config.json");
    weights_ = testing::ReadFile(src_ + "/model.safetensors");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(weights_[i]);
    header_ = json::parse(weights_.substr(8, n));
    data_ = weights_.substr(8 + n);
  }

  absl::Status Load() {
    testing::WriteFile(dir_ + "/config.json", config_.dump());
    if (!wrote_weights_) testing::WriteFile(dir_ + "/model.safetensors", weights_);
    return Model::Load(dir_).status();
  }
  void WriteWeights(const std::string& bytes) {
    testing::WriteFile(dir_ + "/model.safetensors", bytes);
    wrote_weights_ = true;
  }
  void WriteHeader() { WriteWeights(testing::SafetensorsBytes(header_.dump(), data_)); }

  std::string src_, dir_, weights_, data_;
  json config_, header_;
  bool wrote_weights_ = false;
};

TEST_F(LoaderTest, ValidModelLoads) { EXPECT_TRUE(Load().ok()) << Load(); }

TEST_F(LoaderTest, MissingTensor) {
  header_.erase("layers.1.attn.k.weight");
  WriteHeader();
  const absl::Status s = Load();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("missing tensor 'layers.1.attn.k.weight'"));
  EXPECT_THAT(s.message(), HasSubstr("[64, 64]"));
}

TEST_F(LoaderTest, WrongShape) {
  // Same bytes, transposed shape claim for a non-square tensor.
  header_["layers.0.ffn.up.weight"]["shape"] = {64, 96};
  WriteHeader();
  const absl::Status s = Load();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'layers.0.ffn.up.weight' has shape [64, 96]"));
  EXPECT_THAT(s.message(), HasSubstr("requires [96, 64]"));
}

TEST_F(LoaderTest, WrongDtype) {
  header_["layers.0.attn.rel_k"]["dtype"] = "I32";
  WriteHeader();
  const absl::Status s = Load();
  EXPECT_THAT(s.message(), HasSubstr("'layers.0.attn.rel_k' has dtype I32; allowed: F32, F16, BF16"));
}

TEST_F(LoaderTest, UnexpectedTensor) {
  header_["extra.weight"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {data_.size(), data_.size() + 4}}};
  data_ += std::string(4, '\0');
  WriteHeader();
  EXPECT_THAT(Load().message(), HasSubstr("unexpected tensor 'extra.weight'"));
}

TEST_F(LoaderTest, TruncatedFile) {
  WriteWeights(weights_.substr(0, weights_.size() - 100));
  const absl::Status s = Load();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("past the end of the data"));
  WriteWeights(weights_.substr(0, 5));
  EXPECT_THAT(Load().message(), HasSubstr("truncated"));
  WriteWeights(weights_.substr(0, 200));
  EXPECT_THAT(Load().message(), HasSubstr("truncated"));
}

TEST_F(LoaderTest, HeaderOffsetsPastTheEnd) {
  header_["embed.weight"]["data_offsets"] = {data_.size() - 16, data_.size() + 76784};
  WriteHeader();
  EXPECT_THAT(Load().message(), HasSubstr("'embed.weight': data_offsets"));
}

TEST_F(LoaderTest, OffsetsDisagreeWithShape) {
  auto& off = header_["final_norm.bias"]["data_offsets"];
  off[1] = off[1].get<uint64_t>() - 4;
  WriteHeader();
  EXPECT_THAT(Load().message(), HasSubstr("'final_norm.bias': 252 bytes for 64 x F32"));
}

TEST_F(LoaderTest, AbsurdHeaderLength) {
  std::string bytes = weights_;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(0xff);
  bytes[7] = 0x0f;
  WriteWeights(bytes);
  EXPECT_THAT(Load().message(), HasSubstr("is absurd"));
}

TEST_F(LoaderTest, HeaderNotJson) {
  WriteWeights(testing::SafetensorsBytes("{not json", data_));
  EXPECT_THAT(Load().message(), HasSubstr("header is not a JSON object"));
}

TEST_F(LoaderTest, UnknownScheme) {
  config_["relative_attention"]["scheme"] = "rope";
  const absl::Status s = Load();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'relative_attention.scheme' is \"rope\"; allowed: none, skew, "
                                     "skew_local, shaw, t5, alibi"));
}

TEST_F(LoaderTest, DModelNotDivisibleByHeads) {
  config_.erase("head_dim");
  config_["n_heads"] = 5;
  EXPECT_THAT(Load().message(), HasSubstr("'d_model' (64) is not divisible by n_heads (5)"));
}

TEST_F(LoaderTest, ConfigSizesDisagreeWithTensors) {
  config_["ffn_dim"] = 128;  // tensors were written for 96
  EXPECT_THAT(Load().message(), HasSubstr("'layers.0.ffn.up.weight' has shape [96, 64]; the config requires [128, 64]"));
}

TEST_F(LoaderTest, ParameterOfAnotherScheme) {
  config_["relative_attention"]["clip"] = 4;
  EXPECT_THAT(Load().message(), HasSubstr("'relative_attention.clip' applies only to scheme shaw"));
}

TEST_F(LoaderTest, MissingSchemeParameter) {
  config_["relative_attention"].erase("max_relative_position");
  EXPECT_THAT(Load().message(), HasSubstr("'relative_attention.max_relative_position' is required"));
}

TEST_F(LoaderTest, FloatThatVanishesAsAFloat) {
  config_["norm_eps"] = 1e-50;  // positive as a double, 0 as the float the kernels use
  EXPECT_THAT(Load().message(), HasSubstr("'norm_eps' is 1e-50; must be a normal float > 0"));
  config_["norm_eps"] = 1e-5;
  config_["attention_scale"] = 1e50;  // inf as a float
  EXPECT_THAT(Load().message(), HasSubstr("'attention_scale' is 1e+50; must be a normal float > 0"));
}

TEST_F(LoaderTest, EmptyTensorsConvertOnlyWhenFloat) {
  // [0]-shaped tensors hold no bytes: floats convert to nothing, integers are still refused.
  const std::string bytes = std::string("\x6b\0\0\0\0\0\0\0", 8) +
      R"({"f":{"dtype":"F16","shape":[0],"data_offsets":[0,0]},"i":{"dtype":"I64","shape":[0],"data_offsets":[0,0]}})";
  auto f = SafetensorsFile::FromBuffer("empty", reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(ToFloat32(*(*f)->Find("f")).ok());
  EXPECT_EQ(ToFloat32(*(*f)->Find("f"))->size(), 0u);
  EXPECT_FALSE(ToFloat32(*(*f)->Find("i")).ok());
}

TEST_F(LoaderTest, UnknownKey) {
  config_["n_head"] = 4;
  EXPECT_THAT(Load().message(), HasSubstr("unknown key 'n_head'"));
}

TEST_F(LoaderTest, SpecialTokenOutsideVocabulary) {
  config_["eos_token_id"] = 300;
  EXPECT_THAT(Load().message(), HasSubstr("'eos_token_id' is 300; allowed 0..299"));
}

TEST_F(LoaderTest, NegativeSize) {
  config_["n_layers"] = -2;
  EXPECT_THAT(Load().message(), HasSubstr("'n_layers' is -2; allowed 1..1024"));
}

TEST_F(LoaderTest, T5MaxDistanceNotAboveExactRange) {
  config_["relative_attention"] = {{"scheme", "t5"}, {"num_buckets", 32}, {"max_distance", 16},
                                   {"scale_with_qk", false}};
  EXPECT_THAT(Load().message(), HasSubstr("'relative_attention.max_distance' is 16; allowed 17.."));
}

TEST_F(LoaderTest, MissingFiles) {
  EXPECT_EQ(Model::Load(dir_ + "/nowhere").status().code(), absl::StatusCode::kNotFound);
  testing::WriteFile(dir_ + "/config.json", config_.dump());
  EXPECT_EQ(Model::Load(dir_).status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, NotJson) {
  EXPECT_THAT(ParseModelConfig("{").status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseModelConfig("[1]").status().message(), HasSubstr("must be a JSON object"));
}

}  // namespace
}  // namespace relgen
