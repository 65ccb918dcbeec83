// Row-invariant GEMM for the decoder's linear layers: y[rows, n] = x[rows, k] * W^T + bias.
// Every output element is one fixed chain of multiply-adds over k in the same order, whatever the
// number of rows and wherever the row sits, so a token's activations are bitwise the same whether
// it is computed alone, in a batch, in a prompt chunk or recomputed after preemption.
// (Vendor BLAS libraries pick kernels by shape and do not give this.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/storage_types.h"
#include "kernels/thread_pool.h"

namespace relgen::cpu {

// How the packed weights are stored. f32 and bf16 multiply in float32 (bf16 elements widened
// exactly). int8 multiplies in integers: the weights are symmetric int8 with a scale per output
// (max |w| / 127), each input row is quantised the same way with its own scale (so a row's result
// never depends on the rows beside it), the int8 x int8 products are summed exactly in int32, and
// the sum is scaled back in float32 (Int8Epilogue). Exact integers make every int8 kernel give the
// same bits on every CPU.

// W [n, k] repacked into panels of 16 outputs, zero-padded, 64-byte aligned: [panels][k][16] for
// f32; bf16 in pairs of inputs, [panels][kp / 2][16][2] with kp = k rounded up to 32, so one 32-bit
// lane holds an output's weights for inputs (2i, 2i + 1): the operand vdpbf16ps takes and the rows
// of an AMX-BF16 tile, read in place (the widening kernel splits a pair with a shift and a mask);
// int8 in groups of 4 inputs, [panels][k4 / 4][16][4] with k4 = k rounded up to 4, so one 32-bit
// lane holds an output's 4 consecutive weights (the VNNI dot product's operand).
class PackedMatrix {
 public:
  static constexpr int kPanel = 16;
  PackedMatrix() = default;
  PackedMatrix(const float* w, int n, int k, WeightType type = WeightType::kF32);
  // The same from rows produced one at a time: row_of(o, out) writes row o's k values to out (so a
  // stored matrix is packed without a float32 copy of the whole).
  PackedMatrix(int n, int k, WeightType type, const std::function<void(int row, float* out)>& row_of);

  int n() const { return n_; }
  int k() const { return k_; }
  WeightType type() const { return type_; }
  int panels() const { return (n_ + kPanel - 1) / kPanel; }
  // Panel p's elements, of type() (float, uint16_t bf16 bits or int8_t).
  const void* panel(int p) const {
    return data_.get() + static_cast<int64_t>(p) * padded_k() * kPanel * WeightTypeBytes(type_);
  }
  // The packed depth: k for float32; for int8 k rounded up to a multiple of 4; for bf16 to a
  // multiple of 32 (an AMX tile step), the padding zero.
  int padded_k() const {
    switch (type_) {
      case WeightType::kInt8: return (k_ + 3) / 4 * 4;
      case WeightType::kBf16: return (k_ + 31) / 32 * 32;
      case WeightType::kF32: break;
    }
    return k_;
  }
  // int8: one scale per output, padded to whole panels; empty otherwise.
  const float* scales() const { return scales_.empty() ? nullptr : scales_.data(); }
  // int8: 128 x the sum of each output's int8 weights (what an unsigned-input dot product adds).
  const int32_t* offsets() const { return offsets_.empty() ? nullptr : offsets_.data(); }
  int64_t bytes() const {
    return static_cast<int64_t>(panels()) * padded_k() * kPanel * WeightTypeBytes(type_) +
           static_cast<int64_t>(scales_.size()) * sizeof(float) + static_cast<int64_t>(offsets_.size()) * sizeof(int32_t);
  }

 private:
  struct Free {
    void operator()(char* p) const;
  };
  int n_ = 0, k_ = 0;
  WeightType type_ = WeightType::kF32;
  std::unique_ptr<char, Free> data_;
  std::vector<float> scales_;
  std::vector<int32_t> offsets_;
};

// The instruction sets the packed GEMM has a kernel for. The arithmetic of an output element is
// the same chain of multiply-adds in each, but whether they are fused differs (AVX2 and AVX-512
// fuse, the baseline does not): a process uses one, the best its CPU runs.
enum class GemmIsa { kAvx512, kAvx2, kBase };
std::vector<GemmIsa> SupportedGemmIsas();  // best first
const char* GemmIsaName(GemmIsa isa);

// The int8 kernels, by the instructions their dot products take: AMX-INT8 (tdpbusd on tiles of 16
// rows, the rest of the rows on AVX-512 VNNI), AVX-512 VNNI (vpdpbusd on 64 bytes), AVX-VNNI (the
// same on 32), AVX2 (vpsignb + vpmaddubsw + vpmaddwd, exact because no operand is -128), and plain
// C++. All compute the same integers. kAmxEmulated is the AMX kernel with its tile instructions
// written in C++ (tests; runs where AVX-512 VNNI does); SupportedInt8Isas never lists it.
enum class Int8Isa { kAmx, kAvx512Vnni, kAvxVnni, kAvx2, kBase, kAmxEmulated };
std::vector<Int8Isa> SupportedInt8Isas();  // best first
const char* Int8IsaName(Int8Isa isa);

// An int8 output: float(sum) * (x_scale * w_scale), plus the bias in one rounding when present.
inline float Int8Epilogue(int32_t sum, float x_scale, float w_scale, const float* bias) {
  const float s = x_scale * w_scale;
  return bias != nullptr ? __builtin_fmaf(static_cast<float>(sum), s, *bias) : static_cast<float>(sum) * s;
}

// bf16 weights times inputs rounded to bf16 (nearest even), float32 sums. kAmx: AMX-BF16's
// tdpbf16ps on 16-row tiles (gemm_bf16_amx_impl.h; every row on tiles, 32 k values a step: per
// output two float32 chains, the even and the odd products, added at the end of each step).
// kAvx512Bf16: vdpbf16ps (gemm_bf16.cc), the exact products of each pair of inputs added to a
// float32 sum, pair after pair in k order. Each is twice the arithmetic of float32 FMA; the two
// round differently, and one is chosen per process. kAmxEmulated is the AMX kernel with its tile
// instructions written in C++ (tests; runs on any CPU); SupportedBf16Isas never lists it.
enum class Bf16Isa { kAmx, kAvx512Bf16, kAmxEmulated };
std::vector<Bf16Isa> SupportedBf16Isas();  // best first; empty where the CPU has neither
const char* Bf16IsaName(Bf16Isa isa);
bool Bf16DotSupported();  // SupportedBf16Isas() is not empty
void LinearBf16Dot(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool);
// With a given kernel (tests; `isa` must be supported or emulated).
void LinearBf16Dot(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool,
                   Bf16Isa isa);
// AMX tiles with the operation whose CPUID leaf 7 EDX bit is given (22 AMX-BF16, 25 AMX-INT8), and
// Linux's leave to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, kernels from 5.16), asked once.
bool AmxUsable(int edx_bit);

// Memory as packed weights get it: from 2 MiB up, 2 MiB-aligned and advised for transparent huge
// pages (benchmarks probe bandwidth on the same kind of pages). Free with std::free.
char* AllocateWeights(size_t bytes);

// What LinearPacked computes with for weights of type t on this CPU, with the inputs rounded to
// bf16 first or not, e.g. "avx2 float32 FMA", "avx512-vnni int8 dot products" (the startup line);
// Bf16DotPathName likewise for LinearBf16Dot, e.g. "avx512-bf16 bf16 dot products".
std::string GemmPathName(WeightType t, bool bf16_inputs = false);
std::string Bf16DotPathName();

// y [rows, w.n()] = x [rows, w.k()] * W^T (+ bias [w.n()] when not null). `pool` may be null.
void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool);
// The same with a given kernel (tests; `isa` must be supported).
void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool, GemmIsa isa);
// int8 weights with a given kernel (tests; `isa` must be supported).
void LinearInt8(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool,
                Int8Isa isa);

}  // namespace relgen::cpu
