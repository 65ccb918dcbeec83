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

#include "kernels/cpu/thread_pool.h"

namespace relgen::cpu {

// How the packed weights are stored. The arithmetic is float32 in every case: bf16 elements are
// widened exactly; int8 elements are widened, accumulated, and the sum multiplied by the output
// channel's scale (symmetric, max |w| / 127 per output) before the bias.
enum class WeightType { kF32, kBf16, kInt8 };
const char* WeightTypeName(WeightType t);  // "f32", "bf16", "int8"
bool ParseWeightType(const std::string& name, WeightType* t);
int WeightTypeBytes(WeightType t);

// W [n, k] repacked into panels of 16 outputs, [panels][k][16], zero-padded; 64-byte aligned.
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
    return data_.get() + static_cast<int64_t>(p) * k_ * kPanel * WeightTypeBytes(type_);
  }
  // int8: one scale per output, padded to whole panels; empty otherwise.
  const float* scales() const { return scales_.empty() ? nullptr : scales_.data(); }
  int64_t bytes() const {
    return static_cast<int64_t>(panels()) * k_ * kPanel * WeightTypeBytes(type_) +
           static_cast<int64_t>(scales_.size()) * sizeof(float);
  }

 private:
  struct Free {
    void operator()(char* p) const;
  };
  int n_ = 0, k_ = 0;
  WeightType type_ = WeightType::kF32;
  std::unique_ptr<char, Free> data_;
  std::vector<float> scales_;
};

// The instruction sets the packed GEMM has a kernel for. The arithmetic of an output element is
// the same chain of multiply-adds in each, but whether they are fused differs (AVX2 and AVX-512
// fuse, the baseline does not): a process uses one, the best its CPU runs.
enum class GemmIsa { kAvx512, kAvx2, kBase };
std::vector<GemmIsa> SupportedGemmIsas();  // best first
const char* GemmIsaName(GemmIsa isa);

// y [rows, w.n()] = x [rows, w.k()] * W^T (+ bias [w.n()] when not null). `pool` may be null.
void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool);
// The same with a given kernel (tests; `isa` must be supported).
void LinearPacked(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y,
                  ThreadPool* pool, GemmIsa isa);

}  // namespace relgen::cpu
