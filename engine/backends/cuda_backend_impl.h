// The CUDA backend's class, shared by the files that implement it by job: cuda_backend.cc (Init,
// the weights' upload, the step buffers, launching), cuda_step_inputs.cc (a step's rows packed and
// uploaded), cuda_decoder.cc (the decoder's operations for WalkDecoder, the encoder), cuda_lora.cc
// (LoRA adapters' slots and terms), cuda_sampler.cc (answering rows on the device) and
// cuda_graphs.cc (decode steps as CUDA graphs). Internal to them: the engine sees cuda_backend.h
// only.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backends/cuda_backend.h"
#include "engine/backends/step_sync.h"
#include "kernels/thread_pool.h"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/sampler_kernels.h"

namespace relgen {
namespace cuda_backend {

inline absl::Status CudaStatus(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  // The runtime also keeps a failed call's error as the thread's last error; consume it here, or the
  // next kernel wrapper's cudaGetLastError() reports it again (a failed allocation in one Forward
  // failed the next request's first launch). Sticky errors stay.
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, " at ", file, ":", line, ": ", cudaGetErrorString(e)));
}
inline absl::Status CublasStatus(cublasStatus_t e, const char* what, const char* file, int line) {
  if (e == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, " at ", file, ":", line, ": cuBLAS status ", static_cast<int>(e)));
}

#define RELGEN_CUDA_RETURN(expr)                                                    \
  do {                                                                              \
    if (absl::Status _s = CudaStatus((expr), #expr, __FILE__, __LINE__); !_s.ok()) { \
      return _s;                                                                    \
    }                                                                               \
  } while (0)
#define RELGEN_CUBLAS_RETURN(expr)                                                    \
  do {                                                                                \
    if (absl::Status _s = CublasStatus((expr), #expr, __FILE__, __LINE__); !_s.ok()) { \
      return _s;                                                                      \
    }                                                                                 \
  } while (0)

// A buffer that grows and never shrinks: device memory, or page-locked host memory (`kPinned`),
// which copies from and into run asynchronously, at the link's speed.
template <bool kPinned>
struct GrowingBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  ~GrowingBuffer() { Release(); }
  absl::Status Reserve(size_t n) {
    if (n <= bytes) return absl::OkStatus();
    Release();
    RELGEN_CUDA_RETURN(kPinned ? cudaMallocHost(&ptr, n) : cudaMalloc(&ptr, n));
    bytes = n;
    return absl::OkStatus();
  }
  void Release() {
    kPinned ? cudaFreeHost(ptr) : cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
  }
  float* f() const { return static_cast<float*>(ptr); }
  int32_t* i() const { return static_cast<int32_t*>(ptr); }
};
using DeviceBuffer = GrowingBuffer<false>;
using PinnedBuffer = GrowingBuffer<true>;

// projections); null where the model has none.
struct DeviceMatrix {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const float* bias = nullptr;
  // Its column in the LoRA table (ConfigureLora: every adaptable projection has one), or -1.
  int lora = -1;
  // Where the matrix starts, in bytes, whichever its type (the fused QKV's layout).
  const char* bytes() const {
    return bf16 != nullptr ? reinterpret_cast<const char*>(bf16) : reinterpret_cast<const char*>(f32);
  }
  int64_t element_bytes() const { return bf16 != nullptr ? 2 : 4; }
};
struct DeviceNorm {
  const float* w = nullptr;
  const float* b = nullptr;
};
// One layer's weights on the device, resolved by name once at Init: a step looks nothing up.
struct DeviceLayer {
  DeviceNorm attn_norm, cross_norm, ffn_norm;
  DeviceMatrix q, k, v, o, up, gate, down;
  DeviceMatrix cq, ck, cv, co;  // cross-attention (encoder-decoder decoder layers)
  cuda::Relative rel;           // the self-attention's relative term
};

class CudaBackend final : public Backend, public LogitsForward {
 public:
  CudaBackend(std::shared_ptr<const Model> model, const CudaOptions& o)
      : model_(std::move(model)), options_(o), kv_{o.block_size, o.num_blocks}, device_(o.device) {}

  ~CudaBackend() override;

  absl::Status Init();

  BackendInfo Describe() const override {
    BackendInfo info;
    info.name = "cuda";
    info.device = DeviceName();
    info.kv_cache = kv_;
    info.memory.weights = weight_bytes_ + static_cast<int64_t>(lora_weights_.bytes + lora_table_.bytes);
    info.memory.kv_cache = kv_bytes_;
    for (const DeviceBuffer* b : {&x_, &h_, &qkv_, &att_, &up_, &gate_, &work_, &logits_d_, &meta_, &sample_, &x16_,
                                  &cublas_workspace_,
                                  &slots_[0].answers, &slots_[1].answers}) {
      info.memory.activations += static_cast<int64_t>(b->bytes);
    }
    info.weights_dtype = WeightTypeName(options_.weight_type);
    info.kv_cache_dtype = KvTypeName(options_.kv_type);
    if (options_.tensor_cores) {
      info.projections = "mma projections";
    } else if (CublasBf16()) {
      info.projections = "cublas bf16 tensor-core projections, not batch invariant";
    } else if (options_.cublas_gemms) {
      info.projections = "cublas float32 projections, not batch invariant";
    } else {
      info.projections = "invariant projections";
    }
    info.batch_invariant = !options_.cublas_gemms;
    return info;
  }

  absl::Status Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) override;
  // The rows answered on the device (kernels/cuda/sampler_kernels.h): only the answers come back,
  // into page-locked memory. Launch enqueues the step and returns; each launch has its own slot of
  // staging memory (two, alternating), so the next step goes up while this one runs.
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override;
  absl::Status Collect(std::vector<SampleResult>* results) override;
  bool asynchronous() const override { return true; }
  absl::Status ConfigureLora(int max_loras, int max_rank) override;
  absl::Status Broken() const override { return broken_; }

 private:
#if defined(RELGEN_SIMT_EMULATOR)
  // Built against the SIMT emulator's cuda_runtime.h (tests/simt, test-only): say so.
  std::string DeviceName() const { return absl::StrCat("simt-emulator:", device_); }
#else
  std::string DeviceName() const { return absl::StrCat("cuda:", device_); }
#endif
  // Enqueues the step; with `logits`, copies its rows' logits there and waits.
  absl::Status RunSteps(absl::Span<const SequenceStep> steps, std::vector<float>* logits);
  // Enqueues the answers to `queries` from the kept rows, and their copy into the launch's slot.
  absl::Status AnswerOnDevice(absl::Span<const RowQuery> queries);
  // The slot of the launch being built, and of the one before it (its answers feed this one).
  int slot() const { return static_cast<int>(launched_ & 1); }
  const cuda::DeviceAnswer* FedFrom() const { return static_cast<const cuda::DeviceAnswer*>(slots_[slot() ^ 1].answers.ptr); }
  // A step's rows on the device (metadata uploaded) and the key counts its attention grids span.
  struct StepRows {
    int total = 0, kept = 0, max_keys = 1, max_input = 1;
    // Some sequence brings several rows (prefill): attention through the tiled kernel, which reads
    // a K/V row once for a chunk's rows (the same bits as the per-row kernel decode uses).
    bool tiled = false;
    const int32_t* tokens = nullptr;
    const int32_t* keep = nullptr;
    // Each row's LoRA slot (-1: none); null where no row of the step has an adapter.
    const int32_t* lora = nullptr;
    cuda::Rows rows, cross_rows;
  };
  // The decoder's work for `s`, from the embedding to the logits in logits_d_, enqueued on stream_.
  // Reads nothing from the host but `s` and the weights, so a capture of it replays for any step of
  // the same row counts (max_keys / max_input at their largest).
  absl::Status Decoder(const StepRows& s);
  // Decoder(s) through the graph captured for s.total decode rows (captured on first use).
  absl::Status DecodeGraph(StepRows s);
  void DropGraphs();
  // The inputs of `enc` (rows.keys: each row's input length), encoded; then every decoder layer's
  // cross-attention K/V of them written into the pool through `cross` (their cross block tables).
  // `lora`: each encoded row's LoRA slot, or null.
  absl::Status Encode(const int32_t* ids, const cuda::Rows& enc, int max_len, const cuda::Rows& cross,
                      const int32_t* lora);
  absl::Status EncodeLayers(const int32_t* ids, const cuda::Rows& enc, int max_len, const cuda::Rows& cross);
  // The feed-forward block's body of layer `L` on `in` (x_ or h_, `rows` rows), its output added to x_.
  absl::Status Mlp(const DeviceLayer& L, const float* in, int rows);
  // The operations WalkDecoder (walk_decoder.h) calls for one step's Decoder.
  struct DecoderOps;
  // What a step's buffers are sized by. `tokens` is the rows of the activations: a step's decoder
  // tokens, or the inputs it encodes where they are more.
  struct StepShape {
    int64_t tokens = 0, kept = 0, tables = 0, encoded = 0;
    int max_keys = 1;
    int64_t queries = 0, history = 0;  // rows answered on the device, their histories' tokens
    int64_t fed = 0;                   // tokens fed from the previous launch's answers
  };
  StepShape LargestStep() const;
  // Each step buffer and its size in elements (meta: int32, the rest: float).
  std::vector<std::pair<DeviceBuffer*, int64_t>> StepBuffers(const StepShape& s);
  // The tensor cores' ranges of k for the largest step (attention and projections take turns with
  // the one workspace: stream order); with `tickets`, the counters of their tiles instead.
  int64_t MmaWorkspace(const StepShape& s, bool tickets = false) const;
  // The device's sampling area: queries | histories | fed history tokens (pairs) | the histories'
  // raw logits. The answers live in the launch's slot.
  static int64_t SampleBytes(int64_t queries, int64_t history) {
    return queries * static_cast<int64_t>(sizeof(cuda::DeviceQuery) + 8) + history * 8;
  }
  int64_t StepBytes(const StepShape& s);
  absl::Status ReserveStep(const StepShape& s);

  const float* W(const std::string& name) const {
    auto it = weights_.find(name);
    return it == weights_.end() ? nullptr : it->second;
  }
  // A projection's weight matrix (and the LM head's): what --weights_dtype bf16 stores in bf16.
  static bool IsProjection(const std::string& name) { return name != "embed.weight" && IsStoredMatrix(name); }
  // Rows of stored matrix `m` go up in chunks of about kUploadChunk bytes, each row widened by
  // `convert` into a host buffer of T: the host never holds more than a chunk of any matrix, and its
  // mapped pages leave resident memory once it is on the device.
  static constexpr int64_t kUploadChunk = int64_t{16} << 20;
  // A chunk's rows are widened and converted on every host thread (upload_pool_): a 7B model's
  // 13 GB are rounded to bf16 in seconds rather than a minute.
  template <typename T, typename Convert>
  absl::Status UploadRows(const StoredMatrix& m, T* dev, Convert convert);
  absl::Status UploadWidened(const StoredMatrix& m, float* dev);
  // `names` (n elements each, from the host) side by side in one bf16 allocation, rounded as the
  // CPU backend rounds its bf16 weights.
  absl::Status UploadBf16(const std::vector<std::string>& names, int64_t n);
  const uint16_t* W16(const std::string& name) const {
    auto it = weights16_.find(name);
    return it == weights16_.end() ? nullptr : it->second;
  }
  DeviceMatrix Matrix(const std::string& p) const { return {W(p + ".weight"), W16(p + ".weight"), W(p + ".bias")}; }
  DeviceNorm NormWeights(const std::string& p) const { return {W(p + ".weight"), W(p + ".bias")}; }
  DeviceLayer LayerOf(const std::string& p) const;
  // The typed weights of every layer, from the uploaded ones by name (Init, after the tables).
  absl::Status ResolveWeights();
  // f(matrix m as stored): a const uint16_t* (bf16 bits) or a const float*.
  template <typename F>
  static cudaError_t WithMatrix(const DeviceMatrix& m, F&& f) {
    if (m.bf16 != nullptr) return f(m.bf16);
    return f(m.f32);
  }
  // relgen's projection kernel over matrix `m` in whichever type it is stored.
  cudaError_t Project(const float* x, int rows, int in, const DeviceMatrix& m, int out, const float* bias, int act,
                      bool residual, float alpha, float* y, int batch = 1, int64_t w_stride = 0,
                      int64_t bias_stride = 0, int64_t y_stride = 0);
  // y[rows, out] = x[rows, in] * W^T (+ bias, + activation), or with `residual` y += x * W^T (+ bias):
  // the residual add as the GEMM's beta, no launch of its own. Row-major through column-major cuBLAS.
  absl::Status Linear(const float* x, int rows, int in, const DeviceMatrix& m, int out, float* y, int act = -1,
                      bool residual = false);
  // Linear without the rows' adapters.
  absl::Status LinearBase(const float* x, int rows, int in, const DeviceMatrix& m, int out, float* y, int act = -1,
                          bool residual = false);
  // y [rows, out] += each row's adapter's term for `m` (lora_rows_), where the pass has adapters.
  absl::Status ApplyLora(const float* x, int rows, int in, const DeviceMatrix& m, int out, float* y);
  // The slot of each step's adapter (-1: none), loading the ones not resident (lora_residency_).
  absl::StatusOr<std::vector<int>> LoraSlots(absl::Span<const SequenceStep> steps);
  // Adapter `a` into slot `s`: its matrices and its column of the table, copied.
  absl::Status LoadLora(int s, const LoraAdapter& a);
  // cuBLAS's y[z][rows, out] = alpha * x[rows, in] * W_z^T + beta * y[z] for z < batch, W_z the
  // matrix `m` (+ z * w_stride elements) as stored: float32 by SGEMM, or bf16 by GemmEx over x
  // rounded to bf16 (float32 sums, tensor cores). Row-major through column-major cuBLAS.
  absl::Status Gemm(const float* x, int rows, int in, const DeviceMatrix& m, int out, float alpha, float beta,
                    float* y, int batch = 1, int64_t w_stride = 0, int64_t y_stride = 0);
  bool CublasBf16() const { return options_.cublas_gemms && options_.weight_type == WeightType::kBf16; }
  // cuBLAS's recommendation for Hopper; ample for the shapes of a step.
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
  // q, k and v [rows, qkv_width] each, in qkv_ one capacity apart (what the largest step reserved).
  int64_t QkvStride() const { return static_cast<int64_t>(qkv_.bytes / sizeof(float) / 3); }
  float* q() const { return qkv_.f(); }
  float* k() const { return qkv_.f() + QkvStride(); }
  float* v() const { return qkv_.f() + 2 * QkvStride(); }
  // The self-attention projections of layer `L` into q(), k(), v(): one
  // strided-batched GEMM over the fused weights and at most one bias launch.
  // With `cache`, k and v may go straight into the layer's pool at `cache_rows` (relgen's fused
  // projection); *written says whether they did, else they are in k(), v() for WriteKv.
  absl::Status Qkv(const float* x, int rows, const DeviceLayer& L, const cuda::KvPool* cache = nullptr,
                   const cuda::Rows* cache_rows = nullptr, bool* written = nullptr);
  absl::Status QkvBase(const float* x, int rows, const DeviceLayer& L, const cuda::KvPool* cache,
                       const cuda::Rows* cache_rows, bool* written);
  absl::Status Norm(const float* x, int rows, const DeviceNorm& n, float* y);
  // The encoder's relative term, as the CPU's: T5's signed buckets, or none (ResolveWeights).
  cuda::Relative EncoderRel(int layer) const;
  // Layer l's paged K/V pool.
  cuda::KvPool Pool(int l) const {
    const ModelConfig& c = model_->config();
    return cuda::KvPool{k_pools_[l], v_pools_[l], kv_.block_size, c.n_heads, c.head_dim,
                        options_.kv_type == KvType::kBf16 ? cuda::KvElem::kBf16 : cuda::KvElem::kF32};
  }
  // Layer `layer`'s relative term (ResolveWeights).
  cuda::Relative Rel(int layer) const;
  // Causal attention over `pool` (self- or cross-attention) into att_: on tensor cores where the
  // options ask for it and the pool allows (CudaOptions::attention_tensor_cores), else relgen's
  // float32 kernels.
  cudaError_t Attend(const cuda::Rows& rows, int max_keys, const cuda::Relative& rel, const cuda::KvPool& pool,
                     bool tiled) {
    const float scale = model_->config().attention_scale;
    if (options_.attention_tensor_cores && cuda::AttentionMmaSupported(pool)) {
      return cuda::AttentionMma(q(), rows, max_keys, scale, rel, pool, att_.f(), work_.f(),
                                options_.attention_split_keys, stream_, tiled);
    }
    return cuda::Attention(q(), rows, max_keys, scale, rel, pool, att_.f(), work_.f(), options_.attention_split_keys,
                           stream_, tiled);
  }

  std::shared_ptr<const Model> model_;
  CudaOptions options_;
  KvCacheConfig kv_;
  int device_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::unordered_map<std::string, float*> weights_;  // into owned_
  std::vector<float*> owned_;
  std::unordered_map<std::string, const uint16_t*> weights16_;  // bf16 projections, into owned16_
  std::vector<void*> owned16_;
  // The weights a step reads, typed (ResolveWeights); the maps above are Init's.
  std::vector<DeviceLayer> layers_, encoder_layers_;
  const float* embed_ = nullptr;
  DeviceNorm embed_norm_, final_norm_, encoder_final_norm_;
  DeviceMatrix lm_head_;
  std::vector<void*> k_pools_, v_pools_;  // of options_.kv_type
  int32_t* t5_table_ = nullptr;
  int32_t* t5_encoder_table_ = nullptr;  // encoder-decoder T5: signed buckets
  float* alibi_ = nullptr;
  int64_t weight_bytes_ = 0, kv_bytes_ = 0;
  std::unique_ptr<ThreadPool> upload_pool_;  // during Init only
  absl::Status broken_;  // engine thread only, like Forward
  DeviceBuffer x_, h_, qkv_, att_, up_, gate_, work_, logits_d_, meta_, sample_;
  // cuda::LinearMma's tile tickets: zeroed whenever allocated, left zero by every projection.
  DeviceBuffer mma_tickets_;
  // cuBLAS with bf16 weights: a projection's input rounded to bf16 (its other operand), and the
  // workspace cuBLAS is given so that it allocates nothing inside a graph capture.
  DeviceBuffer x16_, cublas_workspace_;
  // What a launch needs until it is collected: its metadata and queries going up (page-locked),
  // its answers on the device (the next launch's fed tokens read them) and coming back.
  struct Slot {
    PinnedBuffer meta_up, sample_up, answers_down;
    DeviceBuffer answers;
    int n = 0;  // queries answered
  };
  Slot slots_[2];
  cudaEvent_t answered_[2] = {nullptr, nullptr};  // a slot's answers are on the host
  int64_t launched_ = 0, collected_ = 0;
  std::unordered_map<int, cudaGraphExec_t> graphs_;  // 2 * decode rows (+ 1 with adapters) -> its graph
  int kept_ = 0;  // logits rows of the last step
  // LoRA (ConfigureLora). Slot s holds one adapter's A and B, each projection's at a fixed place
  // sized for max_rank (all allocated at configuration: loading an adapter only copies), and its
  // column of the table [slot][projection] of cuda::LoraDesc, which the kernel reads per row.
  LoraResidency lora_residency_;
  struct LoraColumn {
    int column = 0, in = 0, out = 0;
    int64_t offset = 0;  // its A's place in a slot, in floats (then B's)
  };
  std::unordered_map<std::string, LoraColumn> lora_matrix_;  // by relgen matrix name
  int lora_columns_ = 0, max_lora_rank_ = 0;
  int64_t lora_slot_floats_ = 0;
  std::vector<cuda::LoraDesc> lora_host_;  // [slot][column]; empty until ConfigureLora
  DeviceBuffer lora_weights_, lora_table_;
  // Each row's slot in the pass under way (the encoder's rows, then the decoder's); null: none.
  const int32_t* lora_rows_ = nullptr;
};

}  // namespace cuda_backend
}  // namespace relgen
