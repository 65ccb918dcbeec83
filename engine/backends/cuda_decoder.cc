// The decoder's operations on the device, for WalkDecoder, and the encoder of encoder-decoder models.
#include "engine/backends/cuda_backend_impl.h"

#include <type_traits>

#include "engine/backends/walk_decoder.h"

namespace relgen {
namespace cuda_backend {

namespace {

int ActivationCode(cpu::Activation a) {
  switch (a) {
    case cpu::Activation::kRelu: return 0;
    case cpu::Activation::kGelu: return 1;
    case cpu::Activation::kGeluTanh: return 2;
    case cpu::Activation::kSilu: return 3;
  }
  return -1;
}

}  // namespace

cudaError_t CudaBackend::Project(const float* x, int rows, int in, const DeviceMatrix& m, int out,
                                 const float* bias, int act, bool residual, float alpha, float* y,
                                 int batch, int64_t w_stride, int64_t bias_stride,
                                 int64_t y_stride) {
  return WithMatrix(m, [&](auto w) {
    if constexpr (std::is_same_v<decltype(w), const uint16_t*>) {
      if (options_.tensor_cores) {
        return cuda::LinearMma(x, rows, in, w, out, bias, act, residual, alpha, y, stream_, batch, w_stride,
                               bias_stride, y_stride, work_.f(), static_cast<unsigned*>(mma_tickets_.ptr));
      }
    }
    return cuda::Linear(x, rows, in, w, out, bias, act, residual, alpha, y, stream_, batch, w_stride, bias_stride,
                        y_stride);
  });
}

absl::Status CudaBackend::Linear(const float* x, int rows, int in, const DeviceMatrix& m, int out, float* y,
                                 int act, bool residual) {
  if (lora_rows_ == nullptr || m.lora < 0) return LinearBase(x, rows, in, m, out, y, act, residual);
  // The adapters' terms join before the activation, as in PEFT's model.
  if (auto st = LinearBase(x, rows, in, m, out, y, -1, residual); !st.ok()) return st;
  if (auto st = ApplyLora(x, rows, in, m, out, y); !st.ok()) return st;
  if (act >= 0) RELGEN_CUDA_RETURN(cuda::BiasActivate(y, rows, out, nullptr, act, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::LinearBase(const float* x, int rows, int in, const DeviceMatrix& m, int out,
                                     float* y, int act, bool residual) {
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

absl::Status CudaBackend::Gemm(const float* x, int rows, int in, const DeviceMatrix& m, int out,
                               float alpha, float beta, float* y, int batch, int64_t w_stride,
                               int64_t y_stride) {
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

absl::Status CudaBackend::Qkv(const float* x, int rows, const DeviceLayer& L, const cuda::KvPool* cache,
                              const cuda::Rows* cache_rows, bool* written) {
  if (lora_rows_ == nullptr || (L.q.lora < 0 && L.k.lora < 0 && L.v.lora < 0)) {
    return QkvBase(x, rows, L, cache, cache_rows, written);
  }
  // The adapters' terms join k and v before they go into the cache: the caller writes them.
  if (written != nullptr) *written = false;
  if (auto st = QkvBase(x, rows, L, nullptr, nullptr, nullptr); !st.ok()) return st;
  const int d = model_->config().d_model, w = model_->config().qkv_width();
  for (auto [m, out] : {std::pair{&L.q, q()}, std::pair{&L.k, k()}, std::pair{&L.v, v()}}) {
    if (auto st = ApplyLora(x, rows, d, *m, w, out); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::QkvBase(const float* x, int rows, const DeviceLayer& L, const cuda::KvPool* cache,
                                  const cuda::Rows* cache_rows, bool* written) {
  if (written != nullptr) *written = false;
  const ModelConfig& c = model_->config();
  const int d = c.d_model, w = c.qkv_width();
  const int64_t wd = int64_t{w} * d;
  const int64_t eb = L.q.element_bytes();
  const char* at = L.q.bytes();
  if (L.k.bytes() != at + wd * eb || L.v.bytes() != at + 2 * wd * eb) {
    for (auto [m, out] : {std::pair{&L.q, q()}, std::pair{&L.k, k()}, std::pair{&L.v, v()}}) {
      if (auto s = LinearBase(x, rows, d, *m, w, out); !s.ok()) return s;
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
              return cuda::QkvToCacheMma(x, rows, d, wqkv, w, bq, q(), *cache, *cache_rows, stream_, work_.f(),
                                         static_cast<unsigned*>(mma_tickets_.ptr));
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
      if (auto s = LinearBase(x, rows, d, *m, w, out); !s.ok()) return s;
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

absl::Status CudaBackend::Norm(const float* x, int rows, const DeviceNorm& n, float* y) {
  const ModelConfig& c = model_->config();
  RELGEN_CUDA_RETURN(cuda::Norm(c.norm == NormKind::kLayerNorm, x, rows, c.d_model, n.w, n.b, c.norm_eps, y, stream_));
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

absl::Status CudaBackend::Encode(const int32_t* ids, const cuda::Rows& enc, int max_len, const cuda::Rows& cross,
                                 const int32_t* lora) {
  // Every projection below, the cross-attention's K and V of the decoder layers too, runs under
  // the adapter of the input's request.
  lora_rows_ = lora;
  const absl::Status st = EncodeLayers(ids, enc, max_len, cross);
  lora_rows_ = nullptr;
  return st;
}

absl::Status CudaBackend::EncodeLayers(const int32_t* ids, const cuda::Rows& enc, int max_len, const cuda::Rows& cross) {
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
    RELGEN_CUDA_RETURN(be.Attend(s.rows, s.max_keys, L.rel, be.Pool(l), s.tiled));
    return be.Linear(be.att_.f(), s.total, c.qkv_width(), L.o, c.d_model, be.x_.f(), -1, true);
  }
  // Every new token over all its input's keys in the pool.
  absl::Status CrossAttention(int l) {
    const DeviceLayer& L = be.layers_[l];
    const int d = c.d_model, w = c.qkv_width();
    if (auto st = be.Linear(be.h_.f(), s.total, d, L.cq, w, be.q()); !st.ok()) return st;
    RELGEN_CUDA_RETURN(be.Attend(s.cross_rows, s.max_input, cuda::Relative{}, be.Pool(l), s.tiled));
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
  lora_rows_ = s.lora;
  const absl::Status st = WalkDecoder(model_->config(), ops);
  lora_rows_ = nullptr;
  return st;
}
}  // namespace cuda_backend
}  // namespace relgen
