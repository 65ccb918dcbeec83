#include "engine/model/config.h"

#include <cmath>
#include <limits>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace relgen {
namespace {

using json = nlohmann::json;

absl::Status Invalid(absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: '", key, "' ", what));
}

absl::Status CheckKeys(const json& obj, absl::string_view where, const std::set<std::string>& allowed) {
  for (const auto& [key, value] : obj.items()) {
    if (!allowed.contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: unknown key '", where, key,
                                                     "'; allowed: ", absl::StrJoin(allowed, ", ")));
    }
  }
  return absl::OkStatus();
}

// Reads an integer in [lo, hi]. Absent: `fallback` if given, else an error.
absl::Status GetInt(const json& obj, const std::string& key, absl::string_view path, int lo, int hi,
                    int* out, bool required) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (required) return Invalid(path, "is required (an integer)");
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) return Invalid(path, absl::StrCat("must be an integer, found ", it->dump()));
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return Invalid(path, absl::StrCat("is ", v, "; allowed ", lo, "..", hi));
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status GetBool(const json& obj, const std::string& key, absl::string_view path, bool* out,
                     bool required) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (required) return Invalid(path, "is required (true or false)");
    return absl::OkStatus();
  }
  if (!it->is_boolean()) return Invalid(path, absl::StrCat("must be true or false, found ", it->dump()));
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status GetFloat(const json& obj, const std::string& key, absl::string_view path, float* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return Invalid(path, absl::StrCat("must be a number, found ", it->dump()));
  const double v = it->get<double>();
  // The value is used as a float: it must stay positive and finite there too (1e-50 and 1e50 do not).
  const float f = static_cast<float>(v);
  if (!std::isfinite(v) || v <= 0 || !std::isfinite(f) || f < std::numeric_limits<float>::min()) {
    return Invalid(path, absl::StrCat("is ", v, "; must be a normal float > 0 (", std::numeric_limits<float>::min(),
                                      "..", std::numeric_limits<float>::max(), ")"));
  }
  *out = f;
  return absl::OkStatus();
}

// Reads one of `names` (index returned through `out`).
template <typename E>
absl::Status GetEnum(const json& obj, const std::string& key, absl::string_view path,
                     const std::vector<std::pair<std::string, E>>& names, E* out, bool required) {
  auto it = obj.find(key);
  std::vector<std::string> allowed;
  for (const auto& [n, e] : names) allowed.push_back(n);
  if (it == obj.end() || it->is_null()) {
    if (required) return Invalid(path, absl::StrCat("is required; allowed: ", absl::StrJoin(allowed, ", ")));
    return absl::OkStatus();
  }
  if (it->is_string()) {
    for (const auto& [n, e] : names) {
      if (n == it->get<std::string>()) {
        *out = e;
        return absl::OkStatus();
      }
    }
  }
  return Invalid(path, absl::StrCat("is ", it->dump(), "; allowed: ", absl::StrJoin(allowed, ", ")));
}

constexpr int kMaxDim = 1 << 20;

const std::vector<std::pair<std::string, relpos::Scheme>> kSchemes = {
    {"none", relpos::Scheme::kNone}, {"skew", relpos::Scheme::kSkew},
    {"skew_local", relpos::Scheme::kSkewLocal}, {"shaw", relpos::Scheme::kShaw},
    {"t5", relpos::Scheme::kT5}, {"alibi", relpos::Scheme::kAlibi}};

absl::Status ParseRelative(const json& r, ModelConfig& c) {
  if (!r.is_object()) return Invalid("relative_attention", "must be an object");
  if (auto s = CheckKeys(r, "relative_attention.",
                         {"scheme", "max_relative_position", "block_length", "clip",
                          "relative_values", "num_buckets", "max_distance", "bidirectional",
                          "heads_share_table", "share_across_layers", "scale_with_qk", "alibi_bias_max"});
      !s.ok()) {
    return s;
  }
  RelativeConfig& rel = c.rel;
  if (auto s = GetEnum(r, "scheme", "relative_attention.scheme", kSchemes, &rel.scheme, true); !s.ok()) {
    return s;
  }
  using relpos::Scheme;
  const Scheme sc = rel.scheme;
  // Parameters that belong to another scheme are refused: they would be silently ignored.
  auto only_for = [&](const std::string& key, bool ok, absl::string_view schemes) -> absl::Status {
    if (!ok && r.contains(key)) {
      return Invalid(absl::StrCat("relative_attention.", key),
                     absl::StrCat("applies only to scheme ", schemes, ", not '", SchemeName(sc), "'"));
    }
    return absl::OkStatus();
  };
  const bool skew = sc == Scheme::kSkew || sc == Scheme::kSkewLocal;
  for (auto s : {only_for("max_relative_position", skew, "skew or skew_local"),
                 only_for("block_length", sc == Scheme::kSkewLocal, "skew_local"),
                 only_for("clip", sc == Scheme::kShaw, "shaw"),
                 only_for("relative_values", sc == Scheme::kShaw, "shaw"),
                 only_for("num_buckets", sc == Scheme::kT5, "t5"),
                 only_for("max_distance", sc == Scheme::kT5, "t5"),
                 only_for("bidirectional", sc == Scheme::kT5, "t5"),
                 only_for("heads_share_table", skew || sc == Scheme::kShaw || sc == Scheme::kT5,
                          "skew, skew_local, shaw or t5"),
                 only_for("share_across_layers", skew || sc == Scheme::kShaw || sc == Scheme::kT5,
                          "skew, skew_local, shaw or t5"),
                 only_for("scale_with_qk", sc != Scheme::kNone, "other than none"),
                 only_for("alibi_bias_max", sc == Scheme::kAlibi, "alibi")}) {
    if (!s.ok()) return s;
  }
  absl::Status s;
  if (skew) {
    s.Update(GetInt(r, "max_relative_position", "relative_attention.max_relative_position", 1,
                    kMaxDim, &rel.max_relative_position, true));
  }
  if (sc == Scheme::kSkewLocal) {
    s.Update(GetInt(r, "block_length", "relative_attention.block_length", 1, kMaxDim,
                    &rel.block_length, true));
  }
  if (sc == Scheme::kShaw) {
    s.Update(GetInt(r, "clip", "relative_attention.clip", 1, kMaxDim, &rel.clip, true));
    s.Update(GetBool(r, "relative_values", "relative_attention.relative_values",
                     &rel.relative_values, false));
  }
  if (sc == Scheme::kT5) {
    rel.share_across_layers = true;  // T5 shares its bias across layers
    s.Update(GetBool(r, "bidirectional", "relative_attention.bidirectional", &rel.bidirectional, false));
    const int min_buckets = rel.bidirectional ? 4 : 2;
    s.Update(GetInt(r, "num_buckets", "relative_attention.num_buckets", min_buckets, 4096,
                    &rel.num_buckets, false));
    const int max_exact = rel.bidirectional ? rel.num_buckets / 4 : rel.num_buckets / 2;
    s.Update(GetInt(r, "max_distance", "relative_attention.max_distance", max_exact + 1, kMaxDim,
                    &rel.max_distance, false));
  }
  s.Update(GetBool(r, "heads_share_table", "relative_attention.heads_share_table",
                   &rel.heads_share_table, false));
  s.Update(GetBool(r, "share_across_layers", "relative_attention.share_across_layers",
                   &rel.share_across_layers, false));
  if (sc == Scheme::kAlibi) {
    s.Update(GetFloat(r, "alibi_bias_max", "relative_attention.alibi_bias_max", &rel.alibi_bias_max));
  }
  if (sc != Scheme::kNone) {
    s.Update(GetBool(r, "scale_with_qk", "relative_attention.scale_with_qk", &rel.scale_with_qk, true));
  }
  return s;
}

absl::StatusOr<ModelConfig> ParseJson(const json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("config.json: must be a JSON object");
  if (auto s = CheckKeys(j, "",
                         {"format_version", "name", "vocab_size", "d_model", "n_layers", "n_heads",
                          "head_dim", "ffn_dim", "ffn_activation", "ffn_gated", "norm",
                          "norm_placement", "norm_eps", "norm_bias", "embedding_norm", "linear_bias", "tie_embeddings",
                          "embedding_scale", "attention_scale", "max_seq_len", "bos_token_id",
                          "eos_token_id", "pad_token_id", "tokenizer", "relative_attention"});
      !s.ok()) {
    return s;
  }
  ModelConfig c;
  int version = 1;
  absl::Status s;
  s.Update(GetInt(j, "format_version", "format_version", 1, 1, &version, false));
  if (auto it = j.find("name"); it != j.end()) {
    if (!it->is_string()) return Invalid("name", "must be a string");
    c.name = it->get<std::string>();
  }
  s.Update(GetInt(j, "vocab_size", "vocab_size", 1, 1 << 24, &c.vocab_size, true));
  s.Update(GetInt(j, "d_model", "d_model", 1, 65536, &c.d_model, true));
  s.Update(GetInt(j, "n_layers", "n_layers", 1, 1024, &c.n_layers, true));
  s.Update(GetInt(j, "n_heads", "n_heads", 1, 1024, &c.n_heads, true));
  s.Update(GetInt(j, "head_dim", "head_dim", 1, 4096, &c.head_dim, false));
  s.Update(GetInt(j, "ffn_dim", "ffn_dim", 1, 1 << 18, &c.ffn_dim, true));
  s.Update(GetInt(j, "max_seq_len", "max_seq_len", 1, kMaxDim, &c.max_seq_len, true));
  s.Update(GetEnum<Activation>(j, "ffn_activation", "ffn_activation",
                               {{"relu", Activation::kRelu},
                                {"gelu", Activation::kGelu},
                                {"gelu_tanh", Activation::kGeluTanh},
                                {"silu", Activation::kSilu}},
                               &c.ffn_activation, false));
  s.Update(GetBool(j, "ffn_gated", "ffn_gated", &c.ffn_gated, false));
  s.Update(GetEnum<NormKind>(j, "norm", "norm",
                             {{"layernorm", NormKind::kLayerNorm}, {"rmsnorm", NormKind::kRmsNorm}},
                             &c.norm, false));
  s.Update(GetEnum<NormPlacement>(j, "norm_placement", "norm_placement",
                                  {{"pre", NormPlacement::kPre}, {"post", NormPlacement::kPost}},
                                  &c.norm_placement, false));
  s.Update(GetFloat(j, "norm_eps", "norm_eps", &c.norm_eps));
  s.Update(GetBool(j, "norm_bias", "norm_bias", &c.norm_bias, false));
  s.Update(GetBool(j, "embedding_norm", "embedding_norm", &c.embedding_norm, false));
  s.Update(GetBool(j, "linear_bias", "linear_bias", &c.linear_bias, false));
  s.Update(GetBool(j, "tie_embeddings", "tie_embeddings", &c.tie_embeddings, false));
  s.Update(GetFloat(j, "embedding_scale", "embedding_scale", &c.embedding_scale));
  s.Update(GetFloat(j, "attention_scale", "attention_scale", &c.attention_scale));
  if (!s.ok()) return s;

  if (c.head_dim == 0) {
    if (c.d_model % c.n_heads != 0) {
      return Invalid("d_model", absl::StrCat("(", c.d_model, ") is not divisible by n_heads (",
                                             c.n_heads, "); set head_dim explicitly or use a ",
                                             "head count that divides d_model"));
    }
    c.head_dim = c.d_model / c.n_heads;
  }
  if (c.attention_scale == 0.0f) c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  for (auto [key, field] : {std::pair{"bos_token_id", &c.bos_token_id},
                            std::pair{"eos_token_id", &c.eos_token_id},
                            std::pair{"pad_token_id", &c.pad_token_id}}) {
    s.Update(GetInt(j, key, key, 0, c.vocab_size - 1, field, false));
  }
  if (!s.ok()) return s;

  if (auto it = j.find("tokenizer"); it != j.end()) {
    if (!it->is_object()) return Invalid("tokenizer", "must be an object with 'kind'");
    if (auto st = CheckKeys(*it, "tokenizer.", {"kind", "file"}); !st.ok()) return st;
    if (auto st = GetEnum<TokenizerKind>(*it, "kind", "tokenizer.kind",
                                         {{"byte", TokenizerKind::kByte},
                                          {"sentencepiece", TokenizerKind::kSentencePiece},
                                          {"bpe", TokenizerKind::kBpe},
                                          {"word", TokenizerKind::kWord}},
                                         &c.tokenizer, true);
        !st.ok()) {
      return st;
    }
    if (auto f = it->find("file"); f != it->end()) {
      if (!f->is_string() || f->get<std::string>().empty()) {
        return Invalid("tokenizer.file", "must be a non-empty file name");
      }
      // A name inside the model directory: the config may not point elsewhere on the disk.
      const std::string name = f->get<std::string>();
      if (name.find('/') != std::string::npos || name == "." || name == ".." || name.find('\0') != std::string::npos) {
        return Invalid("tokenizer.file", absl::StrCat("is ", f->dump(), "; must be a file name in the model directory (no '/')"));
      }
      c.tokenizer_file = f->get<std::string>();
    }
  }
  if (c.tokenizer == TokenizerKind::kByte && c.vocab_size < 256) {
    return Invalid("vocab_size", absl::StrCat("is ", c.vocab_size,
                                              "; the byte tokenizer needs at least 256 (ids 0..255 "
                                              "are the bytes)"));
  }
  if (c.tokenizer != TokenizerKind::kByte && c.tokenizer_file.empty()) {
    return Invalid("tokenizer.file", "is required for the sentencepiece, bpe and word tokenizers");
  }

  auto rit = j.find("relative_attention");
  if (rit == j.end()) {
    return Invalid("relative_attention", "is required (an object with at least 'scheme')");
  }
  if (auto st = ParseRelative(*rit, c); !st.ok()) return st;
  return c;
}

}  // namespace

absl::string_view SchemeName(relpos::Scheme scheme) {
  for (const auto& [name, s] : kSchemes) {
    if (s == scheme) return name;
  }
  return "?";
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("config.json: not valid JSON");
  try {
    return ParseJson(j);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", e.what()));
  }
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model config ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = ParseModelConfig(ss.str());
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

}  // namespace relgen
