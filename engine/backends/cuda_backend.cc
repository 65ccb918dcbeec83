#include "engine/backends/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backends/walk_decoder.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/decoder_kernels.h"
#include "kernels/cuda/sampler_kernels.h"

namespace relgen {
namespace {

absl::Status CudaStatus(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  // The runtime also keeps a failed call's error as the thread's last error; consume it here, or the
  // next kernel wrapper's cudaGetLastError() reports it again (a failed allocation in one Forward
  // failed the next request's first launch). Sticky errors stay.
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, " at ", file, ":", line, ": ", cudaGetErrorString(e)));
}
absl::Status CublasStatus(cublasStatus_t e, const char* what, const char* file, int line) {
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

int ActivationCode(cpu::Activation a) {
  switch (a) {
    case cpu::Activation::kRelu: return 0;
    case cpu::Activation::kGelu: return 1;
    case cpu::Activation::kGeluTanh: return 2;
    case cpu::Activation::kSilu: return 3;
  }
  return -1;
}

// A matrix (and its bias) as the device holds it: float32, or bf16 (--weights_dtype bf16's
// projections); null where the model has none.
struct DeviceMatrix {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const float* bias = nullptr;
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

class CudaBackend final : public Backend {
 public:
  CudaBackend(std::shared_ptr<const Model> model, const CudaOptions& o)
      : model_(std::move(model)), options_(o), kv_{o.block_size, o.num_blocks}, device_(o.device) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    DropGraphs();
    for (float* p : owned_) cudaFree(p);
    for (void* p : owned16_) cudaFree(p);
    for (void* p : k_pools_) cudaFree(p);
    for (void* p : v_pools_) cudaFree(p);
    cudaFree(t5_table_);
    cudaFree(t5_encoder_table_);
    cudaFree(alibi_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    for (cudaEvent_t e : answered_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    RELGEN_CUDA_RETURN(cudaSetDevice(device_));
    RELGEN_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (cudaEvent_t& e : answered_) RELGEN_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    RELGEN_CUBLAS_RETURN(cublasCreate(&cublas_));
    RELGEN_CUBLAS_RETURN(cublasSetStream(cublas_, stream_));
    // Pedantic math: no TF32 in the float32 path, so results stay comparable with the CPU. bf16
    // operands are multiplied exactly into float32 sums either way; the default mode lets cuBLAS
    // pick its tensor-core kernels for them.
    RELGEN_CUBLAS_RETURN(cublasSetMathMode(cublas_, CublasBf16() ? CUBLAS_DEFAULT_MATH : CUBLAS_PEDANTIC_MATH));
    if (options_.cublas_gemms) {
      // A workspace of the backend's own: cuBLAS would otherwise allocate one itself, which a
      // captured decode graph cannot hold.
      if (absl::Status st = cublas_workspace_.Reserve(kCublasWorkspaceBytes); !st.ok()) return st;
      RELGEN_CUBLAS_RETURN(cublasSetWorkspace(cublas_, cublas_workspace_.ptr, kCublasWorkspaceBytes));
    }
    const ModelConfig& c = model_->config();
    std::unordered_map<std::string, int64_t> count;
    for (const TensorSpec& spec : ExpectedTensors(c)) {
      int64_t n = 1;
      for (int64_t d : spec.shape) n *= d;
      count[spec.name] = n;
    }
    const bool bf16 = options_.weight_type == cpu::WeightType::kBf16;
    upload_pool_ = std::make_unique<cpu::ThreadPool>(
        static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u)));
    for (const TensorSpec& spec : ExpectedTensors(c)) {
      if (weights_.count(spec.name) > 0 || weights16_.count(spec.name) > 0) continue;  // placed beside its q
      const int64_t n = count[spec.name];
      // A self-attention's q, k and v weights (and biases) side by side in one allocation: one
      // strided-batched GEMM and one bias launch compute all three (Qkv).
      std::vector<std::string> parts = {spec.name};
      if (const size_t at = spec.name.rfind("attn.q."); at != std::string::npos) {
        for (const char* sibling : {"attn.k.", "attn.v."}) {
          const std::string name = std::string(spec.name).replace(at, 7, sibling);
          if (count.count(name) > 0 && count[name] == n && weights_.count(name) == 0 && weights16_.count(name) == 0 &&
              (model_->Matrix(name) != nullptr || model_->Small(name) != nullptr)) {
            parts.push_back(name);
          }
        }
        if (parts.size() != 3) parts.resize(1);
      }
      if (bf16 && IsProjection(spec.name)) {
        if (auto s = UploadBf16(parts, n); !s.ok()) return s;
        continue;
      }
      // Every allocation is owned by a member the moment it exists: a failure part-way through
      // Init leaves the destructor to free what was made.
      float*& dev = owned_.emplace_back(nullptr);
      RELGEN_CUDA_RETURN(cudaMalloc(&dev, parts.size() * n * sizeof(float)));
      for (size_t i = 0; i < parts.size(); ++i) {
        weights_[parts[i]] = dev + i * n;
        weight_bytes_ += n * static_cast<int64_t>(sizeof(float));
        if (const StoredMatrix* matrix = model_->Matrix(parts[i]); matrix != nullptr) {
          if (auto s = UploadWidened(*matrix, dev + i * n); !s.ok()) return s;
          continue;
        }
        const float* host = model_->Small(parts[i]);
        if (host == nullptr) return absl::InternalError("weight " + parts[i] + " missing on the host");
        // On the work stream: a plain cudaMemcpy runs on the legacy stream, which does not order
        // the non-blocking work stream's first kernels after the copy.
        RELGEN_CUDA_RETURN(cudaMemcpyAsync(dev + i * n, host, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
      }
    }
    // A tied LM head (Model::lm_head() is then the embedding): in bf16 a copy of its own, beside
    // the float32 table the lookup reads; in float32 that table itself.
    if (c.tie_embeddings && bf16) {
      if (auto s = UploadBf16({"lm_head.weight"}, int64_t{c.vocab_size} * c.d_model); !s.ok()) return s;
    } else if (c.tie_embeddings) {
      weights_["lm_head.weight"] = weights_.at("embed.weight");
    }
    upload_pool_.reset();
    // The largest step's buffers now, before the pool takes what is left.
    const StepShape largest = LargestStep();
    if (absl::Status st = ReserveStep(largest); !st.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "device ", device_, ": the largest step the scheduler can form (", largest.tokens, " tokens, ",
          options_.max_step_seqs, " sequences, keys up to ", largest.max_keys, ") needs ", StepBytes(largest) >> 20,
          " MiB of buffers beside ", weight_bytes_ >> 20, " MiB of weights, and they do not fit (", st.message(),
          "); lower --max_batch_tokens or --max_num_seqs, or use a device with more memory"));
    }
    for (Slot& slot : slots_) {
      if (absl::Status st = slot.meta_up.Reserve(meta_.bytes); !st.ok()) return st;
      if (absl::Status st = slot.sample_up.Reserve(largest.queries * (sizeof(cuda::DeviceQuery) + 8) + largest.history * 4);
          !st.ok()) {
        return st;
      }
      if (absl::Status st = slot.answers.Reserve(largest.queries * sizeof(cuda::DeviceAnswer)); !st.ok()) return st;
      if (absl::Status st = slot.answers_down.Reserve(largest.queries * sizeof(cuda::DeviceAnswer)); !st.ok()) return st;
    }
    const int64_t per_block = CudaKvBytesPerToken(c, options_.kv_type) * kv_.block_size;
    if (kv_.num_blocks == 0) {
      size_t free = 0, total = 0;
      RELGEN_CUDA_RETURN(cudaMemGetInfo(&free, &total));
      const int64_t usable = static_cast<int64_t>(free) - options_.headroom_bytes;
      const int64_t blocks =
          usable <= 0 ? 0 : static_cast<int64_t>(options_.kv_memory_fraction * static_cast<double>(usable)) / per_block;
      // An encoder-decoder sequence also holds its input's cross-attention K/V.
      const int64_t need =
          (c.encoder_decoder ? 2 : 1) * int64_t{(c.max_seq_len + kv_.block_size - 1) / kv_.block_size};
      if (blocks < need) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "device ", device_, ": ", free >> 20, " MiB free after the weights (", weight_bytes_ >> 20,
            " MiB) and the largest step's buffers (", StepBytes(largest) >> 20, " MiB); ",
            options_.kv_memory_fraction, " of it less ", options_.headroom_bytes >> 20, " MiB of headroom holds ",
            blocks * kv_.block_size, " KV tokens, fewer than one sequence of max_seq_len ", c.max_seq_len,
            c.encoder_decoder ? " (input and output)" : "", " (", per_block / kv_.block_size, " bytes per token)"));
      }
      kv_.num_blocks = static_cast<int>(std::min<int64_t>(blocks, 1 << 30));
    }
    const int64_t per_layer =
        int64_t{kv_.num_blocks} * kv_.block_size * c.n_heads * c.head_dim * cpu::KvTypeBytes(options_.kv_type);
    for (int l = 0; l < c.n_layers; ++l) {
      RELGEN_CUDA_RETURN(cudaMalloc(&k_pools_.emplace_back(nullptr), per_layer));
      RELGEN_CUDA_RETURN(cudaMalloc(&v_pools_.emplace_back(nullptr), per_layer));
    }
    kv_bytes_ = 2 * per_layer * c.n_layers;
    if (!model_->t5_bucket_table().empty()) {
      const auto& t = model_->t5_bucket_table();
      RELGEN_CUDA_RETURN(cudaMalloc(&t5_table_, t.size() * sizeof(int32_t)));
      RELGEN_CUDA_RETURN(
          cudaMemcpyAsync(t5_table_, t.data(), t.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    }
    if (!model_->t5_encoder_bucket_table().empty()) {
      const auto& t = model_->t5_encoder_bucket_table();
      RELGEN_CUDA_RETURN(cudaMalloc(&t5_encoder_table_, t.size() * sizeof(int32_t)));
      RELGEN_CUDA_RETURN(cudaMemcpyAsync(t5_encoder_table_, t.data(), t.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream_));
    }
    if (!model_->alibi_slopes().empty()) {
      const auto& s = model_->alibi_slopes();
      RELGEN_CUDA_RETURN(cudaMalloc(&alibi_, s.size() * sizeof(float)));
      RELGEN_CUDA_RETURN(cudaMemcpyAsync(alibi_, s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    }
    if (absl::Status st = ResolveWeights(); !st.ok()) return st;
    // The host sources are pageable and stay the model's; waiting here makes Init's end the point
    // after which the device holds the weights.
    RELGEN_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::string_view name() const override { return "cuda"; }
#if defined(RELGEN_SIMT_EMULATOR)
  // Built against the SIMT emulator's cuda_runtime.h (tests/simt, test-only): say so.
  std::string device() const override { return absl::StrCat("simt-emulator:", device_); }
#else
  std::string device() const override { return absl::StrCat("cuda:", device_); }
#endif
  std::string weights_dtype() const override { return cpu::WeightTypeName(options_.weight_type); }
  std::string kv_cache_dtype() const override { return cpu::KvTypeName(options_.kv_type); }
  std::string projections() const override {
    if (options_.tensor_cores) return "mma projections";
    if (CublasBf16()) return "cublas bf16 tensor-core projections, not batch invariant";
    if (options_.cublas_gemms) return "cublas float32 projections, not batch invariant";
    return "invariant projections";
  }
  bool batch_invariant() const override { return !options_.cublas_gemms; }
  const KvCacheConfig& kv_cache() const override { return kv_; }
  BackendMemory memory() const override {
    BackendMemory m;
    m.weights = weight_bytes_;
    m.kv_cache = kv_bytes_;
    for (const DeviceBuffer* b : {&x_, &h_, &qkv_, &att_, &up_, &gate_, &work_, &logits_d_, &meta_, &sample_, &x16_,
                                  &cublas_workspace_,
                                  &slots_[0].answers, &slots_[1].answers}) {
      m.activations += static_cast<int64_t>(b->bytes);
    }
    return m;
  }

  absl::Status Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) override {
    if (!broken_.ok()) return broken_;
    absl::Status st = RunSteps(steps, logits);
    if (!st.ok()) {
      // An error the device keeps (an asynchronous fault) comes back from every later call; an
      // out-of-memory or a refused launch does not.
      cudaGetLastError();
      if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        broken_ = absl::InternalError(absl::StrCat(device(), ": ", cudaGetErrorString(e)));
      }
    }
    return st;
  }
  // The rows answered on the device (kernels/cuda/sampler_kernels.h): only the answers come back,
  // into page-locked memory. Launch enqueues the step and returns; each launch has its own slot of
  // staging memory (two, alternating), so the next step goes up while this one runs.
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override {
    if (!broken_.ok()) return broken_;
    if (launched_ - collected_ >= 2) {
      return absl::FailedPreconditionError("two launches are outstanding; collect one first");
    }
    absl::Status st = RunSteps(steps, nullptr);
    if (st.ok()) st = AnswerOnDevice(queries);
    if (!st.ok()) {
      cudaGetLastError();
      if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        broken_ = absl::InternalError(absl::StrCat(device(), ": ", cudaGetErrorString(e)));
      }
      return st;
    }
    ++launched_;
    return absl::OkStatus();
  }
  absl::Status Collect(std::vector<SampleResult>* results) override;
  bool asynchronous() const override { return true; }
  absl::Status Broken() const override { return broken_; }

 private:
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
    cuda::Rows rows, cross_rows;
  };
  // The decoder's work for `s`, from the embedding to the logits in logits_d_, enqueued on stream_.
  // Reads nothing from the host but `s` and the weights, so a capture of it replays for any step of
  // the same row counts (max_keys / max_input at their largest).
  absl::Status Decoder(const StepRows& s);
  // Decoder(s) through the graph captured for s.total decode rows (captured on first use).
  absl::Status DecodeGraph(StepRows s);
  void DropGraphs() {
    for (auto& [n, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
  }
  // The inputs of `enc` (rows.keys: each row's input length), encoded; then every decoder layer's
  // cross-attention K/V of them written into the pool through `cross` (their cross block tables).
  absl::Status Encode(const int32_t* ids, const cuda::Rows& enc, int max_len, const cuda::Rows& cross);
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
  StepShape LargestStep() const {
    const ModelConfig& c = model_->config();
    StepShape s;
    const int64_t per_seq = (c.max_seq_len + kv_.block_size - 1) / kv_.block_size;
    s.tokens = options_.max_step_tokens;
    // Every row's logits can be kept (prompt log-probabilities, Score): up to a row per token.
    s.kept = options_.max_step_tokens;
    s.tables = int64_t{options_.max_step_seqs} * per_seq;
    s.fed = options_.max_step_seqs;
    s.max_keys = c.max_seq_len;
    // A query per kept row at most; a draw per sequence, each with its whole context as history
    // and its controls.
    s.queries = s.kept;
    s.history = int64_t{options_.max_step_seqs} * (c.max_seq_len + kMaxControlWords);
    if (c.encoder_decoder) {
      // The scheduler's encoder budget, and an input longer than it encodes whole (alone): up to
      // max_seq_len rows. Cross tables too.
      s.encoded = std::max<int64_t>(options_.max_step_encoder_tokens, c.max_seq_len);
      s.tokens = std::max<int64_t>(s.encoded, options_.max_step_tokens);
      s.tables *= 2;
    }
    return s;
  }
  // Each step buffer and its size in elements (meta: int32, the rest: float).
  std::vector<std::pair<DeviceBuffer*, int64_t>> StepBuffers(const StepShape& s) {
    const ModelConfig& c = model_->config();
    const int64_t d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
    // Meta: 3 ints per decoder row, 2 more for its cross-attention, 6 per encoded row (RunSteps).
    const int64_t meta = (c.encoder_decoder ? 5 : 3) * s.tokens + s.tables + s.kept + 6 * s.encoded + 2 * s.fed;
    return {{&meta_, meta}, {&sample_, SampleBytes(s.queries, s.history) / 4},
            {&x_, s.tokens * d}, {&h_, s.tokens * d}, {&qkv_, 3 * s.tokens * w},
            {&att_, s.tokens * w}, {&up_, s.tokens * f},
            {&gate_, s.tokens * f}, {&logits_d_, s.kept * c.vocab_size},
            {&x16_, CublasBf16() ? (s.tokens * std::max({d, w, f}) + 1) / 2 : 0},
            {&work_, std::max(cuda::AttentionWorkspace(static_cast<int>(s.tokens), c.n_heads, c.head_dim,
                                                       s.max_keys, options_.attention_split_keys),
                              MmaWorkspace(s))}};
  }
  // The tensor cores' ranges of k for the largest step (attention and projections take turns with
  // the one workspace: stream order).
  int64_t MmaWorkspace(const StepShape& s) const {
    if (!options_.tensor_cores) return 0;
    const ModelConfig& c = model_->config();
    const int t = static_cast<int>(s.tokens), d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
    int64_t n = cuda::LinearMmaWorkspace(static_cast<int>(s.kept), d, c.vocab_size, 1);
    for (int batch = 1; batch <= 3; ++batch) {
      for (auto [in, out] : {std::pair{d, w}, std::pair{w, d}, std::pair{d, f}, std::pair{f, d}}) {
        n = std::max(n, cuda::LinearMmaWorkspace(t, in, out, batch));
      }
    }
    return n;
  }
  // The device's sampling area: queries | histories | fed history tokens (pairs) | the histories'
  // raw logits. The answers live in the launch's slot.
  static int64_t SampleBytes(int64_t queries, int64_t history) {
    return queries * static_cast<int64_t>(sizeof(cuda::DeviceQuery) + 8) + history * 8;
  }
  int64_t StepBytes(const StepShape& s) {
    int64_t bytes = 0;
    for (auto [buf, n] : StepBuffers(s)) bytes += std::max<int64_t>(n, 1) * 4;
    return bytes;
  }
  absl::Status ReserveStep(const StepShape& s) {
    for (auto [buf, n] : StepBuffers(s)) {
      void* const was = buf->ptr;
      absl::Status st = buf->Reserve(std::max<int64_t>(n, 1) * 4);
      // Captured graphs hold the buffers' addresses.
      if (buf->ptr != was) DropGraphs();
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

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
  absl::Status UploadRows(const StoredMatrix& m, T* dev, Convert convert) {
    const int64_t rows_per = std::max<int64_t>(1, kUploadChunk / static_cast<int64_t>(m.cols * sizeof(T)));
    std::vector<T> chunk(static_cast<size_t>(std::min(rows_per, m.rows) * m.cols));
    for (int64_t r0 = 0; r0 < m.rows; r0 += rows_per) {
      const int64_t n = std::min(rows_per, m.rows - r0);
      auto rows = [&](int begin, int end) {
        std::vector<float> row(static_cast<size_t>(m.cols));
        for (int64_t r = begin; r < end; ++r) {
          m.Widen(r0 + r, 1, row.data());
          for (int64_t c = 0; c < m.cols; ++c) chunk[r * m.cols + c] = convert(row[c]);
        }
      };
      if (upload_pool_ != nullptr) {
        upload_pool_->ParallelFor(static_cast<int>(n), rows);
      } else {
        rows(0, static_cast<int>(n));
      }
      RELGEN_CUDA_RETURN(cudaMemcpyAsync(dev + r0 * m.cols, chunk.data(), n * m.cols * sizeof(T),
                                         cudaMemcpyHostToDevice, stream_));
      RELGEN_CUDA_RETURN(cudaStreamSynchronize(stream_));  // `chunk` is pageable and is refilled
    }
    m.ReleasePages();
    return absl::OkStatus();
  }
  absl::Status UploadWidened(const StoredMatrix& m, float* dev) {
    return UploadRows(m, dev, [](float x) { return x; });
  }
  // `names` (n elements each, from the host) side by side in one bf16 allocation, rounded as the
  // CPU backend rounds its bf16 weights.
  absl::Status UploadBf16(const std::vector<std::string>& names, int64_t n) {
    void*& dev = owned16_.emplace_back(nullptr);
    RELGEN_CUDA_RETURN(cudaMalloc(&dev, names.size() * n * sizeof(uint16_t)));
    for (size_t i = 0; i < names.size(); ++i) {
      const StoredMatrix* m = names[i] == "lm_head.weight" ? &model_->lm_head() : model_->Matrix(names[i]);
      if (m == nullptr) return absl::InternalError("weight " + names[i] + " missing on the host");
      uint16_t* part = static_cast<uint16_t*>(dev) + i * n;
      if (auto s = UploadRows(*m, part, [](float x) { return cpu::ToBf16(x); }); !s.ok()) return s;
      weights16_[names[i]] = part;
    }
    weight_bytes_ += static_cast<int64_t>(names.size() * n * sizeof(uint16_t));
    return absl::OkStatus();
  }
  const uint16_t* W16(const std::string& name) const {
    auto it = weights16_.find(name);
    return it == weights16_.end() ? nullptr : it->second;
  }
  DeviceMatrix Matrix(const std::string& p) const { return {W(p + ".weight"), W16(p + ".weight"), W(p + ".bias")}; }
  DeviceNorm NormWeights(const std::string& p) const { return {W(p + ".weight"), W(p + ".bias")}; }
  DeviceLayer LayerOf(const std::string& p) const {
    DeviceLayer l;
    l.attn_norm = NormWeights(p + "attn_norm");
    l.cross_norm = NormWeights(p + "cross_norm");
    l.ffn_norm = NormWeights(p + "ffn_norm");
    l.q = Matrix(p + "attn.q");
    l.k = Matrix(p + "attn.k");
    l.v = Matrix(p + "attn.v");
    l.o = Matrix(p + "attn.o");
    l.up = Matrix(p + "ffn.up");
    l.gate = Matrix(p + "ffn.gate");
    l.down = Matrix(p + "ffn.down");
    l.cq = Matrix(p + "cross.q");
    l.ck = Matrix(p + "cross.k");
    l.cv = Matrix(p + "cross.v");
    l.co = Matrix(p + "cross.o");
    return l;
  }
  // The typed weights of every layer, from the uploaded ones by name (Init, after the tables).
  absl::Status ResolveWeights() {
    const ModelConfig& c = model_->config();
    for (int l = 0; l < c.n_layers; ++l) {
      layers_.push_back(LayerOf(absl::StrCat("layers.", l, ".")));
      layers_.back().rel = Rel(l);
    }
    for (int l = 0; l < c.n_encoder_layers; ++l) {
      encoder_layers_.push_back(LayerOf(absl::StrCat("encoder.layers.", l, ".")));
      encoder_layers_.back().rel = EncoderRel(l);
    }
    embed_ = W("embed.weight");
    embed_norm_ = NormWeights("embed_norm");
    final_norm_ = NormWeights("final_norm");
    encoder_final_norm_ = NormWeights("encoder.final_norm");
    lm_head_ = Matrix("lm_head");
    if (CublasBf16()) {
      // GemmEx multiplies bf16 matrices only: every projection must have gone up as one.
      for (const TensorSpec& spec : ExpectedTensors(c)) {
        if (IsProjection(spec.name) && W16(spec.name) == nullptr) {
          return absl::InternalError("bf16 weight " + spec.name + " missing on the device");
        }
      }
      if (lm_head_.bf16 == nullptr) return absl::InternalError("bf16 weight lm_head.weight missing on the device");
    }
    return absl::OkStatus();
  }
  // f(matrix m as stored): a const uint16_t* (bf16 bits) or a const float*.
  template <typename F>
  static cudaError_t WithMatrix(const DeviceMatrix& m, F&& f) {
    if (m.bf16 != nullptr) return f(m.bf16);
    return f(m.f32);
  }
  // relgen's projection kernel over matrix `m` in whichever type it is stored.
  cudaError_t Project(const float* x, int rows, int in, const DeviceMatrix& m, int out, const float* bias, int act,
                      bool residual, float alpha, float* y, int batch = 1, int64_t w_stride = 0,
                      int64_t bias_stride = 0, int64_t y_stride = 0) {
    return WithMatrix(m, [&](auto w) {
      if constexpr (std::is_same_v<decltype(w), const uint16_t*>) {
        if (options_.tensor_cores) {
          return cuda::LinearMma(x, rows, in, w, out, bias, act, residual, alpha, y, stream_, batch, w_stride,
                                 bias_stride, y_stride, work_.f());
        }
      }
      return cuda::Linear(x, rows, in, w, out, bias, act, residual, alpha, y, stream_, batch, w_stride, bias_stride,
                          y_stride);
    });
  }
  // y[rows, out] = x[rows, in] * W^T (+ bias, + activation), or with `residual` y += x * W^T (+ bias):
  // the residual add as the GEMM's beta, no launch of its own. Row-major through column-major cuBLAS.
  absl::Status Linear(const float* x, int rows, int in, const DeviceMatrix& m, int out, float* y, int act = -1,
                      bool residual = false) {
    if (!options_.cublas_gemms) {
      RELGEN_CUDA_RETURN(Project(x, rows, in, m, out, m.bias, act, residual, 1.f, y));
      return absl::OkStatus();
    }
    if (auto st = Gemm(x, rows, in, m, out, 1.f, residual ? 1.f : 0.f, y); !st.ok()) return st;
    const float* bias = m.bias;
    if (bias == nullptr && act < 0) return absl::OkStatus();  // nothing to launch for
    RELGEN_CUDA_RETURN(cuda::BiasActivate(y, rows, out, bias, act, stream_));
    return absl::OkStatus();
  }
  // cuBLAS's y[z][rows, out] = alpha * x[rows, in] * W_z^T + beta * y[z] for z < batch, W_z the
  // matrix `m` (+ z * w_stride elements) as stored: float32 by SGEMM, or bf16 by GemmEx over x
  // rounded to bf16 (float32 sums, tensor cores). Row-major through column-major cuBLAS.
  absl::Status Gemm(const float* x, int rows, int in, const DeviceMatrix& m, int out, float alpha, float beta,
                    float* y, int batch = 1, int64_t w_stride = 0, int64_t y_stride = 0) {
    if (!CublasBf16()) {
      RELGEN_CUBLAS_RETURN(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, m.f32, in,
                                                     w_stride, x, in, 0, &beta, y, out, y_stride, batch));
      return absl::OkStatus();
    }
    if (m.bf16 == nullptr) return absl::InternalError("a bf16 weight missing on the device");  // ResolveWeights
    uint16_t* const x16 = static_cast<uint16_t*>(x16_.ptr);
    RELGEN_CUDA_RETURN(cuda::RoundToBf16(x, int64_t{rows} * in, x16, stream_));
    RELGEN_CUBLAS_RETURN(cublasGemmStridedBatchedEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, m.bf16,
                                                    CUDA_R_16BF, in, w_stride, x16, CUDA_R_16BF, in, 0, &beta, y,
                                                    CUDA_R_32F, out, y_stride, batch, CUBLAS_COMPUTE_32F,
                                                    CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }
  bool CublasBf16() const { return options_.cublas_gemms && options_.weight_type == cpu::WeightType::kBf16; }
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
                   const cuda::Rows* cache_rows = nullptr, bool* written = nullptr) {
    if (written != nullptr) *written = false;
    const ModelConfig& c = model_->config();
    const int d = c.d_model, w = c.qkv_width();
    const int64_t wd = int64_t{w} * d;
    const int64_t eb = L.q.element_bytes();
    const char* at = L.q.bytes();
    if (L.k.bytes() != at + wd * eb || L.v.bytes() != at + 2 * wd * eb) {
      for (auto [m, out] : {std::pair{&L.q, q()}, std::pair{&L.k, k()}, std::pair{&L.v, v()}}) {
        if (auto s = Linear(x, rows, d, *m, w, out); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    const float* bq = L.q.bias;
    if (!options_.cublas_gemms) {
      const bool fused_bias = bq != nullptr && L.k.bias == bq + w && L.v.bias == bq + 2 * w;
      if (fused_bias || (bq == nullptr && L.k.bias == nullptr && L.v.bias == nullptr)) {
        if (cache != nullptr) {
          RELGEN_CUDA_RETURN(WithMatrix(L.q, [&](auto wqkv) {
            if constexpr (std::is_same_v<decltype(wqkv), const uint16_t*>) {
              if (options_.tensor_cores) {
                return cuda::QkvToCacheMma(x, rows, d, wqkv, w, bq, q(), *cache, *cache_rows, stream_, work_.f());
              }
            }
            return cuda::QkvToCache(x, rows, d, wqkv, w, bq, q(), *cache, *cache_rows, stream_);
          }));
          *written = true;
          return absl::OkStatus();
        }
        RELGEN_CUDA_RETURN(Project(x, rows, d, L.q, w, bq, -1, false, 1.f, q(), 3, wd, w, QkvStride()));
        return absl::OkStatus();
      }
      for (auto [m, out] : {std::pair{&L.q, q()}, std::pair{&L.k, k()}, std::pair{&L.v, v()}}) {
        if (auto s = Linear(x, rows, d, *m, w, out); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    if (auto st = Gemm(x, rows, d, L.q, w, 1.f, 0.f, q(), 3, wd, QkvStride()); !st.ok()) return st;
    if (bq != nullptr && L.k.bias == bq + w && L.v.bias == bq + 2 * w) {
      RELGEN_CUDA_RETURN(cuda::BiasActivate(q(), rows, w, bq, -1, stream_, 3, QkvStride()));
      return absl::OkStatus();
    }
    for (auto [b, out] : {std::pair{L.q.bias, q()}, std::pair{L.k.bias, k()}, std::pair{L.v.bias, v()}}) {
      if (b != nullptr) RELGEN_CUDA_RETURN(cuda::BiasActivate(out, rows, w, b, -1, stream_));
    }
    return absl::OkStatus();
  }
  absl::Status Norm(const float* x, int rows, const DeviceNorm& n, float* y) {
    const ModelConfig& c = model_->config();
    RELGEN_CUDA_RETURN(cuda::Norm(c.norm == NormKind::kLayerNorm, x, rows, c.d_model, n.w, n.b, c.norm_eps, y, stream_));
    return absl::OkStatus();
  }
  // The encoder's relative term, as the CPU's: T5's signed buckets, or none (ResolveWeights).
  cuda::Relative EncoderRel(int layer) const {
    const ModelConfig& c = model_->config();
    cuda::Relative r;
    if (c.rel.scheme != relpos::Scheme::kT5) return r;
    const std::string p =
        c.rel.share_across_layers ? "encoder.attn." : absl::StrCat("encoder.layers.", layer, ".attn.");
    r.scheme = relpos::Scheme::kT5;
    r.heads_share = c.rel.heads_share_table;
    r.t5_bias = W(p + "rel_bias");
    r.t5_num_buckets = c.rel.num_buckets;
    r.t5_bucket_of_distance = t5_encoder_table_;
    r.t5_table_len = static_cast<int>(model_->t5_encoder_bucket_table().size());
    return r;
  }
  // Layer l's paged K/V pool.
  cuda::KvPool Pool(int l) const {
    const ModelConfig& c = model_->config();
    return cuda::KvPool{k_pools_[l], v_pools_[l], kv_.block_size, c.n_heads, c.head_dim,
                        options_.kv_type == cpu::KvType::kBf16 ? cuda::KvElem::kBf16 : cuda::KvElem::kF32};
  }
  // Layer `layer`'s relative term (ResolveWeights).
  cuda::Relative Rel(int layer) const {
    const ModelConfig& c = model_->config();
    const std::string p = c.rel.share_across_layers ? "attn." : absl::StrCat("layers.", layer, ".attn.");
    cuda::Relative r;
    r.scheme = c.rel.scheme;
    r.heads_share = c.rel.heads_share_table;
    r.table_k = W(p + "rel_k");
    r.table_v = W(p + "rel_v");
    r.rows = c.rel.scheme == relpos::Scheme::kShaw ? 2 * c.rel.clip + 1 : c.rel.max_relative_position;
    r.clip_k = c.rel.clip;
    r.block_length = c.rel.block_length;
    r.t5_bias = W(p + "rel_bias");
    r.t5_num_buckets = c.rel.num_buckets;
    r.t5_bucket_of_distance = t5_table_;
    r.t5_table_len = static_cast<int>(model_->t5_bucket_table().size());
    r.alibi_slopes = alibi_;
    r.scale_with_qk = c.rel.scale_with_qk;
    return r;
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
  std::unique_ptr<cpu::ThreadPool> upload_pool_;  // during Init only
  absl::Status broken_;  // engine thread only, like Forward
  DeviceBuffer x_, h_, qkv_, att_, up_, gate_, work_, logits_d_, meta_, sample_;
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
  std::unordered_map<int, cudaGraphExec_t> graphs_;  // decode rows -> its step's graph
  int kept_ = 0;  // logits rows of the last step
};

namespace {

// A draw's controls in the device's layout (sampler_kernels.h, DeviceQuery::controls_offset): how
// many words, and writing them (returns the end).
bool BansNow(const SamplingParams& p, int index) { return index < p.min_tokens && !p.min_tokens_banned.empty(); }
int64_t ControlWords(const SamplingParams& p, int index) {
  if (p.logit_bias.empty() && p.allowed_token_ids.empty() && p.bad_words.empty() && !BansNow(p, index)) return 0;
  int64_t n = 4 + 2 * static_cast<int64_t>(p.logit_bias.size()) + static_cast<int64_t>(p.allowed_token_ids.size());
  if (BansNow(p, index)) n += static_cast<int64_t>(p.min_tokens_banned.size());
  for (const auto& w : p.bad_words) n += 1 + static_cast<int64_t>(w.size());
  return n;
}
int32_t* PackControls(const SamplingParams& p, int index, int32_t* out) {
  *out++ = static_cast<int32_t>(p.logit_bias.size());
  for (const auto& [t, b] : p.logit_bias) {
    *out++ = t;
    std::memcpy(out++, &b, sizeof(b));
  }
  *out++ = static_cast<int32_t>(p.allowed_token_ids.size());
  out = std::copy(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), out);
  if (BansNow(p, index)) {
    *out++ = static_cast<int32_t>(p.min_tokens_banned.size());
    out = std::copy(p.min_tokens_banned.begin(), p.min_tokens_banned.end(), out);
  } else {
    *out++ = 0;
  }
  *out++ = static_cast<int32_t>(p.bad_words.size());
  for (const auto& w : p.bad_words) {
    *out++ = static_cast<int32_t>(w.size());
    out = std::copy(w.begin(), w.end(), out);
  }
  return out;
}

}  // namespace

absl::Status CudaBackend::AnswerOnDevice(absl::Span<const RowQuery> queries) {
  const int vocab = model_->config().vocab_size;
  const int n = static_cast<int>(queries.size());
  const int fed_limit = launched_ > 0 ? slots_[slot() ^ 1].n : 0;
  int64_t history = 0;
  int fed = 0;
  for (const RowQuery& r : queries) {
    if (r.row < 0 || r.row >= kept_) {
      return absl::InvalidArgumentError(absl::StrCat("query of row ", r.row, "; the step kept ", kept_, " rows"));
    }
    const int top_n = r.params == nullptr ? r.top_n : r.beam > 0 ? r.beam : r.params->logprobs;
    if (top_n > cuda::kMaxAnswerTop || (r.params == nullptr && (r.token < 0 || r.token >= vocab))) {
      return absl::InvalidArgumentError(absl::StrCat("query of token ", r.token, " with ", top_n,
                                                     " alternatives; allowed ids 0..", vocab - 1, ", up to ",
                                                     cuda::kMaxAnswerTop, " alternatives"));
    }
    if (r.fed_query >= fed_limit || (r.fed_query >= 0 && (r.params == nullptr || r.history.empty()))) {
      return absl::InvalidArgumentError(absl::StrCat("a history token fed from query ", r.fed_query,
                                                     " of the previous launch, which answered ", fed_limit));
    }
    if (r.params != nullptr && r.params->NeedsHistory()) {
      history += static_cast<int64_t>(r.history.size());
      fed += r.fed_query >= 0 ? 1 : 0;
    }
    if (r.params != nullptr) history += ControlWords(*r.params, r.index);
  }
  StepShape shape;
  shape.queries = n;
  shape.history = history;
  if (absl::Status st = ReserveStep(shape); !st.ok()) return st;  // within the largest step: no-op
  Slot& slot = slots_[this->slot()];
  const size_t q_bytes = n * sizeof(cuda::DeviceQuery), a_bytes = n * sizeof(cuda::DeviceAnswer);
  const size_t h_bytes = history * sizeof(int32_t), up_bytes = q_bytes + h_bytes + 2 * fed * sizeof(int32_t);
  if (absl::Status st = slot.sample_up.Reserve(up_bytes); !st.ok()) return st;
  if (absl::Status st = slot.answers.Reserve(a_bytes); !st.ok()) return st;
  if (absl::Status st = slot.answers_down.Reserve(a_bytes); !st.ok()) return st;
  auto* q = static_cast<cuda::DeviceQuery*>(slot.sample_up.ptr);
  auto* h = reinterpret_cast<int32_t*>(static_cast<char*>(slot.sample_up.ptr) + q_bytes);
  int32_t* feeds = h + history;  // (history index, query) pairs
  int32_t offset = 0, f = 0;
  for (int i = 0; i < n; ++i) {
    const RowQuery& r = queries[i];
    cuda::DeviceQuery d;
    d.row = r.row;
    if (r.params == nullptr) {
      d.token = r.token;
      d.top_n = r.top_n;
    } else {
      const SamplingParams& p = *r.params;
      d.draw = r.beam > 0 ? 2 : 1;
      d.top_n = r.beam > 0 ? r.beam : p.logprobs;
      d.temperature = p.temperature;
      d.top_p = p.top_p;
      d.repetition_penalty = p.repetition_penalty;
      d.top_k = p.top_k;
      d.seed = p.seed;
      d.index = r.index;
      d.presence_penalty = p.presence_penalty;
      d.frequency_penalty = p.frequency_penalty;
      d.min_p = p.min_p;
      d.no_repeat_ngram_size = p.no_repeat_ngram_size;
      if (p.NeedsHistory()) {
        d.history_offset = offset;
        d.history_len = static_cast<int32_t>(r.history.size());
        std::copy(r.history.begin(), r.history.end(), h + offset);
        offset += d.history_len;
        if (r.fed_query >= 0) {
          feeds[2 * f] = offset - 1;
          feeds[2 * f + 1] = r.fed_query;
          ++f;
        }
      }
      if (ControlWords(p, r.index) > 0) {
        d.controls_offset = offset;
        offset = PackControls(p, r.index, h + offset) - h;
      }
    }
    q[i] = d;
  }
  char* dev = static_cast<char*>(sample_.ptr);
  auto* d_queries = reinterpret_cast<cuda::DeviceQuery*>(dev);
  auto* d_history = reinterpret_cast<int32_t*>(dev + q_bytes);
  auto* d_feeds = reinterpret_cast<const int32_t*>(dev + q_bytes + h_bytes);
  auto* d_raw = reinterpret_cast<float*>(dev + up_bytes);
  auto* d_answers = static_cast<cuda::DeviceAnswer*>(slot.answers.ptr);
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(dev, slot.sample_up.ptr, up_bytes, cudaMemcpyHostToDevice, stream_));
  RELGEN_CUDA_RETURN(cuda::FeedTokens(FedFrom(), d_feeds, fed, d_history, stream_));
  RELGEN_CUDA_RETURN(cuda::AnswerRows(logits_d_.f(), vocab, d_queries, n, d_history, d_raw, nullptr, d_answers, stream_));
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(slot.answers_down.ptr, d_answers, a_bytes, cudaMemcpyDeviceToHost, stream_));
  RELGEN_CUDA_RETURN(cudaEventRecord(answered_[this->slot()], stream_));
  slot.n = n;
  return absl::OkStatus();
}

absl::Status CudaBackend::Collect(std::vector<SampleResult>* results) {
  if (collected_ == launched_) return absl::FailedPreconditionError("nothing launched to collect");
  const int k = static_cast<int>(collected_ & 1);
  ++collected_;
  if (!broken_.ok()) return broken_;
  if (const cudaError_t e = cudaEventSynchronize(answered_[k]); e != cudaSuccess) {
    cudaGetLastError();
    broken_ = absl::InternalError(absl::StrCat(device(), ": ", cudaGetErrorString(e)));
    return broken_;
  }
  const Slot& slot = slots_[k];
  const auto* a = static_cast<const cuda::DeviceAnswer*>(slot.answers_down.ptr);
  results->assign(slot.n, SampleResult());
  for (int i = 0; i < slot.n; ++i) {
    SampleResult& r = (*results)[i];
    r.token = a[i].token;
    r.logprob = a[i].logprob;
    for (int j = 0; j < a[i].num_top; ++j) r.top.push_back({a[i].top_token[j], a[i].top_logprob[j]});
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Mlp(const DeviceLayer& L, const float* in, int rows) {
  const ModelConfig& c = model_->config();
  const int d = c.d_model, f = c.ffn_dim;
  const int act = ActivationCode(c.ffn_activation);
  if (c.ffn_gated) {
    if (auto s = Linear(in, rows, d, L.up, f, up_.f()); !s.ok()) return s;
    if (auto s = Linear(in, rows, d, L.gate, f, gate_.f()); !s.ok()) return s;
    RELGEN_CUDA_RETURN(cuda::ActivateGated(act, gate_.f(), up_.f(), int64_t{rows} * f, stream_));
    return Linear(gate_.f(), rows, f, L.down, d, x_.f(), -1, true);
  }
  if (auto s = Linear(in, rows, d, L.up, f, up_.f(), act); !s.ok()) return s;
  return Linear(up_.f(), rows, f, L.down, d, x_.f(), -1, true);
}

absl::Status CudaBackend::Encode(const int32_t* ids, const cuda::Rows& enc, int max_len, const cuda::Rows& cross) {
  const ModelConfig& c = model_->config();
  const int d = c.d_model, w = c.qkv_width(), rows = enc.n;
  // As the CPU's encoder: the embedding, then per layer pre-norm self-attention and the
  // feed-forward block, then the encoder's final norm.
  RELGEN_CUDA_RETURN(cuda::Embedding(ids, rows, embed_, d, c.embedding_scale, x_.f(), stream_));
  // The projections' K/V [rows, width] are read in place as a pool of one-token blocks: block b
  // is row b, and each row's table starts at its input's first row (enc.table_offset into the
  // identity table), so attention never crosses inputs and no copy is made.
  const cuda::KvPool own{k(), v(), 1, c.n_heads, c.head_dim};
  for (int l = 0; l < c.n_encoder_layers; ++l) {
    const DeviceLayer& L = encoder_layers_[l];
    if (auto s = Norm(x_.f(), rows, L.attn_norm, h_.f()); !s.ok()) return s;
    if (auto s = Qkv(h_.f(), rows, L); !s.ok()) return s;
    RELGEN_CUDA_RETURN(cuda::AttentionBidirectional(q(), enc, max_len, c.attention_scale, L.rel, own,
                                                    att_.f(), work_.f(), options_.attention_split_keys, stream_));
    if (auto s = Linear(att_.f(), rows, w, L.o, d, x_.f(), -1, true); !s.ok()) return s;
    if (c.norm_placement == NormPlacement::kPre) {
      if (auto s = Norm(x_.f(), rows, L.ffn_norm, h_.f()); !s.ok()) return s;
      if (auto s = Mlp(L, h_.f(), rows); !s.ok()) return s;
    } else {
      if (auto s = Mlp(L, x_.f(), rows); !s.ok()) return s;
      if (auto s = Norm(x_.f(), rows, L.ffn_norm, x_.f()); !s.ok()) return s;
    }
  }
  if (auto s = Norm(x_.f(), rows, encoder_final_norm_, h_.f()); !s.ok()) return s;
  // Every decoder layer's cross-attention keys and values of the encoder output, into the pool.
  for (int l = 0; l < c.n_layers; ++l) {
    if (auto s = Linear(h_.f(), rows, d, layers_[l].ck, w, k()); !s.ok()) return s;
    if (auto s = Linear(h_.f(), rows, d, layers_[l].cv, w, v()); !s.ok()) return s;
    RELGEN_CUDA_RETURN(cuda::WriteKv(Pool(l), cross, k(), v(), stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::RunSteps(absl::Span<const SequenceStep> steps, std::vector<float>* logits) {
  const ModelConfig& c = model_->config();
  RELGEN_CUDA_RETURN(cudaSetDevice(device_));
  // Host-side metadata: tokens, each row's position and block-table offset, rows to keep.
  if (auto v = ValidateSteps(steps, c.vocab_size, c.max_seq_len, kv_, c.encoder_decoder); !v.ok()) return v;
  const bool enc_dec = c.encoder_decoder;
  std::vector<int32_t> tokens, position, table_offset, tables, keep;
  // Encoder-decoder only. Per decoder row, its cross-attention: the position of the input's last
  // token (every encoder key visible, as cpu::AttentionDecode at encoder_len - 1) and the offset
  // of its cross table in `tables`. Per row of each input encoded this step: its id, its position
  // in the input, its input's first row and length, its cross table's offset; `identity` is the
  // block table of the encoder's one-token blocks (Encode).
  std::vector<int32_t> cross_position, cross_offset, enc_ids, enc_position, enc_first, enc_len, enc_cross, identity;
  int max_keys = 1, max_input = 1, max_encoded = 1;
  std::vector<int32_t> feeds;  // (index into tokens, query of the previous launch) pairs
  const int fed_limit = launched_ > 0 ? slots_[slot() ^ 1].n : 0;
  for (const SequenceStep& s : steps) {
    const int n = static_cast<int>(s.tokens.size());
    if (s.fed_query >= fed_limit) {
      return absl::InvalidArgumentError(absl::StrCat("a token fed from query ", s.fed_query,
                                                      " of the previous launch, which answered ", fed_limit));
    }
    if (s.fed_query >= 0) {
      feeds.push_back(static_cast<int32_t>(tokens.size()) + n - 1);
      feeds.push_back(s.fed_query);
    }
    const int offset = static_cast<int>(tables.size());
    tables.insert(tables.end(), s.block_table.begin(), s.block_table.end());
    const int cross = static_cast<int>(tables.size());
    if (enc_dec) tables.insert(tables.end(), s.cross_block_table.begin(), s.cross_block_table.end());
    for (int i = 0; i < n; ++i) {
      const int32_t t = s.tokens[i];
      if (s.all_logits || i == n - 1) keep.push_back(static_cast<int32_t>(tokens.size()));
      tokens.push_back(t);
      position.push_back(s.start_pos + i);
      table_offset.push_back(offset);
      if (enc_dec) {
        cross_position.push_back(s.encoder_len - 1);
        cross_offset.push_back(cross);
      }
    }
    max_keys = std::max(max_keys, s.start_pos + n);
    if (enc_dec) max_input = std::max(max_input, s.encoder_len);
    if (enc_dec && !s.encoder_tokens.empty()) {
      const int first = static_cast<int>(enc_ids.size());
      for (int i = 0; i < s.encoder_len; ++i) {
        enc_ids.push_back(s.encoder_tokens[i]);
        enc_position.push_back(i);
        enc_first.push_back(first);
        enc_len.push_back(s.encoder_len);
        enc_cross.push_back(cross);
        identity.push_back(first + i);
      }
      max_encoded = std::max(max_encoded, s.encoder_len);
    }
  }
  const int total = static_cast<int>(tokens.size()), kept = static_cast<int>(keep.size());
  const int encoded = static_cast<int>(enc_ids.size());
  const int d = c.d_model, w = c.qkv_width();
  // Metadata in one upload: tokens | position | table_offset | keep, then (encoder-decoder)
  // cross_position | cross_offset | enc_ids | enc_position | enc_first | enc_len | enc_cross |
  // identity, and last the block tables: every offset but the tables' length follows from the row
  // counts alone, which a captured decode graph relies on.
  std::vector<int32_t> meta;
  for (const auto* v : {&tokens, &position, &table_offset, &keep, &cross_position, &cross_offset, &enc_ids,
                        &enc_position, &enc_first, &enc_len, &enc_cross, &identity, &tables, &feeds}) {
    meta.insert(meta.end(), v->begin(), v->end());
  }
  StepShape shape;
  shape.tokens = std::max(total, encoded);
  shape.kept = kept;
  shape.tables = static_cast<int64_t>(tables.size());
  shape.encoded = encoded;
  shape.fed = static_cast<int64_t>(feeds.size() / 2);
  shape.max_keys = std::max({max_keys, max_input, max_encoded});
  // Decode: one new token per sequence, only the last logits kept, nothing encoded. It replays a
  // graph whose attention grids span max_seq_len keys (DecodeGraph): its
  // workspace must hold that many splits for every row, also where the rows pass the largest step's.
  const bool decode = encoded == 0 && kept == total && total == static_cast<int>(steps.size());
  if (decode && options_.graphs) shape.max_keys = c.max_seq_len;
  if (absl::Status st = ReserveStep(shape); !st.ok()) return st;  // within the largest step: no-op
  // Up from page-locked memory: an asynchronous copy at the link's speed. The staging area is the
  // launch's slot, whose last user has been collected.
  PinnedBuffer& up = slots_[slot()].meta_up;
  if (absl::Status st = up.Reserve(meta.size() * sizeof(int32_t)); !st.ok()) return st;
  std::copy(meta.begin(), meta.end(), static_cast<int32_t*>(up.ptr));
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(meta_.ptr, up.ptr, meta.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  // The fed tokens, from the previous launch's answers where they are.
  RELGEN_CUDA_RETURN(cuda::FeedTokens(FedFrom(), meta_.i() + meta.size() - feeds.size(), static_cast<int>(feeds.size() / 2),
                                      meta_.i(), stream_));
  StepRows step;
  step.total = total;
  step.kept = kept;
  step.max_keys = max_keys;
  step.max_input = max_input;
  step.tokens = meta_.i();
  step.keep = step.tokens + 3 * total;
  const int32_t* e = step.keep + kept + cross_position.size() + cross_offset.size();  // the encoded rows
  const int32_t* d_tables = e + 6 * encoded;
  cuda::Rows& rows = step.rows;
  rows.n = total;
  rows.position = step.tokens + total;
  rows.table_offset = step.tokens + 2 * total;
  rows.block_tables = d_tables;
  cuda::Rows& cross_rows = step.cross_rows;
  cross_rows = rows;
  cross_rows.position = step.keep + kept;
  cross_rows.table_offset = cross_rows.position + cross_position.size();
  if (encoded > 0) {
    cuda::Rows enc;  // e: ids | position | first | len | cross | identity, `encoded` each
    enc.n = encoded;
    enc.position = e + encoded;
    enc.table_offset = e + 2 * encoded;
    enc.keys = e + 3 * encoded;
    enc.block_tables = e + 5 * encoded;
    cuda::Rows write = enc;  // the same rows into their cross blocks
    write.keys = nullptr;
    write.table_offset = e + 4 * encoded;
    write.block_tables = d_tables;
    if (auto s = Encode(e, enc, max_encoded, write); !s.ok()) return s;
  }
  step.tiled = total > static_cast<int>(steps.size());
  if (auto s = decode && options_.graphs ? DecodeGraph(step) : Decoder(step); !s.ok()) return s;
  kept_ = kept;
  if (logits == nullptr) return absl::OkStatus();
  logits->resize(int64_t{kept} * c.vocab_size);
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(logits->data(), logits_d_.ptr, logits->size() * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  RELGEN_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

// One step's operations, enqueued on stream_: x_ is the residual stream, h_ the branch input and
// then the gathered rows.
struct CudaBackend::DecoderOps {
  CudaBackend& be;
  const ModelConfig& c;
  const StepRows& s;

  float* At(RowsAt at) const { return at == RowsAt::kStream ? be.x_.f() : be.h_.f(); }
  absl::Status Embed() {
    RELGEN_CUDA_RETURN(cuda::Embedding(s.tokens, s.total, be.embed_, c.d_model, c.embedding_scale, be.x_.f(), be.stream_));
    return absl::OkStatus();
  }
  absl::Status Norm(NormOf which, int l, RowsAt at) {
    const DeviceNorm* n = nullptr;
    switch (which) {
      case NormOf::kEmbedding: n = &be.embed_norm_; break;
      case NormOf::kAttention: n = &be.layers_[l].attn_norm; break;
      case NormOf::kCross: n = &be.layers_[l].cross_norm; break;
      case NormOf::kFeedForward: n = &be.layers_[l].ffn_norm; break;
      case NormOf::kFinal: n = &be.final_norm_; break;
    }
    if (at == RowsAt::kGathered) return be.Norm(be.h_.f(), s.kept, *n, be.h_.f());
    return be.Norm(be.x_.f(), s.total, *n, At(at));
  }
  absl::Status QkvToCache(int l, RowsAt in) {
    const cuda::KvPool pool = be.Pool(l);
    bool written = false;
    if (auto st = be.Qkv(At(in), s.total, be.layers_[l], &pool, &s.rows, &written); !st.ok()) return st;
    if (!written) RELGEN_CUDA_RETURN(cuda::WriteKv(pool, s.rows, be.k(), be.v(), be.stream_));
    return absl::OkStatus();
  }
  absl::Status Attention(int l) {
    const DeviceLayer& L = be.layers_[l];
    RELGEN_CUDA_RETURN(cuda::Attention(be.q(), s.rows, s.max_keys, c.attention_scale, L.rel, be.Pool(l), be.att_.f(),
                                       be.work_.f(), be.options_.attention_split_keys, be.stream_, s.tiled));
    return be.Linear(be.att_.f(), s.total, c.qkv_width(), L.o, c.d_model, be.x_.f(), -1, true);
  }
  // Every new token over all its input's keys in the pool.
  absl::Status CrossAttention(int l) {
    const DeviceLayer& L = be.layers_[l];
    const int d = c.d_model, w = c.qkv_width();
    if (auto st = be.Linear(be.h_.f(), s.total, d, L.cq, w, be.q()); !st.ok()) return st;
    RELGEN_CUDA_RETURN(cuda::Attention(be.q(), s.cross_rows, s.max_input, c.attention_scale, cuda::Relative{},
                                       be.Pool(l), be.att_.f(), be.work_.f(), be.options_.attention_split_keys,
                                       be.stream_, s.tiled));
    return be.Linear(be.att_.f(), s.total, w, L.co, d, be.x_.f(), -1, true);
  }
  absl::Status FeedForward(int l, RowsAt in) { return be.Mlp(be.layers_[l], At(in), s.total); }
  // Like an embedding lookup, from the stream.
  absl::Status GatherRows() {
    RELGEN_CUDA_RETURN(cuda::Embedding(s.keep, s.kept, be.x_.f(), c.d_model, 1.f, be.h_.f(), be.stream_));
    return absl::OkStatus();
  }
  // The LM head's input scale as the projection's alpha (tied T5's d_model^-0.5, else 1).
  absl::Status LmHead() {
    const float alpha = c.lm_head_input_scale;
    if (!be.options_.cublas_gemms) {
      RELGEN_CUDA_RETURN(be.Project(be.h_.f(), s.kept, c.d_model, be.lm_head_, c.vocab_size, nullptr, -1, false, alpha,
                                    be.logits_d_.f()));
      return absl::OkStatus();
    }
    return be.Gemm(be.h_.f(), s.kept, c.d_model, be.lm_head_, c.vocab_size, alpha, 0.f, be.logits_d_.f());
  }
};

absl::Status CudaBackend::Decoder(const StepRows& s) {
  DecoderOps ops{*this, model_->config(), s};
  return WalkDecoder(model_->config(), ops);
}

absl::Status CudaBackend::DecodeGraph(StepRows s) {
  auto it = graphs_.find(s.total);
  if (it == graphs_.end()) {
    // Grids sized for the longest context: a split past a row's keys does nothing, and the
    // splits' boundaries do not depend on their count, so every step of s.total rows replays it.
    s.max_keys = s.max_input = model_->config().max_seq_len;
    RELGEN_CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const absl::Status captured = Decoder(s);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = captured.ok() && ended == cudaSuccess ? cudaGraphInstantiate(&exec, graph, 0) : ended;
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!captured.ok()) return captured;
    RELGEN_CUDA_RETURN(made);
    it = graphs_.emplace(s.total, exec).first;
  }
  RELGEN_CUDA_RETURN(cudaGraphLaunch(it->second, stream_));
  return absl::OkStatus();
}

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

int64_t CudaKvBytesPerToken(const ModelConfig& c, cpu::KvType kv_type) {
  return int64_t{2} * c.n_layers * c.n_heads * c.head_dim * cpu::KvTypeBytes(kv_type);
}

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(std::shared_ptr<const Model> model, KvCacheConfig kv, int device) {
  if (kv.num_blocks < 1) return absl::InvalidArgumentError("KV cache needs blocks");
  CudaOptions o;
  o.device = device;
  o.block_size = kv.block_size;
  o.num_blocks = kv.num_blocks;
  return NewCudaBackend(std::move(model), o);
}

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(std::shared_ptr<const Model> model, const CudaOptions& o) {
  if (model == nullptr) return absl::InvalidArgumentError("no model");
  const int device = o.device;
  if (o.block_size < 1 || o.num_blocks < 0) return absl::InvalidArgumentError("KV cache needs blocks");
  if (o.num_blocks == 0 && !(o.kv_memory_fraction > 0.0 && o.kv_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("KV memory fraction ", o.kv_memory_fraction, "; allowed (0, 1]"));
  }
  if (o.max_step_tokens < 1 || o.max_step_seqs < 1) {
    return absl::InvalidArgumentError("the largest step needs at least one token and one sequence");
  }
  if (o.attention_split_keys < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention split of ", o.attention_split_keys, " keys; allowed >= 1 (default 128)"));
  }
  if (model->config().head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", model->config().head_dim,
                                                   ": the CUDA attention kernel supports up to 256"));
  }
  if (o.weight_type == cpu::WeightType::kInt8) {
    return absl::InvalidArgumentError(
        "--weights_dtype int8: the CUDA backend stores f32 or bf16 weights; use f32, bf16, or --device cpu");
  }
  if (o.tensor_cores && (o.weight_type != cpu::WeightType::kBf16 || o.cublas_gemms)) {
    return absl::InvalidArgumentError(
        "--cuda_gemm mma: tensor cores multiply bf16 weights; use --weights_dtype bf16 or auto (bf16 on a GPU), "
        "or --cuda_gemm invariant");
  }
  if (device < 0 || device >= CudaDeviceCount()) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, " is not present (", CudaDeviceCount(), " found)"));
  }
  auto b = std::make_unique<CudaBackend>(std::move(model), o);
  if (auto s = b->Init(); !s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace relgen
