#include "engine/backends/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backends/host_launch.h"
#include "engine/backends/step_sync.h"
#include "engine/backends/walk_decoder.h"
#include "kernels/cpu/attention.h"
#include "kernels/bf16.h"
#include "kernels/cpu/gemm.h"
#include "kernels/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace relgen {
namespace {

// A K or V pool: raw storage of float or bf16 elements in an anonymous mapping, which reads as
// zeros and takes memory only for the pages a sequence writes: a pool sized for max_num_seqs whole
// contexts costs what is used.
class KvPool {
 public:
  ~KvPool() { Reset(); }
  bool resize(int64_t bytes) {
    Reset();
    void* p = ::mmap(nullptr, std::max<int64_t>(bytes, 1), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (p == MAP_FAILED) return false;
    data_ = static_cast<char*>(p);
    bytes_ = bytes;
    return true;
  }
  char* data() { return data_; }
  int64_t size() const { return bytes_; }

 private:
  void Reset() {
    if (data_ != nullptr) ::munmap(data_, std::max<int64_t>(bytes_, 1));
    data_ = nullptr;
    bytes_ = 0;
  }
  char* data_ = nullptr;
  int64_t bytes_ = 0;
};

// A stored matrix packed for the GEMM from its stored rows (widened one at a time); its mapped
// pages leave resident memory once packed.
cpu::PackedMatrix Pack(const StoredMatrix& m, cpu::WeightType wt) {
  cpu::PackedMatrix packed(static_cast<int>(m.rows), static_cast<int>(m.cols), wt,
                           [&m](int row, float* out) { m.Widen(row, 1, out); });
  m.ReleasePages();
  return packed;
}

// Rows of the stored embedding for `ids`, times `scale`, into out [n, dim].
void EmbedRows(const StoredMatrix& table, const int32_t* ids, int n, float scale, float* out) {
  const int64_t dim = table.cols;
  for (int i = 0; i < n; ++i) {
    float* o = out + i * dim;
    table.Widen(ids[i], 1, o);
    for (int64_t d = 0; d < dim; ++d) o[d] = o[d] * scale;
  }
}

class CpuBackend final : public Backend, public LogitsForward {
 public:
  CpuBackend(std::shared_ptr<const Model> model, KvCacheConfig kv, int threads, cpu::WeightType wt,
             cpu::KvType kv_type, ProjectionInputs inputs)
      : model_(std::move(model)),
        kv_(kv),
        weight_type_(wt),
        kv_type_(kv_type),
        bf16_activations_(inputs != ProjectionInputs::kF32),
        bf16_dot_(inputs == ProjectionInputs::kBf16Dot && wt == cpu::WeightType::kBf16 && cpu::Bf16DotSupported()),
        pool_(threads) {
    const ModelConfig& c = model_->config();
    const int d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
    dims_.n_heads = c.n_heads;
    dims_.head_dim = c.head_dim;
    dims_.scale = c.attention_scale;
    auto pack = [&](const LayerWeights& lw) {
      PackedLayer pl;
      pl.q = Pack(*lw.wq, wt);
      pl.k = Pack(*lw.wk, wt);
      pl.v = Pack(*lw.wv, wt);
      pl.o = Pack(*lw.wo, wt);
      pl.up = Pack(*lw.w_up, wt);
      if (lw.w_gate != nullptr) pl.gate = Pack(*lw.w_gate, wt);
      pl.down = Pack(*lw.w_down, wt);
      if (lw.cq != nullptr) {
        pl.cq = Pack(*lw.cq, wt);
        pl.ck = Pack(*lw.ck, wt);
        pl.cv = Pack(*lw.cv, wt);
        pl.co = Pack(*lw.co, wt);
      }
      return pl;
    };
    if (c.encoder_decoder) {
      for (int l = 0; l < c.n_encoder_layers; ++l) {
        const LayerWeights& lw = model_->encoder_layer(l);
        encoder_packed_.push_back(pack(lw));
        // Bidirectional buckets: the signed table, indexed by key - query + max_distance.
        cpu::RelativeParams r;
        r.scheme = c.rel.scheme;
        r.heads_share = c.rel.heads_share_table;
        r.t5_bias = lw.rel_bias;
        r.t5_num_buckets = c.rel.num_buckets;
        r.t5_bucket_of_distance = model_->t5_encoder_bucket_table().data();
        r.t5_table_len = static_cast<int>(model_->t5_encoder_bucket_table().size());
        encoder_rel_.push_back(r);
      }
    }
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights& lw = model_->layer(l);
      packed_.push_back(pack(lw));
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
    lm_head_ = Pack(model_->lm_head(), wt);
    // The packed projection of each relgen matrix name, where an adapter's matrices attach.
    auto name = [&](const std::string& stack, int l, PackedLayer& pl) {
      const std::string p = absl::StrCat(stack, "layers.", l, ".");
      for (auto [suffix, m] : {std::pair{"attn.q", &pl.q}, {"attn.k", &pl.k}, {"attn.v", &pl.v}, {"attn.o", &pl.o},
                               {"ffn.up", &pl.up}, {"ffn.gate", &pl.gate}, {"ffn.down", &pl.down},
                               {"cross.q", &pl.cq}, {"cross.k", &pl.ck}, {"cross.v", &pl.cv}, {"cross.o", &pl.co}}) {
        projection_of_[absl::StrCat(p, suffix, ".weight")] = m;
      }
    };
    for (size_t l = 0; l < packed_.size(); ++l) name("", static_cast<int>(l), packed_[l]);
    for (size_t l = 0; l < encoder_packed_.size(); ++l) name("encoder.", static_cast<int>(l), encoder_packed_[l]);
    // Per layer: K and V pools [num_blocks, n_heads, block_size, head_dim] of kv_type elements.
    layer_bytes_ = int64_t{kv_.num_blocks} * kv_.block_size * c.n_heads * c.head_dim * cpu::KvTypeBytes(kv_type_);
    pool_ok_ = k_pool_.resize(layer_bytes_ * c.n_layers) && v_pool_.resize(layer_bytes_ * c.n_layers);
  }

  // False when the pool's address space could not be had.
  bool pool_ok() const { return pool_ok_; }
  BackendInfo Describe() const override {
    BackendInfo info;
    info.name = "cpu";
    info.device = "cpu";
    info.kv_cache = kv_;
    info.memory = Memory();
    info.weights_dtype = cpu::WeightTypeName(weight_type_);
    info.kv_cache_dtype = cpu::KvTypeName(kv_type_);
    // What this CPU's features picked.
    info.projections = bf16_dot_ ? cpu::Bf16DotPathName() : cpu::GemmPathName(weight_type_, bf16_activations_);
    return info;
  }

  // The whole step runs here; the answers are drawn on the worker threads, a range of queries each.
  absl::Status Launch(absl::Span<const SequenceStep> steps, absl::Span<const RowQuery> queries) override {
    auto forward = [this](absl::Span<const SequenceStep> s, std::vector<float>* logits) { return Forward(s, logits); };
    return launch_.Launch(forward, steps, queries,
                          [this](int n, const std::function<void(int, int)>& fn) { pool_.ParallelFor(n, fn); });
  }
  absl::Status Collect(std::vector<SampleResult>* results) override { return launch_.Collect(results); }
  absl::Status Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) override;
  absl::Status ConfigureLora(int max_loras, int max_rank) override {
    if (max_loras < 1 || max_rank < 1) {
      return absl::InvalidArgumentError(absl::StrCat("max_loras ", max_loras, ", max_lora_rank ", max_rank,
                                                     "; both must be >= 1"));
    }
    slots_.clear();
    slots_.resize(max_loras);
    residency_.Reset(max_loras);
    lora_scratch_.assign(max_loras, LoraScratch{});
    return absl::OkStatus();
  }

 private:
  BackendMemory Memory() const {
    BackendMemory m;
    // The embedding is read as stored, a row per token; the small tensors were widened at load.
    m.weights = model_->small_bytes() + model_->embed().bytes() + lm_head_.bytes();
    for (const auto* stack : {&packed_, &encoder_packed_}) {
      for (const PackedLayer& p : *stack) {
        for (const cpu::PackedMatrix* w : {&p.q, &p.k, &p.v, &p.o, &p.up, &p.gate, &p.down, &p.cq, &p.ck, &p.cv, &p.co}) {
          m.weights += w->bytes();
        }
      }
    }
    for (const LoraSlot& slot : slots_) {
      for (const auto& [base, lp] : slot.of) m.weights += lp.a.bytes() + lp.b.bytes();
    }
    m.kv_cache = static_cast<int64_t>(k_pool_.size() + v_pool_.size());
    for (const std::vector<float>* v : {&x_, &h_, &q_, &k_, &v_, &att_, &tmp_, &up_, &gate_, &enc_k_, &enc_v_}) {
      m.activations += static_cast<int64_t>(v->capacity()) * sizeof(float);
    }
    return m;
  }

  // fn(begin, end) over row ranges, on the pool when there is enough work to pay for the hand-off.
  // Row-wise and element-wise kernels give the same bits however the rows are split.
  void Rows(int rows, int64_t row_elems, const std::function<void(int, int)>& fn) {
    if (int64_t{rows} * row_elems < (int64_t{1} << 16)) {
      fn(0, rows);
      return;
    }
    pool_.ParallelFor(rows, fn);
  }
  void Norm(const float* x, int rows, const float* w, const float* b, float* y) {
    const ModelConfig& c = model_->config();
    const int d = c.d_model;
    Rows(rows, d, [&](int r0, int r1) {
      const int64_t o = int64_t{r0} * d;
      if (c.norm == NormKind::kLayerNorm) {
        cpu::LayerNorm(x + o, r1 - r0, d, w, b, c.norm_eps, y + o);
      } else {
        cpu::RmsNorm(x + o, r1 - r0, d, w, c.norm_eps, y + o);
      }
    });
  }
  void Add(float* y, const float* x, int rows, int width) {
    Rows(rows, width, [&](int r0, int r1) {
      const int64_t o = int64_t{r0} * width;
      cpu::AddInPlace(y + o, x + o, int64_t{r1 - r0} * width);
    });
  }

  struct PackedLayer {
    cpu::PackedMatrix q, k, v, o, up, gate, down;
    cpu::PackedMatrix cq, ck, cv, co;  // cross-attention (encoder-decoder decoder layers)
  };
  // Scratch of one Forward, [tokens, width] each (the encoder pass uses them first).
  struct Buffers {
    float *x, *h, *q, *k, *v, *att, *tmp, *up, *gate;
  };
  Buffers Size(int total);
  // The feed-forward block's body on `in` [total, d_model], its output added to x.
  void Mlp(const LayerWeights& lw, const PackedLayer& pl, const float* in, int total, const Buffers& b);
  // The operations WalkDecoder (walk_decoder.h) calls for one Forward.
  struct DecoderOps;
  // Encodes the input of every step that carries one and writes each decoder layer's cross K/V.
  void Encode(absl::Span<const SequenceStep> steps, const std::vector<int>& step_slots);
  void Linear(const float* x, int rows, const cpu::PackedMatrix& w, const float* bias, float* y) {
    const float* const x_in = x;  // an adapter reads the float32 input, as PEFT's float32 model does
    if (bf16_dot_) {
      cpu::LinearBf16Dot(x, rows, w, bias, y, &pool_);  // rounds the inputs itself
      ApplyLora(x_in, rows, w, y);
      return;
    }
    if (bf16_activations_) {
      const int k = w.k();
      rounded_.resize(int64_t{rows} * k);
      Rows(rows, k, [&](int r0, int r1) {
        for (int64_t i = int64_t{r0} * k; i < int64_t{r1} * k; ++i) rounded_[i] = cpu::FromBf16(cpu::ToBf16(x[i]));
      });
      x = rounded_.data();
    }
    cpu::LinearPacked(x, rows, w, bias, y, &pool_);
    ApplyLora(x_in, rows, w, y);
  }

  // One resident adapter: its matrices packed beside the base projections they adapt.
  struct LoraPacked {
    cpu::PackedMatrix a, b;  // [rank, in], [out, rank]
    float scale = 0;
  };
  struct LoraSlot {
    std::unordered_map<const cpu::PackedMatrix*, LoraPacked> of;
  };
  // The slot of each step's adapter (-1: none), loading the ones not resident (residency_).
  absl::StatusOr<std::vector<int>> LoraSlots(absl::Span<const SequenceStep> steps);
  // Each row's slot for the rows of the pass about to run: per step `slot`, rows[i] on.
  void SetLoraRows(const std::vector<int>& slot, const std::vector<int>& first, const std::vector<int>& count, int total);
  // y [rows, w.n()] += each row's adapter's scale * (x A^T) B^T, where its adapter adapts w; rows of
  // one adapter gathered, so a row's bits depend on its adapter alone.
  void ApplyLora(const float* x, int rows, const cpu::PackedMatrix& w, float* y);

  cpu::KvView View(int layer, absl::Span<const int32_t> table) {
    const ModelConfig& c = model_->config();
    cpu::KvView view;
    view.k = k_pool_.data() + layer * layer_bytes_;
    view.v = v_pool_.data() + layer * layer_bytes_;
    view.block_table = table.data();
    view.block_size = kv_.block_size;
    view.n_heads = c.n_heads;
    view.head_dim = c.head_dim;
    view.type = kv_type_;
    return view;
  }

  std::shared_ptr<const Model> model_;
  KvCacheConfig kv_;
  cpu::WeightType weight_type_;
  cpu::KvType kv_type_;
  bool bf16_activations_;
  bool bf16_dot_;  // bf16 inputs x bf16 weights through AMX-BF16 or AVX-512 BF16 dot products
  int64_t layer_bytes_ = 0;
  KvPool k_pool_, v_pool_;
  bool pool_ok_ = false;
  std::vector<float> rounded_;  // the rounded input of one projection
  cpu::ThreadPool pool_;
  std::vector<PackedLayer> packed_, encoder_packed_;
  cpu::PackedMatrix lm_head_;
  cpu::AttentionDims dims_;
  std::vector<cpu::RelativeParams> rel_, encoder_rel_;
  cpu::RelativeParams cross_rel_;  // cross-attention has no relative term
  // Activations, reused across calls: [tokens, width]; the encoder's own K/V (not cached).
  std::vector<float> x_, h_, q_, k_, v_, att_, tmp_, up_, gate_, enc_k_, enc_v_;
  HostLaunch launch_;
  std::unordered_map<std::string, const cpu::PackedMatrix*> projection_of_;
  std::vector<LoraSlot> slots_;  // ConfigureLora's max_loras
  LoraResidency residency_;
  int lora_total_ = 0;  // rows of the pass under way where some have an adapter, else 0
  struct LoraScratch {
    std::vector<int> rows;  // the slot's rows in the pass under way
    std::vector<float> x, t, u;  // gathered inputs, x A^T, (x A^T) B^T
  };
  std::vector<LoraScratch> lora_scratch_;  // per slot
  struct LoraWork {
    const LoraPacked* lp;
    std::vector<int>* rows;
    LoraScratch* scratch;
  };
  std::vector<LoraWork> lora_work_;  // one projection's adapters (ApplyLora), kept for its capacity
};

absl::StatusOr<std::vector<int>> CpuBackend::LoraSlots(absl::Span<const SequenceStep> steps) {
  return residency_.Assign(steps, [this](int s, const LoraAdapter& a) {
    LoraSlot fresh;
    for (const auto& [name, w] : a.targets) {
      auto p = projection_of_.find(name);
      if (p == projection_of_.end()) {
        return absl::InvalidArgumentError(absl::StrCat("adapter '", a.name, "' adapts ", name, ", which this model lacks"));
      }
      LoraPacked lp;
      lp.a = cpu::PackedMatrix(w.a.data(), w.rank, w.in);
      lp.b = cpu::PackedMatrix(w.b.data(), w.out, w.rank);
      lp.scale = w.scale;
      fresh.of.emplace(p->second, std::move(lp));
    }
    slots_[s] = std::move(fresh);
    return absl::OkStatus();
  });
}

void CpuBackend::SetLoraRows(const std::vector<int>& slot, const std::vector<int>& first, const std::vector<int>& count,
                             int total) {
  lora_total_ = 0;
  for (LoraScratch& sc : lora_scratch_) sc.rows.clear();
  for (size_t i = 0; i < slot.size(); ++i) {
    if (slot[i] < 0) continue;  // rows without an adapter cost nothing
    std::vector<int>& rows = lora_scratch_[slot[i]].rows;
    for (int r = first[i]; r < first[i] + count[i]; ++r) rows.push_back(r);
    lora_total_ = total;
  }
}

void CpuBackend::ApplyLora(const float* x, int rows, const cpu::PackedMatrix& w, float* y) {
  if (lora_total_ != rows) return;  // no adapter in the pass, or not its rows (the LM head's)
  const int k = w.k(), n = w.n();
  // The adapters of this step that adapt w, and their rows.
  std::vector<LoraWork>& work = lora_work_;
  work.clear();
  for (size_t s = 0; s < slots_.size(); ++s) {
    const LoraSlot& slot = slots_[s];
    if (!residency_.InStep(static_cast<int>(s))) continue;
    auto it = slot.of.find(&w);
    if (it == slot.of.end()) continue;
    LoraScratch& sc = lora_scratch_[s];
    if (!sc.rows.empty()) work.push_back({&it->second, &sc.rows, &sc});
  }
  // One adapter's rows: gathered, through A and B, scaled into y (rows of different adapters are
  // disjoint, so adapters may run at once).
  auto apply = [&](const LoraWork& wk, cpu::ThreadPool* pool) {
    const int m = static_cast<int>(wk.rows->size()), rank = wk.lp->a.n();
    LoraScratch& sc = *wk.scratch;
    sc.x.resize(int64_t{m} * k);
    sc.t.resize(int64_t{m} * rank);
    sc.u.resize(int64_t{m} * n);
    for (int i = 0; i < m; ++i) std::copy_n(x + int64_t{(*wk.rows)[i]} * k, k, sc.x.data() + int64_t{i} * k);
    cpu::LinearPacked(sc.x.data(), m, wk.lp->a, nullptr, sc.t.data(), pool);
    cpu::LinearPacked(sc.t.data(), m, wk.lp->b, nullptr, sc.u.data(), pool);
    for (int i = 0; i < m; ++i) {
      float* yr = y + int64_t{(*wk.rows)[i]} * n;
      const float* ur = sc.u.data() + int64_t{i} * n;
      for (int o = 0; o < n; ++o) yr[o] += ur[o] * wk.lp->scale;
    }
  };
  // Several adapters (a decode step's few rows each): one task per adapter, so the step makes one
  // hand-off to the pool per projection, not two per adapter. One adapter: its GEMMs split over the
  // pool by output panels. Either way no element's arithmetic changes.
  if (work.size() > 1) {
    pool_.ParallelFor(static_cast<int>(work.size()), [&](int begin, int end) {
      for (int i = begin; i < end; ++i) apply(work[i], nullptr);
    });
  } else if (!work.empty()) {
    apply(work[0], &pool_);
  }
}

CpuBackend::Buffers CpuBackend::Size(int total) {
  const ModelConfig& c = model_->config();
  const int64_t d = c.d_model, w = c.qkv_width(), f = c.ffn_dim;
  auto sized = [](std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  };
  return {sized(x_, total * d),   sized(h_, total * d),   sized(q_, total * w),
          sized(k_, total * w),   sized(v_, total * w),   sized(att_, total * w),
          sized(tmp_, total * d), sized(up_, total * f),  c.ffn_gated ? sized(gate_, total * f) : nullptr};
}

void CpuBackend::Mlp(const LayerWeights& lw, const PackedLayer& pl, const float* in, int total, const Buffers& b) {
  const ModelConfig& c = model_->config();
  Linear(in, total, pl.up, lw.b_up, b.up);
  const float* act = b.up;
  const int f = c.ffn_dim;
  if (c.ffn_gated) {
    Linear(in, total, pl.gate, lw.b_gate, b.gate);
    Rows(total, f, [&](int r0, int r1) {
      const int64_t o = int64_t{r0} * f;
      cpu::ActivateGated(c.ffn_activation, b.gate + o, b.up + o, int64_t{r1 - r0} * f);
    });
    act = b.gate;
  } else {
    Rows(total, f, [&](int r0, int r1) { cpu::Activate(c.ffn_activation, b.up + int64_t{r0} * f, int64_t{r1 - r0} * f); });
  }
  Linear(act, total, pl.down, lw.b_down, b.tmp);
  Add(b.x, b.tmp, total, c.d_model);
}

void CpuBackend::Encode(absl::Span<const SequenceStep> steps, const std::vector<int>& step_slots) {
  const ModelConfig& c = model_->config();
  std::vector<int> which, rows;
  int total = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].encoder_tokens.empty()) continue;
    which.push_back(static_cast<int>(i));
    rows.push_back(total);
    total += steps[i].encoder_len;
  }
  if (which.empty()) return;
  {
    std::vector<int> slot, count;
    for (int j : which) {
      slot.push_back(step_slots[j]);
      count.push_back(steps[j].encoder_len);
    }
    SetLoraRows(slot, rows, count, total);
  }
  const int d = c.d_model, w = c.qkv_width(), heads = c.n_heads;
  const Buffers b = Size(total);
  if (static_cast<int64_t>(enc_k_.size()) < int64_t{total} * w) {
    enc_k_.resize(int64_t{total} * w);
    enc_v_.resize(int64_t{total} * w);
  }
  for (size_t j = 0; j < which.size(); ++j) {
    const SequenceStep& s = steps[which[j]];
    EmbedRows(model_->embed(), s.encoder_tokens.data(), s.encoder_len, c.embedding_scale, b.x + int64_t{rows[j]} * d);
  }
  // Each input's K/V as one contiguous block: attention never crosses inputs.
  static const int32_t kOneBlock[1] = {0};
  auto view = [&](size_t j) {
    cpu::KvView kv;
    kv.k = enc_k_.data() + int64_t{rows[j]} * w;
    kv.v = enc_v_.data() + int64_t{rows[j]} * w;
    kv.block_table = kOneBlock;
    kv.block_size = steps[which[j]].encoder_len;
    kv.n_heads = heads;
    kv.head_dim = c.head_dim;
    return kv;
  };
  for (int l = 0; l < c.n_encoder_layers; ++l) {
    const LayerWeights& lw = model_->encoder_layer(l);
    const PackedLayer& pl = encoder_packed_[l];
    Norm(b.x, total, lw.attn_norm_w, lw.attn_norm_b, b.h);
    Linear(b.h, total, pl.q, lw.bq, b.q);
    Linear(b.h, total, pl.k, lw.bk, b.k);
    Linear(b.h, total, pl.v, lw.bv, b.v);
    for (size_t j = 0; j < which.size(); ++j) {
      const int64_t off = int64_t{rows[j]} * w;
      cpu::WriteKv(view(j), b.k + off, b.v + off, 0, steps[which[j]].encoder_len);
    }
    pool_.ParallelFor(static_cast<int>(which.size()) * heads, [&](int begin, int end) {
      for (int item = begin; item < end; ++item) {
        const size_t j = item / heads;
        const int h = item % heads;
        const int64_t off = int64_t{rows[j]} * w;
        cpu::AttentionBidirectional(dims_, encoder_rel_[l], view(j), b.q + off, steps[which[j]].encoder_len,
                                    b.att + off, h, h + 1);
      }
    });
    Linear(b.att, total, pl.o, lw.bo, b.tmp);
    Add(b.x, b.tmp, total, d);
    if (c.norm_placement == NormPlacement::kPre) {
      Norm(b.x, total, lw.ffn_norm_w, lw.ffn_norm_b, b.h);
      Mlp(lw, pl, b.h, total, b);
    } else {
      Mlp(lw, pl, b.x, total, b);
      Norm(b.x, total, lw.ffn_norm_w, lw.ffn_norm_b, b.x);
    }
  }
  Norm(b.x, total, model_->encoder_final_norm_w(), model_->encoder_final_norm_b(), b.h);
  // Every decoder layer's cross-attention keys and values of the encoder output, into the pool.
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = model_->layer(l);
    Linear(b.h, total, packed_[l].ck, lw.ck_b, b.k);
    Linear(b.h, total, packed_[l].cv, lw.cv_b, b.v);
    for (size_t j = 0; j < which.size(); ++j) {
      const SequenceStep& s = steps[which[j]];
      const int64_t off = int64_t{rows[j]} * w;
      cpu::WriteKv(View(l, s.cross_block_table), b.k + off, b.v + off, 0, s.encoder_len);
    }
  }
}

// One Forward's operations: x is the residual stream, h the branch input and then the gathered rows.
struct CpuBackend::DecoderOps {
  CpuBackend& be;
  const ModelConfig& c;
  absl::Span<const SequenceStep> steps;
  const Buffers& b;
  const std::vector<int>& rows;  // each step's first row
  int total, out_rows;
  std::vector<float>* logits;

  const float* At(RowsAt at) const { return at == RowsAt::kStream ? b.x : b.h; }
  absl::Status Embed() {
    for (size_t i = 0; i < steps.size(); ++i) {
      const SequenceStep& s = steps[i];
      EmbedRows(be.model_->embed(), s.tokens.data(), static_cast<int>(s.tokens.size()), c.embedding_scale,
                 b.x + int64_t{rows[i]} * c.d_model);
    }
    return absl::OkStatus();
  }
  absl::Status Norm(NormOf which, int l, RowsAt at) {
    const float *w = nullptr, *bias = nullptr;
    switch (which) {
      case NormOf::kEmbedding: w = be.model_->embed_norm_w(), bias = be.model_->embed_norm_b(); break;
      case NormOf::kAttention: w = be.model_->layer(l).attn_norm_w, bias = be.model_->layer(l).attn_norm_b; break;
      case NormOf::kCross: w = be.model_->layer(l).cross_norm_w, bias = be.model_->layer(l).cross_norm_b; break;
      case NormOf::kFeedForward: w = be.model_->layer(l).ffn_norm_w, bias = be.model_->layer(l).ffn_norm_b; break;
      case NormOf::kFinal: w = be.model_->final_norm_w(), bias = be.model_->final_norm_b(); break;
    }
    if (at == RowsAt::kGathered) {
      be.Norm(b.h, out_rows, w, bias, b.h);
    } else {
      be.Norm(b.x, total, w, bias, at == RowsAt::kStream ? b.x : b.h);
    }
    return absl::OkStatus();
  }
  absl::Status QkvToCache(int l, RowsAt in) {
    const LayerWeights& lw = be.model_->layer(l);
    const PackedLayer& pl = be.packed_[l];
    const int w = c.qkv_width();
    be.Linear(At(in), total, pl.q, lw.bq, b.q);
    be.Linear(At(in), total, pl.k, lw.bk, b.k);
    be.Linear(At(in), total, pl.v, lw.bv, b.v);
    for (size_t i = 0; i < steps.size(); ++i) {
      const int64_t off = int64_t{rows[i]} * w;
      cpu::WriteKv(be.View(l, steps[i].block_table), b.k + off, b.v + off, steps[i].start_pos,
                   static_cast<int>(steps[i].tokens.size()));
    }
    return absl::OkStatus();
  }
  // One (sequence, head) per work item.
  absl::Status Attention(int l) {
    const int heads = c.n_heads, w = c.qkv_width();
    be.pool_.ParallelFor(static_cast<int>(steps.size()) * heads, [&](int begin, int end) {
      for (int item = begin; item < end; ++item) {
        const SequenceStep& s = steps[item / heads];
        const int hd = item % heads;
        const int n = static_cast<int>(s.tokens.size());
        const int64_t off = int64_t{rows[item / heads]} * w;
        const cpu::KvView view = be.View(l, s.block_table);
        if (n == 1) {
          cpu::AttentionDecode(be.dims_, be.rel_[l], view, b.q + off, s.start_pos, b.att + off, hd, hd + 1);
        } else {
          cpu::AttentionPrefill(be.dims_, be.rel_[l], view, b.q + off, s.start_pos, n, b.att + off, hd, hd + 1);
        }
      }
    });
    const LayerWeights& lw = be.model_->layer(l);
    be.Linear(b.att, total, be.packed_[l].o, lw.bo, b.tmp);
    be.Add(b.x, b.tmp, total, c.d_model);
    return absl::OkStatus();
  }
  absl::Status CrossAttention(int l) {
    const LayerWeights& lw = be.model_->layer(l);
    const int heads = c.n_heads, w = c.qkv_width();
    be.Linear(b.h, total, be.packed_[l].cq, lw.cq_b, b.q);
    be.pool_.ParallelFor(static_cast<int>(steps.size()) * heads, [&](int begin, int end) {
      for (int item = begin; item < end; ++item) {
        const SequenceStep& s = steps[item / heads];
        const int hd = item % heads;
        const cpu::KvView view = be.View(l, s.cross_block_table);
        for (int i = 0; i < static_cast<int>(s.tokens.size()); ++i) {
          const int64_t off = int64_t{rows[item / heads] + i} * w;
          cpu::AttentionDecode(be.dims_, be.cross_rel_, view, b.q + off, s.encoder_len - 1, b.att + off, hd, hd + 1);
        }
      }
    });
    be.Linear(b.att, total, be.packed_[l].co, lw.co_b, b.tmp);
    be.Add(b.x, b.tmp, total, c.d_model);
    return absl::OkStatus();
  }
  absl::Status FeedForward(int l, RowsAt in) {
    be.Mlp(be.model_->layer(l), be.packed_[l], At(in), total, b);
    return absl::OkStatus();
  }
  absl::Status GatherRows() {
    const int d = c.d_model;
    int row = 0, o = 0;
    for (const SequenceStep& s : steps) {
      const int n = static_cast<int>(s.tokens.size());
      const int first = s.all_logits ? row : row + n - 1;
      const int count = s.all_logits ? n : 1;
      std::copy(b.x + int64_t{first} * d, b.x + int64_t{first + count} * d, b.h + int64_t{o} * d);
      o += count;
      row += n;
    }
    return absl::OkStatus();
  }
  absl::Status LmHead() {
    float* const sel = b.h;
    // Rounded activations: the scale after the product, as the tensor cores' epilogue applies it.
    const bool scale_input = c.lm_head_input_scale != 1.0f && !be.bf16_activations_;
    if (scale_input) {
      for (int64_t i = 0; i < int64_t{out_rows} * c.d_model; ++i) sel[i] *= c.lm_head_input_scale;
    }
    logits->resize(int64_t{out_rows} * c.vocab_size);
    be.Linear(sel, out_rows, be.lm_head_, nullptr, logits->data());
    if (c.lm_head_input_scale != 1.0f && !scale_input) {
      for (float& v : *logits) v *= c.lm_head_input_scale;
    }
    return absl::OkStatus();
  }
};

absl::Status CpuBackend::Forward(absl::Span<const SequenceStep> steps, std::vector<float>* logits) {
  const ModelConfig& c = model_->config();
  if (auto st = ValidateSteps(steps, c.vocab_size, c.max_seq_len, kv_, c.encoder_decoder); !st.ok()) return st;
  auto slots = LoraSlots(steps);
  if (!slots.ok()) return slots.status();
  if (c.encoder_decoder) Encode(steps, *slots);
  int total = 0;
  int out_rows = 0;
  std::vector<int> rows(steps.size()), counts(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    rows[i] = total;
    counts[i] = static_cast<int>(steps[i].tokens.size());
    total += counts[i];
    out_rows += steps[i].all_logits ? static_cast<int>(steps[i].tokens.size()) : 1;
  }
  SetLoraRows(*slots, rows, counts, total);
  const Buffers b = Size(total);
  DecoderOps ops{*this, c, steps, b, rows, total, out_rows, logits};
  return WalkDecoder(c, ops);
}

}  // namespace

int64_t CpuKvBytesPerToken(const ModelConfig& c, cpu::KvType kv_type) {
  return int64_t{2} * c.n_layers * c.n_heads * c.head_dim * cpu::KvTypeBytes(kv_type);
}

absl::StatusOr<int> CpuKvBlocks(const ModelConfig& c, int64_t tokens, double memory_fraction,
                                int block_size, cpu::KvType kv_type, int max_seqs) {
  if (block_size < 1) return absl::InvalidArgumentError("KV block size must be >= 1");
  const int64_t per_block = CpuKvBytesPerToken(c, kv_type) * block_size;
  // An encoder-decoder sequence also holds its input's cross-attention K/V.
  const int64_t need = (c.encoder_decoder ? 2 : 1) * int64_t{(c.max_seq_len + block_size - 1) / block_size};
  int64_t blocks;
  if (tokens > 0) {
    blocks = (tokens + block_size - 1) / block_size;
  } else {
    if (!(memory_fraction >= 0.0 && memory_fraction <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV memory fraction ", memory_fraction, "; allowed (0, 1], or 0 for the default"));
    }
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    while (meminfo >> key >> kib) {
      if (key == "MemAvailable:") break;
      meminfo.ignore(256, '\n');
    }
    const double fraction = memory_fraction > 0 ? memory_fraction : kCpuKvDefaultFraction;
    blocks = static_cast<int64_t>(fraction * static_cast<double>(kib) * 1024.0) / per_block;
    // The default: max_seqs whole sequences, within that fraction (pages are taken as written).
    if (memory_fraction == 0 && max_seqs > 0) blocks = std::min(blocks, need * max_seqs);
  }
  if (blocks < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a KV pool of ", blocks * block_size, " tokens cannot hold one sequence of max_seq_len ",
        c.max_seq_len, c.encoder_decoder ? " (input and output)" : "", " (", per_block / block_size,
        " bytes per token); give at least ", need * block_size, " tokens"));
  }
  return static_cast<int>(std::min<int64_t>(blocks, 1 << 30));
}

absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(std::shared_ptr<const Model> model,
                                                       KvCacheConfig kv, int threads, cpu::WeightType weights,
                                                       cpu::KvType kv_type, ProjectionInputs inputs) {
  if (model == nullptr) return absl::InvalidArgumentError("no model");
  if (kv.block_size < 1 || kv.num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache of ", kv.num_blocks, " blocks of ",
                                                   kv.block_size, " tokens; both must be >= 1"));
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto backend = std::make_unique<CpuBackend>(std::move(model), kv, threads, weights, kv_type, inputs);
  if (!backend->pool_ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map a KV pool of ", kv.num_blocks, " blocks of ",
                                                     kv.block_size, " tokens; give a smaller --kv_cache_tokens"));
  }
  return backend;
}

}  // namespace relgen
