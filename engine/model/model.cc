#include "engine/model/model.h"

#include <cmath>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/hf_checkpoint.h"
#include "kernels/relpos_host.h"

namespace relgen {

std::string ShapeStr(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  const int64_t d = c.d_model, w = c.qkv_width(), f = c.ffn_dim, v = c.vocab_size;
  const int64_t hs = c.rel_table_heads(), hd = c.head_dim;
  const bool norm_bias = c.norm == NormKind::kLayerNorm && c.norm_bias;
  std::vector<TensorSpec> specs;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    specs.push_back({std::move(name), std::move(shape)});
  };
  auto norm = [&](const std::string& prefix) {
    add(prefix + ".weight", {d});
    if (norm_bias) add(prefix + ".bias", {d});
  };
  auto linear = [&](const std::string& prefix, int64_t out, int64_t in) {
    add(prefix + ".weight", {out, in});
    if (c.linear_bias) add(prefix + ".bias", {out});
  };
  auto relative = [&](const std::string& prefix) {
    using relpos::Scheme;
    switch (c.rel.scheme) {
      case Scheme::kSkew:
      case Scheme::kSkewLocal:
        add(prefix + "rel_k", {hs, c.rel.max_relative_position, hd});
        break;
      case Scheme::kShaw:
        add(prefix + "rel_k", {hs, 2 * int64_t{c.rel.clip} + 1, hd});
        if (c.rel.relative_values) add(prefix + "rel_v", {hs, 2 * int64_t{c.rel.clip} + 1, hd});
        break;
      case Scheme::kT5:
        add(prefix + "rel_bias", {hs, c.rel.num_buckets});
        break;
      default:
        break;
    }
  };
  // One stack: "" the decoder, "encoder." the encoder (no cross-attention, its own relative table).
  auto stack = [&](const std::string& s, int layers, bool cross) {
    if (c.rel.share_across_layers) relative(s + "attn.");
    for (int l = 0; l < layers; ++l) {
      const std::string p = absl::StrCat(s, "layers.", l, ".");
      norm(p + "attn_norm");
      linear(p + "attn.q", w, d);
      linear(p + "attn.k", w, d);
      linear(p + "attn.v", w, d);
      linear(p + "attn.o", d, w);
      if (!c.rel.share_across_layers) relative(p + "attn.");
      if (cross) {
        norm(p + "cross_norm");
        linear(p + "cross.q", w, d);
        linear(p + "cross.k", w, d);
        linear(p + "cross.v", w, d);
        linear(p + "cross.o", d, w);
      }
      norm(p + "ffn_norm");
      linear(p + "ffn.up", f, d);
      if (c.ffn_gated) linear(p + "ffn.gate", f, d);
      linear(p + "ffn.down", d, f);
    }
  };
  add("embed.weight", {v, d});
  if (c.embedding_norm) norm("embed_norm");
  if (c.encoder_decoder) {
    stack("encoder.", c.n_encoder_layers, false);
    norm("encoder.final_norm");
  }
  stack("", c.n_layers, c.encoder_decoder);
  if (c.norm_placement == NormPlacement::kPre) norm("final_norm");
  if (!c.tie_embeddings) add("lm_head.weight", {v, d});
  return specs;
}

const float* Model::Get(const std::string& name) const {
  auto it = storage_.find(name);
  return it == storage_.end() ? nullptr : it->second.data();
}

absl::StatusOr<std::shared_ptr<const Model>> Model::Load(const std::string& dir) {
  auto hf = IsHfCheckpoint(dir);
  if (!hf.ok()) return hf.status();
  if (*hf) {
    auto ckpt = LoadHfCheckpoint(dir);
    if (!ckpt.ok()) return ckpt.status();
    return FromTensors(std::move(ckpt->config), std::move(ckpt->tensors), ckpt->file_dtype, dir, dir);
  }
  auto config = LoadModelConfig(dir + "/config.json");
  if (!config.ok()) return config.status();
  return FromFiles(*std::move(config), dir + "/model.safetensors", dir);
}

absl::StatusOr<std::shared_ptr<const Model>> Model::FromFiles(ModelConfig config,
                                                              const std::string& weights_path,
                                                              std::string dir) {
  auto file = SafetensorsFile::Open(weights_path);
  if (!file.ok()) return file.status();
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(weights_path, ": ", what));
  };
  std::set<std::string> expected;
  for (const TensorSpec& spec : specs) expected.insert(spec.name);
  for (const TensorInfo& t : (*file)->tensors()) {
    if (!expected.contains(t.name)) {
      return bad(absl::StrCat("unexpected tensor '", t.name, "' ", ShapeStr(t.shape),
                              ": this config does not use it (see docs/model-format.md)"));
    }
  }
  TensorMap tensors;
  for (const TensorSpec& spec : specs) {
    const TensorInfo* t = (*file)->Find(spec.name);
    if (t == nullptr) {
      return bad(absl::StrCat("missing tensor '", spec.name, "' (expected shape ", ShapeStr(spec.shape),
                              ", dtype F32, F16 or BF16)"));
    }
    if (auto s = CheckFloatTensor(*t, spec.name, spec.shape, weights_path); !s.ok()) return s;
    auto values = ToFloat32(*t);
    if (!values.ok()) return values.status();
    tensors.emplace(spec.name, *std::move(values));
  }
  const DType dtype = specs.empty() ? DType::kF32 : (*file)->Find(specs.front().name)->dtype;
  return FromTensors(std::move(config), std::move(tensors), dtype, weights_path, std::move(dir));
}

absl::Status CheckFloatTensor(const TensorInfo& t, absl::string_view name, const std::vector<int64_t>& shape,
                              absl::string_view origin) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": tensor '", name, "' has dtype ", DTypeName(t.dtype),
                                                   "; allowed: F32, F16, BF16"));
  }
  if (t.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": tensor '", name, "' has shape ", ShapeStr(t.shape),
                                                   "; the config requires ", ShapeStr(shape)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Model>> Model::FromTensors(ModelConfig config, TensorMap tensors,
                                                                DType file_dtype, const std::string& origin,
                                                                std::string dir) {
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::shared_ptr<Model> m(new Model());
  m->config_ = std::move(config);
  m->dir_ = std::move(dir);
  m->file_dtype_ = file_dtype;
  auto bad = [&](absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what)); };
  for (const TensorSpec& spec : specs) {
    auto it = tensors.find(spec.name);
    int64_t numel = 1;
    for (int64_t n : spec.shape) numel *= n;
    if (it == tensors.end()) return bad(absl::StrCat("missing tensor '", spec.name, "' ", ShapeStr(spec.shape)));
    if (static_cast<int64_t>(it->second.size()) != numel) {
      return bad(absl::StrCat("tensor '", spec.name, "' has ", it->second.size(), " values; the config requires ",
                              ShapeStr(spec.shape)));
    }
    // A flipped exponent bit reads as inf or NaN: refuse rather than serve garbage.
    for (size_t i = 0; i < it->second.size(); ++i) {
      if (!std::isfinite(it->second[i])) {
        return bad(absl::StrCat("tensor '", spec.name, "' holds ", it->second[i], " at element ", i,
                                "; weights must be finite (corrupt file?)"));
      }
    }
    m->num_parameters_ += numel;
    m->storage_.emplace(spec.name, std::move(it->second));
    tensors.erase(it);
  }
  if (!tensors.empty()) {
    return bad(absl::StrCat("unexpected tensor '", tensors.begin()->first, "': this config does not use it"));
  }

  const ModelConfig& c = m->config_;
  m->embed_ = m->Get("embed.weight");
  m->embed_norm_w_ = m->Get("embed_norm.weight");
  m->embed_norm_b_ = m->Get("embed_norm.bias");
  m->final_norm_w_ = m->Get("final_norm.weight");
  m->final_norm_b_ = m->Get("final_norm.bias");
  m->lm_head_ = c.tie_embeddings ? m->embed_ : m->Get("lm_head.weight");
  auto stack = [&](const std::string& s, int layers, std::vector<LayerWeights>* out) {
    out->resize(layers);
    for (int l = 0; l < layers; ++l) {
      const std::string p = absl::StrCat(s, "layers.", l, ".");
      const std::string rp = c.rel.share_across_layers ? s + "attn." : p + "attn.";
      LayerWeights& lw = (*out)[l];
      lw.attn_norm_w = m->Get(p + "attn_norm.weight");
      lw.attn_norm_b = m->Get(p + "attn_norm.bias");
      lw.wq = m->Get(p + "attn.q.weight");
      lw.bq = m->Get(p + "attn.q.bias");
      lw.wk = m->Get(p + "attn.k.weight");
      lw.bk = m->Get(p + "attn.k.bias");
      lw.wv = m->Get(p + "attn.v.weight");
      lw.bv = m->Get(p + "attn.v.bias");
      lw.wo = m->Get(p + "attn.o.weight");
      lw.bo = m->Get(p + "attn.o.bias");
      lw.ffn_norm_w = m->Get(p + "ffn_norm.weight");
      lw.ffn_norm_b = m->Get(p + "ffn_norm.bias");
      lw.w_up = m->Get(p + "ffn.up.weight");
      lw.b_up = m->Get(p + "ffn.up.bias");
      lw.w_gate = m->Get(p + "ffn.gate.weight");
      lw.b_gate = m->Get(p + "ffn.gate.bias");
      lw.w_down = m->Get(p + "ffn.down.weight");
      lw.b_down = m->Get(p + "ffn.down.bias");
      lw.rel_k = m->Get(rp + "rel_k");
      lw.rel_v = m->Get(rp + "rel_v");
      lw.rel_bias = m->Get(rp + "rel_bias");
      lw.cross_norm_w = m->Get(p + "cross_norm.weight");
      lw.cross_norm_b = m->Get(p + "cross_norm.bias");
      lw.cq = m->Get(p + "cross.q.weight");
      lw.cq_b = m->Get(p + "cross.q.bias");
      lw.ck = m->Get(p + "cross.k.weight");
      lw.ck_b = m->Get(p + "cross.k.bias");
      lw.cv = m->Get(p + "cross.v.weight");
      lw.cv_b = m->Get(p + "cross.v.bias");
      lw.co = m->Get(p + "cross.o.weight");
      lw.co_b = m->Get(p + "cross.o.bias");
    }
  };
  stack("", c.n_layers, &m->layers_);
  if (c.encoder_decoder) {
    stack("encoder.", c.n_encoder_layers, &m->encoder_layers_);
    m->encoder_final_norm_w_ = m->Get("encoder.final_norm.weight");
    m->encoder_final_norm_b_ = m->Get("encoder.final_norm.bias");
    if (c.rel.scheme == relpos::Scheme::kT5) {
      m->t5_encoder_table_ = relpos::T5SignedBucketTable(c.rel.num_buckets, c.rel.max_distance);
    }
  }
  if (c.rel.scheme == relpos::Scheme::kT5) {
    m->t5_table_ = relpos::T5BucketTable(c.rel.num_buckets, c.rel.max_distance, c.rel.bidirectional);
  }
  if (c.rel.scheme == relpos::Scheme::kAlibi) m->alibi_slopes_ = relpos::AlibiSlopes(c.n_heads, c.rel.alibi_bias_max);
  return std::shared_ptr<const Model>(std::move(m));
}

}  // namespace relgen
