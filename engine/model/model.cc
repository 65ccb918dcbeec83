#include "engine/model/model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/hf_checkpoint.h"
#include "kernels/relpos_host.h"

namespace relgen {

void StoredMatrix::Widen(int64_t row0, int64_t n, float* out) const {
  const int es = DTypeSize(dtype);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* src = data + SourceRow(row0 + r) * cols * es;
    float* o = out + r * cols;
    if (dtype == DType::kF32) {
      std::memcpy(o, src, cols * sizeof(float));
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      uint16_t bits;
      std::memcpy(&bits, src + c * 2, 2);
      o[c] = dtype == DType::kBF16 ? BFloat16ToFloat(bits) : HalfToFloat(bits);
    }
  }
}

std::vector<float> StoredMatrix::ToFloat() const {
  std::vector<float> v(static_cast<size_t>(numel()));
  Widen(0, rows, v.data());
  return v;
}

int64_t StoredMatrix::FirstNonFinite() const {
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    Widen(r, 1, row.data());
    for (int64_t c = 0; c < cols; ++c) {
      if (!std::isfinite(row[c])) return r * cols + c;
    }
  }
  return -1;
}

void StoredMatrix::ReleasePages() const {
  if (!mapped || data == nullptr) return;
  // The whole stored tensor (a fused one's three parts too); only pages it covers entirely.
  const int64_t span = (layout == Rows::kAll ? 1 : 3) * bytes();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + span) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

bool IsStoredMatrix(const std::string& name) {
  if (name == "embed.weight" || name == "lm_head.weight") return true;
  for (const char* suffix : {"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "ffn.up.weight",
                             "ffn.gate.weight", "ffn.down.weight", "cross.q.weight", "cross.k.weight",
                             "cross.v.weight", "cross.o.weight"}) {
    const size_t n = std::strlen(suffix);
    if (name.size() >= n && name.compare(name.size() - n, n, suffix) == 0) return true;
  }
  return false;
}

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

const float* Model::Small(const std::string& name) const {
  auto it = storage_.small.find(name);
  return it == storage_.small.end() ? nullptr : it->second.data();
}

const StoredMatrix* Model::Matrix(const std::string& name) const {
  auto it = storage_.matrices.find(name);
  return it == storage_.matrices.end() ? nullptr : &it->second;
}

absl::StatusOr<std::shared_ptr<const Model>> Model::Load(const std::string& dir) {
  auto hf = IsHfCheckpoint(dir);
  if (!hf.ok()) return hf.status();
  if (*hf) {
    auto ckpt = LoadHfCheckpoint(dir);
    if (!ckpt.ok()) return ckpt.status();
    return FromStored(std::move(ckpt->config), std::move(ckpt->tensors), ckpt->file_dtype, dir, dir);
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
  StoredTensors tensors;
  for (const TensorSpec& spec : specs) {
    const TensorInfo* t = (*file)->Find(spec.name);
    if (t == nullptr) {
      return bad(absl::StrCat("missing tensor '", spec.name, "' (expected shape ", ShapeStr(spec.shape),
                              ", dtype F32, F16 or BF16)"));
    }
    if (auto s = CheckFloatTensor(*t, spec.name, spec.shape, weights_path); !s.ok()) return s;
    AddStored(spec.name, *t, &tensors);
  }
  const DType dtype = specs.empty() ? DType::kF32 : (*file)->Find(specs.front().name)->dtype;
  tensors.owners.push_back(std::shared_ptr<const SafetensorsFile>(*std::move(file)));
  return FromStored(std::move(config), std::move(tensors), dtype, weights_path, std::move(dir));
}

void AddStored(const std::string& name, const TensorInfo& t, StoredTensors* out, StoredMatrix::Rows layout, int part,
               int64_t head_dim) {
  StoredMatrix m;
  m.dtype = t.dtype;
  m.data = t.data;
  m.mapped = true;
  m.rows = t.shape.empty() ? 1 : t.shape[0];
  m.cols = 1;
  for (size_t i = 1; i < t.shape.size(); ++i) m.cols *= t.shape[i];
  m.layout = layout;
  m.part = part;
  m.head_dim = head_dim;
  if (layout != StoredMatrix::Rows::kAll) m.rows /= 3;
  if (IsStoredMatrix(name)) {
    out->matrices.emplace(name, m);
  } else {
    out->small.emplace(name, m.ToFloat());
  }
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
  // Matrices keep their float32 vectors alive as owners; the rest are the small tensors themselves.
  StoredTensors stored;
  for (auto& [name, values] : tensors) {
    if (!IsStoredMatrix(name)) {
      stored.small.emplace(name, std::move(values));
      continue;
    }
    auto owned = std::make_shared<std::vector<float>>(std::move(values));
    StoredMatrix m;
    m.data = reinterpret_cast<const uint8_t*>(owned->data());
    m.rows = static_cast<int64_t>(owned->size());  // shaped below, against the spec
    m.cols = 1;
    stored.matrices.emplace(name, m);
    stored.owners.push_back(std::move(owned));
  }
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    auto it = stored.matrices.find(spec.name);
    if (it == stored.matrices.end() || spec.shape.size() != 2) continue;
    if (it->second.rows == spec.shape[0] * spec.shape[1]) {
      it->second.rows = spec.shape[0];
      it->second.cols = spec.shape[1];
    }
  }
  return FromStored(std::move(config), std::move(stored), file_dtype, origin, std::move(dir));
}

absl::StatusOr<std::shared_ptr<const Model>> Model::FromStored(ModelConfig config, StoredTensors tensors,
                                                               DType file_dtype, const std::string& origin,
                                                               std::string dir) {
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::shared_ptr<Model> m(new Model());
  m->config_ = std::move(config);
  m->dir_ = std::move(dir);
  m->file_dtype_ = file_dtype;
  auto bad = [&](absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what)); };
  std::set<std::string> expected;
  for (const TensorSpec& spec : specs) {
    expected.insert(spec.name);
    int64_t numel = 1;
    for (int64_t n : spec.shape) numel *= n;
    if (auto mit = tensors.matrices.find(spec.name); mit != tensors.matrices.end()) {
      const StoredMatrix& sm = mit->second;
      if (spec.shape.size() != 2 || sm.rows != spec.shape[0] || sm.cols != spec.shape[1]) {
        return bad(absl::StrCat("tensor '", spec.name, "' has ", sm.numel(), " values; the config requires ",
                                ShapeStr(spec.shape)));
      }
      // A flipped exponent bit reads as inf or NaN: refuse rather than serve garbage.
      if (const int64_t at = sm.FirstNonFinite(); at >= 0) {
        std::vector<float> row(static_cast<size_t>(sm.cols));
        sm.Widen(at / sm.cols, 1, row.data());
        return bad(absl::StrCat("tensor '", spec.name, "' holds ", row[at % sm.cols], " at element ", at,
                                "; weights must be finite (corrupt file?)"));
      }
      sm.ReleasePages();  // read once for the check; a backend reads them again as it packs
      m->num_parameters_ += numel;
      m->stored_bytes_ += sm.bytes();
      continue;
    }
    auto it = tensors.small.find(spec.name);
    if (it == tensors.small.end()) return bad(absl::StrCat("missing tensor '", spec.name, "' ", ShapeStr(spec.shape)));
    if (static_cast<int64_t>(it->second.size()) != numel) {
      return bad(absl::StrCat("tensor '", spec.name, "' has ", it->second.size(), " values; the config requires ",
                              ShapeStr(spec.shape)));
    }
    for (size_t i = 0; i < it->second.size(); ++i) {
      if (!std::isfinite(it->second[i])) {
        return bad(absl::StrCat("tensor '", spec.name, "' holds ", it->second[i], " at element ", i,
                                "; weights must be finite (corrupt file?)"));
      }
    }
    m->num_parameters_ += numel;
    m->stored_bytes_ += numel * DTypeSize(file_dtype);
    m->small_bytes_ += numel * static_cast<int64_t>(sizeof(float));
  }
  for (const auto& [name, t] : tensors.matrices) {
    if (!expected.contains(name)) return bad(absl::StrCat("unexpected tensor '", name, "': this config does not use it"));
  }
  for (const auto& [name, t] : tensors.small) {
    if (!expected.contains(name)) return bad(absl::StrCat("unexpected tensor '", name, "': this config does not use it"));
  }
  m->storage_ = std::move(tensors);

  const ModelConfig& c = m->config_;
  m->embed_ = m->Matrix("embed.weight");
  m->embed_norm_w_ = m->Small("embed_norm.weight");
  m->embed_norm_b_ = m->Small("embed_norm.bias");
  m->final_norm_w_ = m->Small("final_norm.weight");
  m->final_norm_b_ = m->Small("final_norm.bias");
  m->lm_head_ = c.tie_embeddings ? m->embed_ : m->Matrix("lm_head.weight");
  auto stack = [&](const std::string& s, int layers, std::vector<LayerWeights>* out) {
    out->resize(layers);
    for (int l = 0; l < layers; ++l) {
      const std::string p = absl::StrCat(s, "layers.", l, ".");
      const std::string rp = c.rel.share_across_layers ? s + "attn." : p + "attn.";
      LayerWeights& lw = (*out)[l];
      lw.attn_norm_w = m->Small(p + "attn_norm.weight");
      lw.attn_norm_b = m->Small(p + "attn_norm.bias");
      lw.wq = m->Matrix(p + "attn.q.weight");
      lw.bq = m->Small(p + "attn.q.bias");
      lw.wk = m->Matrix(p + "attn.k.weight");
      lw.bk = m->Small(p + "attn.k.bias");
      lw.wv = m->Matrix(p + "attn.v.weight");
      lw.bv = m->Small(p + "attn.v.bias");
      lw.wo = m->Matrix(p + "attn.o.weight");
      lw.bo = m->Small(p + "attn.o.bias");
      lw.ffn_norm_w = m->Small(p + "ffn_norm.weight");
      lw.ffn_norm_b = m->Small(p + "ffn_norm.bias");
      lw.w_up = m->Matrix(p + "ffn.up.weight");
      lw.b_up = m->Small(p + "ffn.up.bias");
      lw.w_gate = m->Matrix(p + "ffn.gate.weight");
      lw.b_gate = m->Small(p + "ffn.gate.bias");
      lw.w_down = m->Matrix(p + "ffn.down.weight");
      lw.b_down = m->Small(p + "ffn.down.bias");
      lw.rel_k = m->Small(rp + "rel_k");
      lw.rel_v = m->Small(rp + "rel_v");
      lw.rel_bias = m->Small(rp + "rel_bias");
      lw.cross_norm_w = m->Small(p + "cross_norm.weight");
      lw.cross_norm_b = m->Small(p + "cross_norm.bias");
      lw.cq = m->Matrix(p + "cross.q.weight");
      lw.cq_b = m->Small(p + "cross.q.bias");
      lw.ck = m->Matrix(p + "cross.k.weight");
      lw.ck_b = m->Small(p + "cross.k.bias");
      lw.cv = m->Matrix(p + "cross.v.weight");
      lw.cv_b = m->Small(p + "cross.v.bias");
      lw.co = m->Matrix(p + "cross.o.weight");
      lw.co_b = m->Small(p + "cross.o.bias");
    }
  };
  stack("", c.n_layers, &m->layers_);
  if (c.encoder_decoder) {
    stack("encoder.", c.n_encoder_layers, &m->encoder_layers_);
    m->encoder_final_norm_w_ = m->Small("encoder.final_norm.weight");
    m->encoder_final_norm_b_ = m->Small("encoder.final_norm.bias");
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
