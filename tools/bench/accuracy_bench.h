// relgen-bench accuracy: what storing the dense weights in bf16 or int8 (or multiplying them on
// tensor cores), and the K/V cache in bf16, costs against float32 on the same model: logit error, greedy agreement, and bits per byte on
// held-out fortunes.
#pragma once

#include <string>
#include <vector>

#include "engine/backends/cpu_backend.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"

namespace relgen::bench {

// How the projections multiply: the weights' storage and their inputs. "mma": bf16 weights times
// activations rounded to bf16 (the CUDA backend's tensor cores, --cuda_gemm mma), computed on the
// CPU twin; "bf16-dot": the same product through AMX-BF16 or AVX-512 BF16 dot products where the CPU has them
// (--activations_dtype bf16 with bf16 weights).
struct AccuracyWeights {
  cpu::WeightType type = cpu::WeightType::kF32;
  ProjectionInputs inputs = ProjectionInputs::kF32;
};
bool ParseAccuracyWeights(const std::string& name, AccuracyWeights* w);  // f32, bf16, int8, mma or bf16-dot

struct AccuracyOptions {
  std::string model;
  // Every combination of these is compared with f32 weights and an f32 cache.
  std::vector<AccuracyWeights> weights = {
      {cpu::WeightType::kF32}, {cpu::WeightType::kBf16}, {cpu::WeightType::kBf16, ProjectionInputs::kBf16},
      {cpu::WeightType::kInt8}};
  std::vector<cpu::KvType> kv_types = {cpu::KvType::kF32, cpu::KvType::kBf16};
  std::string fortunes = "/usr/share/games/fortunes";  // held out: every 20th fortune, as tools/train.py
  int window = 256;      // tokens per held-out window (as tools/train.py scores them)
  int max_windows = 0;   // 0: all of the held-out text
  int greedy_tokens = 1000;
  int threads = 0;
  std::string json_out;
};

int RunAccuracyBench(const AccuracyOptions& options);

}  // namespace relgen::bench
