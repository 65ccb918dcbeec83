// LoRA adapters on the device: the resident slots (loaded on demand, least recently used first out)
// and their terms added to the projections of the rows that name them (cuda::LoraAdd).
#include <algorithm>
#include <tuple>
#include <utility>

#include "engine/backends/cuda_backend_impl.h"

namespace relgen {
namespace cuda_backend {

absl::Status CudaBackend::ConfigureLora(int max_loras, int max_rank) {
  if (max_loras < 1 || max_rank < 1 || max_rank > cuda::kLoraMaxRank) {
    return absl::InvalidArgumentError(absl::StrCat("max_loras ", max_loras, ", max_lora_rank ", max_rank,
                                                   "; max_loras must be >= 1 and max_lora_rank within 1..",
                                                   cuda::kLoraMaxRank));
  }
  if (!lora_host_.empty()) return absl::FailedPreconditionError("LoRA slots are configured already");
  RELGEN_CUDA_RETURN(cudaSetDevice(device_));
  const ModelConfig& c = model_->config();
  const int d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
  // Every projection an adapter may adapt gets a column; its place in a slot is sized for max_rank.
  lora_columns_ = 0;
  lora_matrix_.clear();
  int64_t floats = 0;
  auto columns = [&](const std::string& stack, std::vector<DeviceLayer>& layers) {
    for (size_t l = 0; l < layers.size(); ++l) {
      DeviceLayer& L = layers[l];
      const std::string p = absl::StrCat(stack, "layers.", l, ".");
      for (auto [suffix, m, in, out] : {std::tuple{"attn.q", &L.q, d, w}, {"attn.k", &L.k, d, w},
                                        {"attn.v", &L.v, d, w}, {"attn.o", &L.o, w, d}, {"ffn.up", &L.up, d, f},
                                        {"ffn.gate", &L.gate, d, f}, {"ffn.down", &L.down, f, d},
                                        {"cross.q", &L.cq, d, w}, {"cross.k", &L.ck, d, w},
                                        {"cross.v", &L.cv, d, w}, {"cross.o", &L.co, w, d}}) {
        if (m->f32 == nullptr && m->bf16 == nullptr) continue;
        m->lora = lora_columns_++;
        lora_matrix_[absl::StrCat(p, suffix, ".weight")] = {m->lora, in, out, floats};
        floats += int64_t{max_rank} * (in + out);
      }
    }
  };
  columns("", layers_);
  columns("encoder.", encoder_layers_);
  lora_slot_floats_ = floats;
  max_lora_rank_ = max_rank;
  const int64_t weights = int64_t{max_loras} * floats * static_cast<int64_t>(sizeof(float));
  absl::Status st = lora_weights_.Reserve(static_cast<size_t>(weights));
  if (st.ok()) st = lora_table_.Reserve(size_t{sizeof(cuda::LoraDesc)} * max_loras * lora_columns_);
  if (!st.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "LoRA: ", max_loras, " slots of ", floats * 4 >> 20, " MiB each (every adaptable projection at rank ", max_rank,
        ") do not fit on the device (", st.message(),
        "); lower --max_loras or --max_lora_rank, or leave room with --kv_cache_memory_fraction"));
  }
  lora_host_.assign(size_t(max_loras) * lora_columns_, cuda::LoraDesc{});
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(lora_table_.ptr, lora_host_.data(), lora_host_.size() * sizeof(cuda::LoraDesc),
                                     cudaMemcpyHostToDevice, stream_));
  RELGEN_CUDA_RETURN(cudaStreamSynchronize(stream_));
  lora_residency_.Reset(max_loras);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> CudaBackend::LoraSlots(absl::Span<const SequenceStep> steps) {
  return lora_residency_.Assign(steps, [this](int s, const LoraAdapter& a) { return LoadLora(s, a); });
}

// The copies land after every launch enqueued before them, so a step still in flight that used
// this slot's last adapter reads it whole.
absl::Status CudaBackend::LoadLora(int s, const LoraAdapter& a) {
  cuda::LoraDesc* column = lora_host_.data() + int64_t{s} * lora_columns_;
  std::fill_n(column, lora_columns_, cuda::LoraDesc{});
  float* const slot_at = lora_weights_.f() + s * lora_slot_floats_;
  for (const auto& [name, lw] : a.targets) {
    auto m = lora_matrix_.find(name);
    // The loader checked each shape against the base; a slot's places are sized by the same, and a
    // mismatch here would write past them.
    if (m == lora_matrix_.end() || m->second.in != lw.in || m->second.out != lw.out || lw.rank > max_lora_rank_) {
      return absl::InvalidArgumentError(absl::StrCat("adapter '", a.name, "' adapts ", name, " at rank ", lw.rank,
                                                     ", which this backend's LoRA slots do not hold"));
    }
    float* const at = slot_at + m->second.offset;
    const int64_t a_floats = int64_t{lw.rank} * lw.in;
    RELGEN_CUDA_RETURN(cudaMemcpyAsync(at, lw.a.data(), a_floats * sizeof(float), cudaMemcpyHostToDevice, stream_));
    RELGEN_CUDA_RETURN(
        cudaMemcpyAsync(at + a_floats, lw.b.data(), lw.b.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    column[m->second.column] = cuda::LoraDesc{at, at + a_floats, lw.rank, lw.scale};
  }
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(static_cast<cuda::LoraDesc*>(lora_table_.ptr) + int64_t{s} * lora_columns_, column,
                                     lora_columns_ * sizeof(cuda::LoraDesc), cudaMemcpyHostToDevice, stream_));
  // The table's host column is rewritten by the next load into this slot: wait until it is up
  // (loads are rare, a step's adapters mostly resident).
  RELGEN_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::ApplyLora(const float* x, int rows, int in, const DeviceMatrix& m, int out, float* y) {
  if (lora_rows_ == nullptr || m.lora < 0) return absl::OkStatus();
  RELGEN_CUDA_RETURN(cuda::LoraAdd(x, rows, in, out, static_cast<const cuda::LoraDesc*>(lora_table_.ptr) + m.lora,
                                   lora_columns_, lora_rows_, y, stream_));
  return absl::OkStatus();
}

}  // namespace cuda_backend
}  // namespace relgen
