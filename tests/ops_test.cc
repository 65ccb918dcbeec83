// Dense CPU kernels: the decoder's batch invariance rests on a GEMM row being independent of how
// many rows are computed with it; norms and activations against direct formulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vmath.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// What a stored weight means, written apart from the kernel: bf16 is float32 rounded to nearest
// even in its top 16 bits; int8 is round(w / s) with s = max |row| / 127, meaning q * s.
std::vector<double> Dequantized(const std::vector<float>& w, int out, int in, cpu::WeightType t, std::vector<double>* scale) {
  std::vector<double> d(w.size());
  scale->assign(out, 1.0);
  for (int o = 0; o < out; ++o) {
    double amax = 0;
    for (int i = 0; i < in; ++i) amax = std::max(amax, std::fabs(double(w[size_t(o) * in + i])));
    const double s = float(float(amax) / 127.0f);
    for (int i = 0; i < in; ++i) {
      const float x = w[size_t(o) * in + i];
      if (t == cpu::WeightType::kF32) {
        d[size_t(o) * in + i] = x;
      } else if (t == cpu::WeightType::kBf16) {
        d[size_t(o) * in + i] = testing::Bf16Value(x);
      } else {
        (*scale)[o] = s;
        d[size_t(o) * in + i] = std::nearbyint(x / float(s));  // the quotient rounded to float first
      }
    }
  }
  return d;
}

// int8 and bf16 products stay near the float32 product (what they approximate).
TEST(LinearTest, LowPrecisionErrorIsBoundedByTheStep) {
  const int in = 512, out = 256;
  const std::vector<float> w = Random(size_t(in) * out, 3), x = Random(in, 4);
  std::vector<float> f32(out), lo(out);
  cpu::LinearPacked(x.data(), 1, cpu::PackedMatrix(w.data(), out, in), nullptr, f32.data(), nullptr);
  for (auto [t, rel] : {std::pair{cpu::WeightType::kBf16, 1.0 / 256}, std::pair{cpu::WeightType::kInt8, 1.0 / 127}}) {
    cpu::LinearPacked(x.data(), 1, cpu::PackedMatrix(w.data(), out, in, t), nullptr, lo.data(), nullptr);
    double worst = 0;
    for (int o = 0; o < out; ++o) {
      // |error| <= sum |x_i| * (half a step of w_i): bf16 steps are 2^-7 of |w_i| at most, int8's
      // are max |w| / 127.
      double bound = 0, amax = 0;
      for (int i = 0; i < in; ++i) amax = std::max(amax, std::fabs(double(w[size_t(o) * in + i])));
      for (int i = 0; i < in; ++i) {
        const double wi = std::fabs(double(w[size_t(o) * in + i]));
        bound += std::fabs(double(x[i])) * 0.5 * (t == cpu::WeightType::kBf16 ? wi * 2 * rel : amax * rel);
      }
      EXPECT_LE(std::fabs(double(lo[o]) - f32[o]), bound + 1e-4) << cpu::WeightTypeName(t) << " " << o;
      worst = std::max(worst, std::fabs(double(lo[o]) - f32[o]));
    }
    EXPECT_GT(worst, 0) << cpu::WeightTypeName(t) << " changed nothing";
  }
}

TEST(LinearTest, WeightTypeNames) {
  for (cpu::WeightType t : {cpu::WeightType::kF32, cpu::WeightType::kBf16, cpu::WeightType::kInt8}) {
    cpu::WeightType back;
    ASSERT_TRUE(cpu::ParseWeightType(cpu::WeightTypeName(t), &back));
    EXPECT_EQ(back, t);
  }
  cpu::WeightType unused;
  EXPECT_FALSE(cpu::ParseWeightType("fp16", &unused));
}

// Every kernel this CPU runs (the best is what the engine uses) and every weight storage: a row's
// bits do not depend on how many rows share the call or where it sits, and each row matches a
// float64 product with the weights as stored (the sum of x * q, times the scale, plus the bias).
TEST(LinearTest, PackedRowsAreBitwiseIndependentOfRowCount) {
  cpu::ThreadPool pool(2);
  for (cpu::WeightType t : {cpu::WeightType::kF32, cpu::WeightType::kBf16, cpu::WeightType::kInt8}) {
    for (cpu::GemmIsa isa : cpu::SupportedGemmIsas()) {
      SCOPED_TRACE(std::string(cpu::WeightTypeName(t)) + " " + cpu::GemmIsaName(isa));
      for (auto [in, out] : {std::pair{320, 700}, std::pair{64, 96}, std::pair{37, 5}, std::pair{512, 1536}}) {
        const std::vector<float> w = Random(size_t(in) * out, 1), b = Random(out, 2);
        std::vector<double> scale;
        const std::vector<double> dq = Dequantized(w, out, in, t, &scale);
        const cpu::PackedMatrix packed(w.data(), out, in, t);
        EXPECT_EQ(packed.bytes(), int64_t((out + 15) / 16) * 16 * in * cpu::WeightTypeBytes(t) +
                                      (t == cpu::WeightType::kInt8 ? (out + 15) / 16 * 16 * 4 : 0));
        for (int rows : {1, 2, 3, 7, 9, 13, 16, 33, 130, 300}) {
          const std::vector<float> x = Random(size_t(rows) * in, rows);
          std::vector<float> all(size_t(rows) * out), one(out);
          cpu::LinearPacked(x.data(), rows, packed, b.data(), all.data(), &pool, isa);
          for (int r = 0; r < rows; ++r) {
            cpu::LinearPacked(x.data() + size_t(r) * in, 1, packed, b.data(), one.data(), nullptr, isa);
            ASSERT_EQ(std::memcmp(one.data(), all.data() + size_t(r) * out, out * sizeof(float)), 0)
                << "row " << r << " of " << rows << " (" << in << " -> " << out << ")";
            if (r != rows - 1 && r % 16 != 0) continue;  // the values: a sample of rows (the bits are all checked)
            for (int o = 0; o < out; ++o) {
              double acc = 0, mag = 0;
              for (int i = 0; i < in; ++i) {
                acc += double(x[size_t(r) * in + i]) * dq[size_t(o) * in + i];
                mag += std::fabs(double(x[size_t(r) * in + i]) * dq[size_t(o) * in + i]);
              }
              const double want = acc * scale[o] + b[o];
              ASSERT_NEAR(one[o], want, 2e-6 * (mag * scale[o] + std::fabs(b[o])) + 1e-6) << r << "," << o;
            }
          }
        }
      }
    }
  }
  // The engine's kernel is the best one.
  const std::vector<float> w = Random(64 * 48, 8), x = Random(5 * 64, 9);
  const cpu::PackedMatrix packed(w.data(), 48, 64);
  std::vector<float> best(5 * 48), dflt(5 * 48);
  cpu::LinearPacked(x.data(), 5, packed, nullptr, best.data(), nullptr, cpu::SupportedGemmIsas().front());
  cpu::LinearPacked(x.data(), 5, packed, nullptr, dflt.data(), nullptr);
  EXPECT_EQ(std::memcmp(best.data(), dflt.data(), best.size() * sizeof(float)), 0);
}

TEST(LinearTest, BlasAgreesWithinRounding) {
  const int in = 64, out = 96, rows = 5;
  const std::vector<float> w = Random(size_t(in) * out, 3), x = Random(size_t(rows) * in, 4);
  std::vector<float> blas(size_t(rows) * out), packed(size_t(rows) * out);
  cpu::Linear(x.data(), rows, in, w.data(), nullptr, out, blas.data());
  cpu::LinearPacked(x.data(), rows, cpu::PackedMatrix(w.data(), out, in), nullptr, packed.data(), nullptr);
  for (size_t i = 0; i < blas.size(); ++i) ASSERT_NEAR(blas[i], packed[i], 1e-4);
}

TEST(NormTest, LayerNormAndRmsNorm) {
  const int rows = 3, dim = 37;
  const std::vector<float> x = Random(rows * dim, 5), w = Random(dim, 6), b = Random(dim, 7);
  std::vector<float> ln(rows * dim), rms(rows * dim);
  cpu::LayerNorm(x.data(), rows, dim, w.data(), b.data(), 1e-5f, ln.data());
  cpu::RmsNorm(x.data(), rows, dim, w.data(), 1e-6f, rms.data());
  for (int r = 0; r < rows; ++r) {
    double mean = 0, var = 0, ss = 0;
    for (int i = 0; i < dim; ++i) mean += x[r * dim + i];
    mean /= dim;
    for (int i = 0; i < dim; ++i) {
      var += (x[r * dim + i] - mean) * (x[r * dim + i] - mean);
      ss += x[r * dim + i] * x[r * dim + i];
    }
    var /= dim;
    for (int i = 0; i < dim; ++i) {
      EXPECT_NEAR(ln[r * dim + i], (x[r * dim + i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i], 1e-5);
      EXPECT_NEAR(rms[r * dim + i], x[r * dim + i] / std::sqrt(ss / dim + 1e-6) * w[i], 1e-5);
    }
  }
}

TEST(ActivationTest, Definitions) {
  const std::vector<float> x = {-3.0f, -0.5f, 0.0f, 0.7f, 2.5f};
  for (float v : x) {
    float r = v, g = v, t = v, s = v;
    cpu::Activate(cpu::Activation::kRelu, &r, 1);
    cpu::Activate(cpu::Activation::kGelu, &g, 1);
    cpu::Activate(cpu::Activation::kGeluTanh, &t, 1);
    cpu::Activate(cpu::Activation::kSilu, &s, 1);
    EXPECT_EQ(r, v > 0 ? v : 0.0f);
    EXPECT_NEAR(g, 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-6);
    EXPECT_NEAR(t, 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))), 1e-6);
    EXPECT_NEAR(s, v / (1 + std::exp(-v)), 1e-6);
  }
}

// The vector exp / erf / tanh against libm in double, over the ranges the kernels feed them; and
// an element's result is the same whatever its index in the array (no scalar tail path).
TEST(VectorMathTest, MatchesLibmAndIgnoresPosition) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto run = [](auto f, float x) {
    cpu::vmath::V4 v = cpu::vmath::Splat(x);
    return f(v)[0];
  };
  auto exp4 = [](cpu::vmath::V4 v) { return cpu::vmath::Exp(v); };
  auto erf4 = [](cpu::vmath::V4 v) { return cpu::vmath::Erf(v); };
  auto tanh4 = [](cpu::vmath::V4 v) { return cpu::vmath::Tanh(v); };
  double worst_exp = 0, worst_erf = 0, worst_tanh = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = 0.5f + 87.8f * u(rng);  // [-87.3, 88.3]: exp flushes to 0 below, saturates above
    const double e = std::exp(double{x});
    worst_exp = std::max(worst_exp, std::abs(run(exp4, x) - e) / e);
    const float y = 6.0f * u(rng);
    worst_erf = std::max(worst_erf, std::abs(run(erf4, y) - std::erf(double{y})));
    worst_tanh = std::max(worst_tanh, std::abs(run(tanh4, y) - std::tanh(double{y})));
  }
  EXPECT_LT(worst_exp, 2.5e-7) << "relative";
  EXPECT_LT(worst_erf, 6e-7);
  EXPECT_LT(worst_tanh, 3e-7);
  EXPECT_EQ(run(exp4, -INFINITY), 0.0f);
  EXPECT_EQ(run(exp4, -90.0f), 0.0f);
  EXPECT_EQ(run(exp4, 0.0f), 1.0f);
  EXPECT_TRUE(std::isfinite(run(exp4, 100.0f)));
  EXPECT_EQ(run(tanh4, 30.0f), 1.0f);
  EXPECT_EQ(run(erf4, -9.0f), -1.0f);
  for (cpu::Activation act :
       {cpu::Activation::kGelu, cpu::Activation::kGeluTanh, cpu::Activation::kSilu}) {
    std::vector<float> all = Random(11, 4);
    const std::vector<float> in = all;
    cpu::Activate(act, all.data(), static_cast<int64_t>(all.size()));
    for (size_t i = 0; i < in.size(); ++i) {
      float one = in[i];
      cpu::Activate(act, &one, 1);
      EXPECT_EQ(std::memcmp(&one, &all[i], sizeof(float)), 0) << "element " << i;
    }
  }
}

TEST(SoftmaxTest, MaskedEntriesGetZero) {
  std::vector<float> row = {1.0f, -INFINITY, 2.0f, -INFINITY};
  cpu::SoftmaxRows(row.data(), 1, 4, 4);
  EXPECT_EQ(row[1], 0.0f);
  EXPECT_EQ(row[3], 0.0f);
  EXPECT_NEAR(row[0], 1 / (1 + std::exp(1.0)), 1e-7);
  EXPECT_NEAR(row[0] + row[2], 1.0, 1e-7);
}

}  // namespace
}  // namespace relgen
