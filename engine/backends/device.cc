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

std::string AutoWeightsDtype(const Model& model, const std::string& cuda_gemm) {
  // bf16 weights compute exactly what a bf16 checkpoint stores, in half the bytes of float32, on
  // both devices (cuBLAS's projections take float32 only). float16 is widened: relgen has no float16
  // kernel, and bf16 would lose three of its mantissa bits.
  if (cuda_gemm == "mma") return "bf16";  // tensor cores multiply bf16
  return model.file_dtype() == DType::kBF16 && cuda_gemm != "cublas" ? "bf16" : "f32";
}

std::string AutoKvDtype(const Model& model) { return model.file_dtype() == DType::kBF16 ? "bf16" : "f32"; }

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(std::shared_ptr<const Model> model, const DeviceOptions& o) {
  const ModelConfig& c = model->config();
  std::string device = o.device;
  int index = 0;
  if (device.rfind("cuda:", 0) == 0) {
    if (!absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--device ", device, ": expected cuda:N"));
    }
    device = "cuda";
  }
  if (device != "auto" && device != "cpu" && device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--device ", o.device, ": allowed auto, cpu, cuda, cuda:N"));
  }
  cpu::WeightType weights;
  const std::string weights_dtype = o.weights_dtype == "auto" ? AutoWeightsDtype(*model, o.cuda_gemm) : o.weights_dtype;
  if (!cpu::ParseWeightType(weights_dtype, &weights)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weights_dtype ", o.weights_dtype, ": allowed auto, f32, bf16, int8"));
  }
  if (o.cuda_gemm != "invariant" && o.cuda_gemm != "cublas" && o.cuda_gemm != "mma") {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_gemm ", o.cuda_gemm, ": allowed invariant, cublas, mma"));
  }
  cpu::KvType kv_type;
  if (!cpu::ParseKvType(o.kv_cache_dtype == "auto" ? AutoKvDtype(*model) : o.kv_cache_dtype, &kv_type)) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_dtype ", o.kv_cache_dtype, ": allowed auto, f32, bf16"));
  }
#if RELGEN_WITH_CUDA
  if (device == "auto") device = CudaDeviceCount() > 0 ? "cuda" : "cpu";
  if (device == "cuda") {
    if (index >= CudaDeviceCount()) {
      return absl::UnavailableError(absl::StrCat("--device ", o.device, ": ", CudaDeviceCount(),
                                                 " CUDA devices are present; use --device cpu or auto"));
    }
    CudaOptions co;
    co.device = index;
    co.weight_type = weights;  // int8 refused by NewCudaBackend, naming the way out
    co.kv_type = kv_type;
    co.cublas_gemms = o.cuda_gemm == "cublas";
    co.tensor_cores = o.cuda_gemm == "mma";
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
  return NewCpuBackend(std::move(model), KvCacheConfig{o.kv_block_size, *blocks}, o.threads, weights, kv_type);
}

}  // namespace relgen
