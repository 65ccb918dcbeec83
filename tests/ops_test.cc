// Dense CPU kernels: the decoder's batch invariance rests on a GEMM row being independent of how
// many rows are computed with it; norms and activations against direct formulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
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
      // int8 also rounds the input to steps of max |x| / 127: each product errs by at most
      // |w| dx + |x| dw + dx dw.
      double bound = 0, amax = 0, xmax = 0;
      for (int i = 0; i < in; ++i) amax = std::max(amax, std::fabs(double(w[size_t(o) * in + i])));
      for (int i = 0; i < in; ++i) xmax = std::max(xmax, std::fabs(double(x[i])));
      for (int i = 0; i < in; ++i) {
        const double wi = std::fabs(double(w[size_t(o) * in + i]));
        if (t == cpu::WeightType::kBf16) {
          bound += std::fabs(double(x[i])) * 0.5 * wi * 2 * rel;
        } else {
          const double dw = 0.5 * amax * rel, dx = 0.5 * xmax * rel;
          bound += std::fabs(double(x[i])) * dw + wi * dx + dx * dw;
        }
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

// Every float kernel this CPU runs (the best is what the engine uses) and f32 / bf16 storage: a
// row's bits do not depend on how many rows share the call or where it sits, and each row matches
// a float64 product with the weights as stored (plus the bias).
TEST(LinearTest, PackedRowsAreBitwiseIndependentOfRowCount) {
  cpu::ThreadPool pool(2);
  for (cpu::WeightType t : {cpu::WeightType::kF32, cpu::WeightType::kBf16}) {
    for (cpu::GemmIsa isa : cpu::SupportedGemmIsas()) {
      SCOPED_TRACE(std::string(cpu::WeightTypeName(t)) + " " + cpu::GemmIsaName(isa));
      for (auto [in, out] : {std::pair{320, 700}, std::pair{64, 96}, std::pair{37, 5}, std::pair{512, 1536}}) {
        const std::vector<float> w = Random(size_t(in) * out, 1), b = Random(out, 2);
        std::vector<double> scale;
        const std::vector<double> dq = Dequantized(w, out, in, t, &scale);
        const cpu::PackedMatrix packed(w.data(), out, in, t);
        EXPECT_EQ(packed.bytes(), int64_t((out + 15) / 16) * 16 * (t == cpu::WeightType::kBf16 ? (in + 31) / 32 * 32 : in) *
                                      cpu::WeightTypeBytes(t));
        for (int rows : {1, 2, 3, 7, 8, 9, 13, 14, 16, 33, 130, 300}) {
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

// The bf16 dot kernels (those this CPU has, and AMX's emulated on any): every row against float64
// on the rounded operands (inputs and weights each rounded to bf16, nearest even), bitwise the same
// whatever the number of rows in the call; odd depths included.
TEST(LinearTest, Bf16DotMatchesFloat64OnTheRoundedOperands) {
  cpu::ThreadPool pool(2);
  std::vector<cpu::Bf16Isa> isas = cpu::SupportedBf16Isas();
  isas.push_back(cpu::Bf16Isa::kAmxEmulated);
  for (cpu::Bf16Isa isa : isas) {
    SCOPED_TRACE(cpu::Bf16IsaName(isa));
    const bool emulated = isa == cpu::Bf16Isa::kAmxEmulated;  // scalar tiles: smaller shapes
    const std::vector<std::pair<int, int>> shapes =
        emulated ? std::vector<std::pair<int, int>>{{320, 70}, {64, 96}, {37, 5}, {513, 40}}
                 : std::vector<std::pair<int, int>>{{320, 700}, {64, 96}, {37, 5}, {513, 1536}};
    for (auto [in, out] : shapes) {
      const std::vector<float> w = Random(size_t(in) * out, 31), b = Random(out, 32);
      const cpu::PackedMatrix packed(w.data(), out, in, cpu::WeightType::kBf16);
      for (int rows : emulated ? std::vector<int>{1, 3, 17, 40} : std::vector<int>{1, 2, 3, 9, 17, 130}) {
        const std::vector<float> x = Random(size_t(rows) * in, 200 + rows);
        std::vector<float> all(size_t(rows) * out), one(out);
        cpu::LinearBf16Dot(x.data(), rows, packed, b.data(), all.data(), &pool, isa);
        double moved = 0;  // from the float32-input product: the inputs' rounding in effect
        for (int r = 0; r < rows; ++r) {
          cpu::LinearBf16Dot(x.data() + size_t(r) * in, 1, packed, b.data(), one.data(), nullptr, isa);
          ASSERT_EQ(std::memcmp(one.data(), all.data() + size_t(r) * out, out * sizeof(float)), 0) << "row " << r;
          for (int o = 0; o < out; ++o) {
            double acc = 0, exact_x = 0, mag = 0;
            for (int i = 0; i < in; ++i) {
              const double wi = testing::Bf16Value(w[size_t(o) * in + i]), xi = x[size_t(r) * in + i];
              acc += testing::Bf16Value(float(xi)) * wi;
              exact_x += xi * wi;
              mag += std::fabs(xi * wi);
            }
            ASSERT_NEAR(one[o], acc + b[o], 2e-6 * (mag + std::fabs(b[o])) + 1e-6) << in << "->" << out << " " << r << "," << o;
            moved = std::max(moved, std::fabs(acc - exact_x));
          }
        }
        EXPECT_GT(moved, 0);
      }
    }
  }
  // The engine's kernel is the best one.
  if (!cpu::Bf16DotSupported()) return;
  const std::vector<float> w = Random(64 * 48, 8), x = Random(5 * 64, 9);
  const cpu::PackedMatrix packed(w.data(), 48, 64, cpu::WeightType::kBf16);
  std::vector<float> best(5 * 48), dflt(5 * 48);
  cpu::LinearBf16Dot(x.data(), 5, packed, nullptr, best.data(), nullptr, cpu::SupportedBf16Isas().front());
  cpu::LinearBf16Dot(x.data(), 5, packed, nullptr, dflt.data(), nullptr);
  EXPECT_EQ(std::memcmp(best.data(), dflt.data(), best.size() * sizeof(float)), 0);
}

// The AMX-BF16 kernel's blocking, bitwise, against tdpbf16ps's definition applied here to whole
// rows: k zero-padded to steps of 32 values; per step and output, the even-indexed and the
// odd-indexed products each summed in a float32 FMA chain from zero, the two chains added, that
// added to the output's sum; the bias added last. (Random normal data: no denormals to flush.)
TEST(LinearTest, AmxBf16BlockingComputesTheTileDefinition) {
  cpu::ThreadPool pool(2);
  for (auto [in, out] : {std::pair{37, 5}, std::pair{64, 33}, std::pair{100, 48}, std::pair{161, 17}}) {
    const std::vector<float> w = Random(size_t(in) * out, 41), b = Random(out, 42);
    const cpu::PackedMatrix packed(w.data(), out, in, cpu::WeightType::kBf16);
    for (int rows : {1, 15, 16, 17, 40, 129}) {
      for (bool with_bias : {true, false}) {
        const std::vector<float> x = Random(size_t(rows) * in, 300 + rows);
        std::vector<float> y(size_t(rows) * out);
        cpu::LinearBf16Dot(x.data(), rows, packed, with_bias ? b.data() : nullptr, y.data(), rows > 16 ? &pool : nullptr,
                           cpu::Bf16Isa::kAmxEmulated);
        for (int r = 0; r < rows; ++r) {
          for (int o = 0; o < out; ++o) {
            float sum = 0;
            for (int s = 0; s < in; s += 32) {
              float chain[2] = {0, 0};
              for (int i = s; i < s + 32; ++i) {
                const float xi = i < in ? float(testing::Bf16Value(x[size_t(r) * in + i])) : 0.0f;
                const float wi = i < in ? float(testing::Bf16Value(w[size_t(o) * in + i])) : 0.0f;
                chain[i % 2] = std::fma(xi, wi, chain[i % 2]);
              }
              sum = sum + (chain[0] + chain[1]);
            }
            if (with_bias) sum = sum + b[o];
            ASSERT_EQ(y[size_t(r) * out + o], sum) << in << "->" << out << " rows " << rows << " row " << r << " out " << o;
          }
        }
      }
    }
  }
}

// The int8 definition, written apart from the kernels: an input row becomes q = round(x * 127 /
// max |x|) (ties to even), a weight row round(w / (max |w| / 127)); the output is the exact integer
// sum of q_x * q_w, times (max |x| / 127) * (max |w| / 127), plus the bias in one rounding.
struct Int8Reference {
  std::vector<int> qw;       // [out][in]
  std::vector<float> wscale;  // [out]
  int in, out;
  Int8Reference(const std::vector<float>& w, int out_, int in_) : in(in_), out(out_) {
    qw.resize(size_t(out) * in);
    wscale.resize(out);
    for (int o = 0; o < out; ++o) {
      float amax = 0;
      for (int i = 0; i < in; ++i) amax = std::max(amax, std::fabs(w[size_t(o) * in + i]));
      wscale[o] = amax > 0 ? amax / 127.0f : 1.0f;
      for (int i = 0; i < in; ++i) qw[size_t(o) * in + i] = int(std::nearbyint(w[size_t(o) * in + i] / wscale[o]));
    }
  }
  // Row r's outputs; `sums` gets the exact integer sums.
  std::vector<float> Row(const float* x, const float* bias, std::vector<int64_t>* sums) const {
    float amax = 0;
    for (int i = 0; i < in; ++i) amax = std::max(amax, std::fabs(x[i]));
    std::vector<int> qx(in, 0);
    for (int i = 0; i < in && amax > 0; ++i) qx[i] = int(std::nearbyint(x[i] * (127.0f / amax)));
    const float xscale = amax / 127.0f;
    std::vector<float> y(out);
    sums->assign(out, 0);
    for (int o = 0; o < out; ++o) {
      int64_t s = 0;
      for (int i = 0; i < in; ++i) s += int64_t{qx[i]} * qw[size_t(o) * in + i];
      (*sums)[o] = s;
      const float scale = xscale * wscale[o];
      y[o] = bias != nullptr ? std::fma(float(s), scale, bias[o]) : float(s) * scale;
    }
    return y;
  }
};

// Every int8 kernel this CPU runs gives the definition's bits for every row, whatever the number
// of rows in the call, with and without a bias and a pool; depths not a multiple of 4 (or of 64,
// the tile step) included.
TEST(LinearTest, Int8KernelsComputeTheIntegerDefinitionExactly) {
  cpu::ThreadPool pool(2);
  const std::vector<cpu::Int8Isa> supported = cpu::SupportedInt8Isas();
  ASSERT_EQ(supported.back(), cpu::Int8Isa::kBase);
  std::vector<cpu::Int8Isa> isas = supported;
  // The AMX kernel's blocking (16-row tiles, 64-byte steps and a shorter last one, pairs of panels)
  // with its tile instructions in C++, wherever AVX-512 VNNI runs.
  if (std::find(isas.begin(), isas.end(), cpu::Int8Isa::kAvx512Vnni) != isas.end()) {
    isas.push_back(cpu::Int8Isa::kAmxEmulated);
  }
  for (auto [in, out] : {std::pair{320, 700}, std::pair{64, 96}, std::pair{37, 5}, std::pair{513, 1536}, std::pair{6, 33}}) {
    const std::vector<float> w = Random(size_t(in) * out, 11), b = Random(out, 12);
    const Int8Reference ref(w, out, in);
    const cpu::PackedMatrix packed(w.data(), out, in, cpu::WeightType::kInt8);
    const int k4 = (in + 3) / 4 * 4, np = (out + 15) / 16;
    EXPECT_EQ(packed.bytes(), int64_t(np) * 16 * k4 + np * 16 * 8);
    for (int p = 0; p < np * 16; ++p) {  // the offsets: 128 x each output's weight sum
      int64_t sum = 0;
      for (int i = 0; p < out && i < in; ++i) sum += ref.qw[size_t(p) * in + i];
      ASSERT_EQ(packed.offsets()[p], 128 * sum) << p;
    }
    for (int rows : {1, 2, 3, 5, 8, 9, 13, 33, 70}) {
      std::vector<float> x = Random(size_t(rows) * in, 100 + rows);
      if (rows == 3) std::fill(x.begin() + in, x.begin() + 2 * in, 0.0f);  // a zero row: the bias alone
      std::vector<std::vector<float>> want(rows), want_nb(rows);
      int64_t largest = 0;
      for (int r = 0; r < rows; ++r) {
        std::vector<int64_t> sums;
        want[r] = ref.Row(x.data() + size_t(r) * in, b.data(), &sums);
        want_nb[r] = ref.Row(x.data() + size_t(r) * in, nullptr, &sums);
        for (int64_t s : sums) largest = std::max(largest, s < 0 ? -s : s);
      }
      ASSERT_GT(largest, 0);
      for (cpu::Int8Isa isa : isas) {
        SCOPED_TRACE(std::string(cpu::Int8IsaName(isa)) + " " + std::to_string(in) + " -> " + std::to_string(out) +
                     ", rows " + std::to_string(rows));
        for (cpu::ThreadPool* tp : {&pool, static_cast<cpu::ThreadPool*>(nullptr)}) {
          std::vector<float> y(size_t(rows) * out), y_nb(size_t(rows) * out);
          cpu::LinearInt8(x.data(), rows, packed, b.data(), y.data(), tp, isa);
          cpu::LinearInt8(x.data(), rows, packed, nullptr, y_nb.data(), tp, isa);
          for (int r = 0; r < rows; ++r) {
            ASSERT_EQ(std::memcmp(y.data() + size_t(r) * out, want[r].data(), out * sizeof(float)), 0) << "row " << r;
            ASSERT_EQ(std::memcmp(y_nb.data() + size_t(r) * out, want_nb[r].data(), out * sizeof(float)), 0)
                << "row " << r << " without bias";
          }
        }
      }
    }
  }
  // The engine's entry point takes the best kernel; a row holding an infinity gives NaN outputs.
  const std::vector<float> w = Random(64 * 48, 8);
  std::vector<float> x = Random(2 * 64, 9);
  const cpu::PackedMatrix packed(w.data(), 48, 64, cpu::WeightType::kInt8);
  std::vector<float> best(2 * 48), dflt(2 * 48);
  cpu::LinearInt8(x.data(), 2, packed, nullptr, best.data(), nullptr, supported.front());
  cpu::LinearPacked(x.data(), 2, packed, nullptr, dflt.data(), nullptr);
  EXPECT_EQ(std::memcmp(best.data(), dflt.data(), best.size() * sizeof(float)), 0);
  x[70] = INFINITY;
  cpu::LinearPacked(x.data(), 2, packed, nullptr, dflt.data(), nullptr);
  EXPECT_EQ(std::memcmp(best.data(), dflt.data(), 48 * sizeof(float)), 0);
  for (int o = 0; o < 48; ++o) EXPECT_TRUE(std::isnan(dflt[48 + o])) << o;
}

// The full int8 range: inputs and weights of +-127 everywhere (the largest pair sums, where a
// saturating kernel would clip) give the exact sums.
TEST(LinearTest, Int8ExtremesAreExact) {
  const int in = 1024, out = 32;
  std::vector<float> w(size_t(in) * out), x(in);
  for (int i = 0; i < in; ++i) x[i] = (i % 3 == 0) ? -1.0f : 1.0f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = ((i / 7) % 2 == 0) ? 2.0f : -2.0f;
  const Int8Reference ref(w, out, in);
  std::vector<int64_t> sums;
  const std::vector<float> want = ref.Row(x.data(), nullptr, &sums);
  const cpu::PackedMatrix packed(w.data(), out, in, cpu::WeightType::kInt8);
  for (cpu::Int8Isa isa : cpu::SupportedInt8Isas()) {
    std::vector<float> y(out);
    cpu::LinearInt8(x.data(), 1, packed, nullptr, y.data(), nullptr, isa);
    EXPECT_EQ(std::memcmp(y.data(), want.data(), out * sizeof(float)), 0) << cpu::Int8IsaName(isa);
  }
}

// Calls back to back (workers still spinning) and after pauses (workers asleep): every index is
// run exactly once per call, whichever way a worker was woken; pools of 1 to 4 threads come and go.
TEST(ThreadPoolTest, EveryIndexOnceWhetherWorkersSpinOrSleep) {
  for (int threads : {1, 2, 3, 4}) {
    cpu::ThreadPool pool(threads);
    std::vector<std::atomic<int>> hits(64);
    for (int call = 0; call < 600; ++call) {
      const int n = call % 64;
      for (auto& h : hits) h.store(0);
      if (call % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      pool.ParallelFor(n, [&](int begin, int end) {
        for (int i = begin; i < end; ++i) hits[i].fetch_add(1);
      });
      for (int i = 0; i < 64; ++i) ASSERT_EQ(hits[i].load(), i < n ? 1 : 0) << threads << " threads, call " << call;
    }
  }
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

// Every width the CPU runs gives every element the same bits (inputs across the functions' ranges,
// lengths with and without a partial last group).
TEST(ActivationTest, EveryWidthGivesTheSameBits) {
  const std::vector<int> widths = cpu::ActivationWidths();
  ASSERT_EQ(widths.back(), 4);
  std::vector<float> x = Random(1000, 21);
  for (size_t i = 0; i < x.size(); ++i) x[i] *= (i % 5 == 0) ? 30.0f : 3.0f;
  for (cpu::Activation act : {cpu::Activation::kRelu, cpu::Activation::kGelu, cpu::Activation::kGeluTanh,
                              cpu::Activation::kSilu}) {
    for (int64_t n : {int64_t{1000}, int64_t{997}, int64_t{3}}) {
      std::vector<float> want(x.begin(), x.begin() + n);
      cpu::ActivateWithWidth(act, want.data(), n, 4);
      EXPECT_NE(std::memcmp(want.data(), x.data(), n * sizeof(float)), 0);
      for (int lanes : widths) {
        std::vector<float> got(x.begin(), x.begin() + n);
        cpu::ActivateWithWidth(act, got.data(), n, lanes);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << lanes << " lanes, n " << n;
      }
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
