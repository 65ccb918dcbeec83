#include "engine/backends/cpu_backend.h"

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace relgen {
namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::shared_ptr<const Model> model, KvCacheConfig kv, int threads)
      : model_(std::move(model)), kv_(kv), pool_(threads) {
    const ModelConfig& c = model_->config();
    const int d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
    dims_.n_heads = c.n_heads;
    dims_.head_dim = c.head_dim;
    dims_.scale = c.attention_scale;
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights& lw = model_->layer(l);
      PackedLayer& pl = packed_.emplace_back();
      pl.q = cpu::PackedMatrix(lw.wq, w, d);
      pl.k = cpu::PackedMatrix(lw.wk, w, d);
      pl.v = cpu::PackedMatrix(lw.wv, w, d);
      pl.o = cpu::PackedMatrix(lw.wo, d, w);
      pl.up = cpu::PackedMatrix(lw.w_up, f, d);
      if (lw.w_gate != nullptr) pl.gate = cpu::PackedMatrix(lw.w_gate, f, d);
      pl.down = cpu::PackedMatrix(lw.w_down, d, f);
      cpu::RelativeParams r;
      r.scheme = c.rel.scheme;
      r.heads_share = c.rel.heads_share_table;
      r.scale_with_qk = c.rel.scale_with_qk;
      r.block_length = c.rel.block_length;
      r.table_k = lw.rel_k;
      r.table_v = lw.rel_v;
      if (c.rel.scheme == relpos::Scheme::kShaw) {
        r.clip_k = c.rel.clip;
        r.rows = 2 * c.rel.clip + 1;
      } else {
        r.rows = c.rel.max_relative_position;
      }
      r.t5_bias = lw.rel_bias;
      r.t5_num_buckets = c.rel.num_buckets;
      r.t5_bucket_of_distance = model_->t5_bucket_table().data();
      r.t5_table_len = static_cast<int>(model_->t5_bucket_table().size());
      r.alibi_slopes = model_->alibi_slopes().data();
      rel_.push_back(r);
    }
    lm_head_ = cpu::PackedMatrix(model_->lm_head(), c.vocab_size, d);
    // Per layer: K and V pools [num_blocks, n_heads, block_size, head_dim].
    layer_floats_ = int64_t{kv_.num_blocks} * kv_.block_size * c.n_heads * c.head_dim;
    k_pool_.resize(layer_floats_ * c.n_layers);
    v_pool_.resize(layer_floats_ * c.n_layers);
  }

  absl::string_view name() const override { return "cpu"; }

  const KvCacheConfig& kv_cache() const override { return kv_; }
  std::string device() const override { return "cpu"; }
  BackendMemory memory() const override {
    BackendMemory m;
    m.weights = model_->float_bytes() + lm_head_.bytes();
    for (const PackedLayer& p : packed_) {
      for (const cpu::PackedMatrix* w : {&p.q, &p.k, &p.v, &p.o, &p.up, &p.gate, &p.down}) m.weights += w->bytes();
    }
    m.kv_cache = static_cast<int64_t>(k_pool_.size() + v_pool_.size()) * sizeof(float);
    for (const std::vector<float>* v : {&x_, &h_, &q_, &k_, &v_, &att_, &tmp_, &up_, &gate_}) {
      m.activations += static_cast<int64_t>(v->capacity()) * sizeof(float);
    }
    return m;
  }

  absl::Status Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) override;

 private:
  void Norm(const float* x, int rows, const float* w, const float* b, float* y) const {
    const ModelConfig& c = model_->config();
    if (c.norm == NormKind::kLayerNorm) {
      cpu::LayerNorm(x, rows, c.d_model, w, b, c.norm_eps, y);
    } else {
      cpu::RmsNorm(x, rows, c.d_model, w, c.norm_eps, y);
    }
  }

  struct PackedLayer {
    cpu::PackedMatrix q, k, v, o, up, gate, down;
  };
  void Linear(const float* x, int rows, const cpu::PackedMatrix& w, const float* bias, float* y) {
    cpu::LinearPacked(x, rows, w, bias, y, &pool_);
  }

  cpu::KvView View(int layer, absl::Span<const int32_t> table) {
    const ModelConfig& c = model_->config();
    cpu::KvView view;
    view.k = k_pool_.data() + layer * layer_floats_;
    view.v = v_pool_.data() + layer * layer_floats_;
    view.block_table = table.data();
    view.block_size = kv_.block_size;
    view.n_heads = c.n_heads;
    view.head_dim = c.head_dim;
    return view;
  }

  std::shared_ptr<const Model> model_;
  KvCacheConfig kv_;
  int64_t layer_floats_ = 0;
  std::vector<float> k_pool_, v_pool_;
  cpu::ThreadPool pool_;
  std::vector<PackedLayer> packed_;
  cpu::PackedMatrix lm_head_;
  cpu::AttentionDims dims_;
  std::vector<cpu::RelativeParams> rel_;
  // Activations, reused across calls: [tokens, width].
  std::vector<float> x_, h_, q_, k_, v_, att_, tmp_, up_, gate_;
};

absl::Status CpuBackend::Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) {
  const ModelConfig& c = model_->config();
  if (auto st = ValidateSteps(steps, c.vocab_size, c.max_seq_len, kv_); !st.ok()) return st;
  int total = 0;
  int out_rows = 0;
  for (const SequenceStep& s : steps) {
    total += static_cast<int>(s.tokens.size());
    out_rows += s.all_logits ? static_cast<int>(s.tokens.size()) : 1;
  }
  const int d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
  auto sized = [](std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  };
  float* x = sized(x_, int64_t{total} * d);
  float* h = sized(h_, int64_t{total} * d);
  float* q = sized(q_, int64_t{total} * w);
  float* k = sized(k_, int64_t{total} * w);
  float* v = sized(v_, int64_t{total} * w);
  float* att = sized(att_, int64_t{total} * w);
  float* tmp = sized(tmp_, int64_t{total} * d);
  float* up = sized(up_, int64_t{total} * f);
  float* gate = c.ffn_gated ? sized(gate_, int64_t{total} * f) : nullptr;

  {
    int row = 0;
    for (const SequenceStep& s : steps) {
      cpu::Embedding(model_->embed(), d, s.tokens.data(), static_cast<int>(s.tokens.size()),
                     c.embedding_scale, x + int64_t{row} * d);
      row += static_cast<int>(s.tokens.size());
    }
  }
  if (c.embedding_norm) Norm(x, total, model_->embed_norm_w(), model_->embed_norm_b(), x);
  const bool pre = c.norm_placement == NormPlacement::kPre;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = model_->layer(l);
    const float* in = x;
    if (pre) {
      Norm(x, total, lw.attn_norm_w, lw.attn_norm_b, h);
      in = h;
    }
    Linear(in, total, packed_[l].q, lw.bq, q);
    Linear(in, total, packed_[l].k, lw.bk, k);
    Linear(in, total, packed_[l].v, lw.bv, v);
    // K/V of every new token first, then attention, one (sequence, head) per work item.
    std::vector<int> rows(steps.size());
    for (size_t i = 0, row = 0; i < steps.size(); row += steps[i].tokens.size(), ++i) {
      rows[i] = static_cast<int>(row);
      const int64_t off = int64_t{rows[i]} * w;
      cpu::WriteKv(View(l, steps[i].block_table), k + off, v + off, steps[i].start_pos,
                   static_cast<int>(steps[i].tokens.size()));
    }
    const int heads = c.n_heads;
    pool_.ParallelFor(static_cast<int>(steps.size()) * heads, [&](int begin, int end) {
      for (int item = begin; item < end; ++item) {
        const SequenceStep& s = steps[item / heads];
        const int h = item % heads;
        const int n = static_cast<int>(s.tokens.size());
        const int64_t off = int64_t{rows[item / heads]} * w;
        const cpu::KvView view = View(l, s.block_table);
        if (n == 1) {
          cpu::AttentionDecode(dims_, rel_[l], view, q + off, s.start_pos, att + off, h, h + 1);
        } else {
          cpu::AttentionPrefill(dims_, rel_[l], view, q + off, s.start_pos, n, att + off, h, h + 1);
        }
      }
    });
    Linear(att, total, packed_[l].o, lw.bo, tmp);
    cpu::AddInPlace(x, tmp, int64_t{total} * d);
    if (!pre) Norm(x, total, lw.attn_norm_w, lw.attn_norm_b, x);

    in = x;
    if (pre) {
      Norm(x, total, lw.ffn_norm_w, lw.ffn_norm_b, h);
      in = h;
    }
    Linear(in, total, packed_[l].up, lw.b_up, up);
    if (c.ffn_gated) {
      Linear(in, total, packed_[l].gate, lw.b_gate, gate);
      cpu::ActivateGated(c.ffn_activation, gate, up, int64_t{total} * f);
      std::swap(up, gate);
    } else {
      cpu::Activate(c.ffn_activation, up, int64_t{total} * f);
    }
    Linear(up, total, packed_[l].down, lw.b_down, tmp);
    cpu::AddInPlace(x, tmp, int64_t{total} * d);
    if (!pre) Norm(x, total, lw.ffn_norm_w, lw.ffn_norm_b, x);
  }

  // Rows whose logits are wanted, gathered before the final norm and the vocabulary projection.
  float* sel = h;
  {
    int row = 0, o = 0;
    for (const SequenceStep& s : steps) {
      const int n = static_cast<int>(s.tokens.size());
      const int first = s.all_logits ? row : row + n - 1;
      const int count = s.all_logits ? n : 1;
      std::copy(x + int64_t{first} * d, x + int64_t{first + count} * d, sel + int64_t{o} * d);
      o += count;
      row += n;
    }
  }
  if (pre) Norm(sel, out_rows, model_->final_norm_w(), model_->final_norm_b(), sel);
  logits->resize(int64_t{out_rows} * c.vocab_size);
  Linear(sel, out_rows, lm_head_, nullptr, logits->data());
  return absl::OkStatus();
}

}  // namespace

int64_t CpuKvBytesPerToken(const ModelConfig& c) {
  return int64_t{2} * c.n_layers * c.n_heads * c.head_dim * static_cast<int64_t>(sizeof(float));
}

absl::StatusOr<int> CpuKvBlocks(const ModelConfig& c, int64_t tokens, double memory_fraction,
                                int block_size) {
  const int64_t per_block = CpuKvBytesPerToken(c) * block_size;
  if (block_size < 1) return absl::InvalidArgumentError("KV block size must be >= 1");
  int64_t blocks;
  if (tokens > 0) {
    blocks = (tokens + block_size - 1) / block_size;
  } else {
    if (!(memory_fraction > 0.0 && memory_fraction <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat("KV memory fraction ", memory_fraction, "; allowed (0, 1]"));
    }
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    while (meminfo >> key >> kib) {
      if (key == "MemAvailable:") break;
      meminfo.ignore(256, '\n');
    }
    blocks = static_cast<int64_t>(memory_fraction * static_cast<double>(kib) * 1024.0) / per_block;
  }
  const int64_t need = (c.max_seq_len + block_size - 1) / block_size;
  if (blocks < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a KV pool of ", blocks * block_size, " tokens cannot hold one sequence of max_seq_len ",
        c.max_seq_len, " (", per_block / block_size, " bytes per token); give at least ",
        need * block_size, " tokens"));
  }
  return static_cast<int>(std::min<int64_t>(blocks, 1 << 30));
}

absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(std::shared_ptr<const Model> model,
                                                       KvCacheConfig kv, int threads) {
  if (model == nullptr) return absl::InvalidArgumentError("no model");
  if (kv.block_size < 1 || kv.num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache of ", kv.num_blocks, " blocks of ",
                                                   kv.block_size, " tokens; both must be >= 1"));
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(std::move(model), kv, threads);
}

}  // namespace relgen
