#include "engine/backends/cuda_backend_impl.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/bf16.h"

namespace relgen {
namespace cuda_backend {

CudaBackend::~CudaBackend() {
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

absl::Status CudaBackend::Init() {
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
  const bool bf16 = options_.weight_type == WeightType::kBf16;
  upload_pool_ = std::make_unique<ThreadPool>(
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
      int64_t{kv_.num_blocks} * kv_.block_size * c.n_heads * c.head_dim * KvTypeBytes(options_.kv_type);
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

absl::Status CudaBackend::Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) {
  if (!broken_.ok()) return broken_;
  absl::Status st = RunSteps(steps, logits);
  if (!st.ok()) {
    // An error the device keeps (an asynchronous fault) comes back from every later call; an
    // out-of-memory or a refused launch does not.
    cudaGetLastError();
    if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      broken_ = absl::InternalError(absl::StrCat(DeviceName(), ": ", cudaGetErrorString(e)));
    }
  }
  return st;
}

absl::Status CudaBackend::Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) {
  if (!broken_.ok()) return broken_;
  if (launched_ - collected_ >= 2) {
    return absl::FailedPreconditionError("two launches are outstanding; collect one first");
  }
  absl::Status st = RunSteps(steps, nullptr);
  if (st.ok()) st = AnswerOnDevice(queries);
  if (!st.ok()) {
    cudaGetLastError();
    if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      broken_ = absl::InternalError(absl::StrCat(DeviceName(), ": ", cudaGetErrorString(e)));
    }
    return st;
  }
  ++launched_;
  return absl::OkStatus();
}

CudaBackend::StepShape CudaBackend::LargestStep() const {
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

std::vector<std::pair<DeviceBuffer*, int64_t>> CudaBackend::StepBuffers(const StepShape& s) {
  const ModelConfig& c = model_->config();
  const int64_t d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
  // Meta: 3 ints per decoder row, 2 more for its cross-attention, 6 per encoded row, and one per
  // row of either for its LoRA slot (RunSteps).
  const int64_t meta = (c.encoder_decoder ? 6 : 4) * s.tokens + s.tables + s.kept + 7 * s.encoded + 2 * s.fed;
  return {{&meta_, meta}, {&sample_, SampleBytes(s.queries, s.history) / 4},
          {&x_, s.tokens * d}, {&h_, s.tokens * d}, {&qkv_, 3 * s.tokens * w},
          {&att_, s.tokens * w}, {&up_, s.tokens * f},
          {&gate_, s.tokens * f}, {&logits_d_, s.kept * c.vocab_size},
          {&x16_, CublasBf16() ? (s.tokens * std::max({d, w, f}) + 1) / 2 : 0},
          {&work_, std::max(cuda::AttentionWorkspace(static_cast<int>(s.tokens), c.n_heads, c.head_dim,
                                                     s.max_keys, options_.attention_split_keys),
                            MmaWorkspace(s))},
          {&mma_tickets_, MmaWorkspace(s, true)}};
}

int64_t CudaBackend::MmaWorkspace(const StepShape& s, bool tickets) const {
  if (!options_.tensor_cores) return 0;
  const ModelConfig& c = model_->config();
  const int t = static_cast<int>(s.tokens), d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
  auto need = tickets ? cuda::LinearMmaTickets : cuda::LinearMmaWorkspace;
  int64_t n = need(static_cast<int>(s.kept), d, c.vocab_size, 1);
  for (int batch = 1; batch <= 3; ++batch) {
    for (auto [in, out] : {std::pair{d, w}, std::pair{w, d}, std::pair{d, f}, std::pair{f, d}}) {
      n = std::max(n, need(t, in, out, batch));
    }
  }
  return n;
}

int64_t CudaBackend::StepBytes(const StepShape& s) {
  int64_t bytes = 0;
  for (auto [buf, n] : StepBuffers(s)) bytes += std::max<int64_t>(n, 1) * 4;
  return bytes;
}

absl::Status CudaBackend::ReserveStep(const StepShape& s) {
  for (auto [buf, n] : StepBuffers(s)) {
    void* const was = buf->ptr;
    absl::Status st = buf->Reserve(std::max<int64_t>(n, 1) * 4);
    // Captured graphs hold the buffers' addresses.
    if (buf->ptr != was) DropGraphs();
    if (!st.ok()) return st;
    if (buf == &mma_tickets_ && buf->ptr != was) {
      RELGEN_CUDA_RETURN(cudaMemsetAsync(buf->ptr, 0, buf->bytes, stream_));
    }
  }
  return absl::OkStatus();
}

template <typename T, typename Convert>
absl::Status CudaBackend::UploadRows(const StoredMatrix& m, T* dev, Convert convert) {
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

absl::Status CudaBackend::UploadWidened(const StoredMatrix& m, float* dev) {
  return UploadRows(m, dev, [](float x) { return x; });
}

absl::Status CudaBackend::UploadBf16(const std::vector<std::string>& names, int64_t n) {
  void*& dev = owned16_.emplace_back(nullptr);
  RELGEN_CUDA_RETURN(cudaMalloc(&dev, names.size() * n * sizeof(uint16_t)));
  for (size_t i = 0; i < names.size(); ++i) {
    const StoredMatrix* m = names[i] == "lm_head.weight" ? &model_->lm_head() : model_->Matrix(names[i]);
    if (m == nullptr) return absl::InternalError("weight " + names[i] + " missing on the host");
    uint16_t* part = static_cast<uint16_t*>(dev) + i * n;
    if (auto s = UploadRows(*m, part, [](float x) { return ToBf16(x); }); !s.ok()) return s;
    weights16_[names[i]] = part;
  }
  weight_bytes_ += static_cast<int64_t>(names.size() * n * sizeof(uint16_t));
  return absl::OkStatus();
}

DeviceLayer CudaBackend::LayerOf(const std::string& p) const {
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

absl::Status CudaBackend::ResolveWeights() {
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

cuda::Relative CudaBackend::EncoderRel(int layer) const {
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

cuda::Relative CudaBackend::Rel(int layer) const {
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

}  // namespace cuda_backend

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

int64_t CudaKvBytesPerToken(const ModelConfig& c, KvType kv_type) {
  return int64_t{2} * c.n_layers * c.n_heads * c.head_dim * KvTypeBytes(kv_type);
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
  if (o.weight_type == WeightType::kInt8) {
    return absl::InvalidArgumentError(
        "--weights_dtype int8: the CUDA backend stores f32 or bf16 weights; use f32, bf16, or --device cpu");
  }
  if (o.tensor_cores && (o.weight_type != WeightType::kBf16 || o.cublas_gemms)) {
    return absl::InvalidArgumentError(
        "--cuda_gemm mma: tensor cores multiply bf16 weights; use --weights_dtype bf16 or auto (bf16 on a GPU), "
        "or --cuda_gemm invariant");
  }
  if (o.attention_tensor_cores && o.kv_type != KvType::kBf16) {
    return absl::InvalidArgumentError(
        "--cuda_attention mma: tensor cores read a bf16 cache; use --kv_cache_dtype bf16 or auto (bf16 on a GPU), "
        "or --cuda_attention simt");
  }
  if (device < 0 || device >= CudaDeviceCount()) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, " is not present (", CudaDeviceCount(), " found)"));
  }
  auto b = std::make_unique<cuda_backend::CudaBackend>(std::move(model), o);
  if (auto s = b->Init(); !s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace relgen
