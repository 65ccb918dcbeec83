// Row-invariant GEMM for the decoder's linear layers: y[rows, n] = x[rows, k] * W^T + bias.
// Every output element is one fixed chain of multiply-adds over k in the same order, whatever the
// number of rows and wherever the row sits, so a token's activations are bitwise the same whether
// it is computed alone, in a batch, in a prompt chunk or recomputed after preemption.
// (Vendor BLAS libraries pick kernels by shape and do not give this.)
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/thread_pool.h"

namespace relgen::cpu {

// W [n, k] repacked into panels of 16 outputs, [panels][k][16], zero-padded; 64-byte aligned.
class PackedMatrix {
 public:
  static constexpr int kPanel = 16;
  PackedMatrix() = default;
  PackedMatrix(const float* w, int n, int k);

  int n() const { return n_; }
  int k() const { return k_; }
  int panels() const { return (n_ + kPanel - 1) / kPanel; }
  const float* panel(int p) const { return data_.get() + static_cast<int64_t>(p) * k_ * kPanel; }
  int64_t bytes() const { return static_cast<int64_t>(panels()) * k_ * kPanel * sizeof(float); }

 private:
  struct Free {
    void operator()(float* p) const;
  };
  int n_ = 0, k_ = 0;
  std::unique_ptr<float, Free> data_;
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
