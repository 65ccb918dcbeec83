#include "engine/backends/device.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/backends/cpu_backend.h"
#if RELGEN_WITH_CUDA
#include "engine/backends/cuda_backend.h"
#endif

namespace relgen {

absl::StatusOr<DeviceOptions> ResolveDeviceOptions(const Model& model, DeviceOptions o, int* cuda_index) {
  int index = 0;
  if (o.device.rfind("cuda:", 0) == 0) {
    if (!absl::SimpleAtoi(o.device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--device ", o.device, ": expected cuda:N"));
    }
    o.device = "cuda";
  }
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--device ", o.device, ": allowed auto, cpu, cuda, cuda:N"));
  }
  if (o.device == "auto") {
#if RELGEN_WITH_CUDA
    o.device = CudaDeviceCount() > 0 ? "cuda" : "cpu";
#else
    o.device = "cpu";
#endif
  }
  if (cuda_index != nullptr) *cuda_index = index;
  if (o.cuda_gemm != "auto" && o.cuda_gemm != "invariant" && o.cuda_gemm != "cublas" && o.cuda_gemm != "mma") {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_gemm ", o.cuda_gemm, ": allowed auto, invariant, cublas, mma"));
  }
  if (o.cuda_attention != "simt" && o.cuda_attention != "mma") {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_attention ", o.cuda_attention, ": allowed simt, mma"));
  }
  const bool bf16_file = model.file_dtype() == DType::kBF16;
  const bool gpu = o.device == "cuda";
  if (o.weights_dtype == "auto") {
    // A GPU's decode streams the weights: bf16 halves the bytes (a float16 checkpoint is narrowed,
    // its range kept and three mantissa bits lost), whichever kernel multiplies them. The CPU
    // computes a bf16 checkpoint from bf16 weights and any other in float32.
    const bool narrow = gpu || bf16_file;
    o.weights_dtype = narrow ? "bf16" : "f32";
  }
  // relgen's float32-arithmetic projection kernel, measured at 62% of the floor for mpt-7b at batch
  // 1 with bf16 weights; the tensor cores' kernel (predicted as fast there and ~4x at batch 64,
  // docs/gpu-performance.md) stays opt-in until a GPU has timed it.
  if (o.cuda_gemm == "auto") o.cuda_gemm = "invariant";
  cpu::WeightType weights;
  if (!cpu::ParseWeightType(o.weights_dtype, &weights)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weights_dtype ", o.weights_dtype, ": allowed auto, f32, bf16, int8"));
  }
  if (o.activations_dtype == "auto") {
    // bf16 weights on a CPU with bf16 dot products (AMX-BF16, AVX-512 BF16) multiply bf16 inputs,
    // as the checkpoint's own frameworks do: twice float32's arithmetic, and on AMX 1.4-3x the
    // prefill and batched decode (docs/benchmarks.md; the accuracy there: bits/byte equal to five
    // decimals). Elsewhere rounding the inputs only slows the float32 kernel, and a GPU takes its
    // inputs' type from --cuda_gemm.
    o.activations_dtype = !gpu && weights == cpu::WeightType::kBf16 && cpu::Bf16DotSupported() ? "bf16" : "f32";
  }
  if (o.activations_dtype != "f32" && o.activations_dtype != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--activations_dtype ", o.activations_dtype, ": allowed auto, f32, bf16"));
  }
  if (gpu && o.activations_dtype != "f32") {
    return absl::InvalidArgumentError(
        "--activations_dtype bf16 is the CPU's; on a GPU --cuda_gemm mma multiplies bf16 inputs");
  }
  // A GPU's decode reads the whole cache each step: bf16 halves it. The CPU keeps a checkpoint's
  // precision unless asked.
  if (o.kv_cache_dtype == "auto") o.kv_cache_dtype = gpu || bf16_file ? "bf16" : "f32";
  cpu::KvType kv_type;
  if (!cpu::ParseKvType(o.kv_cache_dtype, &kv_type)) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_dtype ", o.kv_cache_dtype, ": allowed auto, f32, bf16"));
  }
  return o;
}

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(std::shared_ptr<const Model> model, const DeviceOptions& options) {
  const ModelConfig& c = model->config();
  int index = 0;
  auto resolved = ResolveDeviceOptions(*model, options, &index);
  if (!resolved.ok()) return resolved.status();
  const DeviceOptions& o = *resolved;
  const std::string& device = o.device;
  cpu::WeightType weights;
  cpu::KvType kv_type;
  cpu::ParseWeightType(o.weights_dtype, &weights);
  cpu::ParseKvType(o.kv_cache_dtype, &kv_type);
#if RELGEN_WITH_CUDA
  if (device == "cuda") {
    if (index >= CudaDeviceCount()) {
      return absl::UnavailableError(absl::StrCat("--device ", options.device, ": ", CudaDeviceCount(),
                                                 " CUDA devices are present; use --device cpu or auto"));
    }
    CudaOptions co;
    co.device = index;
    co.weight_type = weights;  // int8 refused by NewCudaBackend, naming the way out
    co.kv_type = kv_type;
    co.cublas_gemms = o.cuda_gemm == "cublas";
    co.tensor_cores = o.cuda_gemm == "mma";
    co.attention_tensor_cores = o.cuda_attention == "mma";
    co.attention_split_keys = o.cuda_split_keys;
    co.block_size = o.kv_block_size;
    // The default: most of what the weights, the largest step and the headroom leave.
    co.kv_memory_fraction = o.kv_cache_memory_fraction > 0 ? o.kv_cache_memory_fraction : kCudaKvDefaultFraction;
    co.max_step_tokens = o.max_step_tokens;
    co.max_step_seqs = o.max_step_seqs;
    co.max_step_encoder_tokens = o.max_step_encoder_tokens;
    if (o.kv_block_size < 1) return absl::InvalidArgumentError("KV block size must be >= 1");
    if (o.kv_cache_tokens > 0) {
      const int64_t blocks = (o.kv_cache_tokens + o.kv_block_size - 1) / o.kv_block_size;
      // An encoder-decoder sequence also holds its input's cross-attention K/V.
      const int64_t need =
          (c.encoder_decoder ? 2 : 1) * int64_t{(c.max_seq_len + o.kv_block_size - 1) / o.kv_block_size};
      if (blocks < need) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a device KV pool of ", blocks * o.kv_block_size, " tokens cannot hold one sequence of max_seq_len ",
            c.max_seq_len, c.encoder_decoder ? " (input and output)" : ""));
      }
      co.num_blocks = static_cast<int>(std::min<int64_t>(blocks, 1 << 30));
    }
    // With no token count the backend sizes the pool from what is free once the weights and the
    // largest step's buffers are on the device.
    return NewCudaBackend(std::move(model), co);
  }
#else
  if (device == "cuda") {
    return absl::UnavailableError("--device cuda: this build has no CUDA backend (built where nvcc was not found)");
  }
#endif
  auto blocks = CpuKvBlocks(c, o.kv_cache_tokens, o.kv_cache_memory_fraction, o.kv_block_size, kv_type,
                            o.max_step_seqs);
  if (!blocks.ok()) return blocks.status();
  return NewCpuBackend(std::move(model), KvCacheConfig{o.kv_block_size, *blocks}, o.threads, weights, kv_type,
                       o.activations_dtype == "bf16" ? ProjectionInputs::kBf16Dot : ProjectionInputs::kF32);
}

}  // namespace relgen
