#include "engine/model/hf_checkpoint.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace relgen {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

absl::StatusOr<json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  return j;
}

// A file name inside the checkpoint directory: an index may not point elsewhere on the disk.
bool PlainFileName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != ".." &&
         name.find('\0') == std::string::npos;
}

// The weights of a checkpoint: model.safetensors, or the shards model.safetensors.index.json names.
class Weights {
 public:
  static absl::StatusOr<Weights> Open(const std::string& dir) {
    Weights w;
    const std::string index_path = dir + "/model.safetensors.index.json";
    if (fs::exists(index_path)) {
      auto index = ReadJsonFile(index_path);
      if (!index.ok()) return index.status();
      auto map = index->find("weight_map");
      if (map == index->end() || !map->is_object() || map->empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": 'weight_map' must be a non-empty object of tensor name -> shard file"));
      }
      std::map<std::string, std::vector<std::string>> by_shard;
      for (const auto& [name, file] : map->items()) {
        if (!file.is_string() || !PlainFileName(file.get<std::string>())) {
          return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor '", name, "' maps to ", file.dump(),
                                                         "; must be a file name in the checkpoint directory"));
        }
        by_shard[file.get<std::string>()].push_back(name);
      }
      for (const auto& [shard, names] : by_shard) {
        const std::string path = dir + "/" + shard;
        if (!fs::exists(path)) {
          return absl::NotFoundError(absl::StrCat(index_path, " names shard '", shard, "' (", names.size(),
                                                  " tensors, e.g. '", names.front(), "'), which is not in ", dir,
                                                  ": the download is incomplete"));
        }
        auto file = SafetensorsFile::Open(path);
        if (!file.ok()) return file.status();
        for (const std::string& name : names) {
          const TensorInfo* t = (*file)->Find(name);
          if (t == nullptr) {
            return absl::InvalidArgumentError(absl::StrCat(index_path, " places tensor '", name, "' in shard '", shard,
                                                           "', which does not hold it"));
          }
          w.tensors_.emplace(name, Entry{t, path});
        }
        w.files_.push_back(*std::move(file));
      }
      return w;
    }
    const std::string single = dir + "/model.safetensors";
    if (fs::exists(single)) {
      auto file = SafetensorsFile::Open(single);
      if (!file.ok()) return file.status();
      for (const TensorInfo& t : (*file)->tensors()) w.tensors_.emplace(t.name, Entry{&t, single});
      w.files_.push_back(*std::move(file));
      return w;
    }
    for (const char* bin : {"pytorch_model.bin", "pytorch_model.bin.index.json"}) {
      if (fs::exists(dir + "/" + bin)) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, " holds PyTorch pickle weights (", bin,
            ") only; relgen reads safetensors (pickles can run code on load). Convert once with "
            "transformers installed: python3 -c \"import sys, transformers as t; "
            "t.AutoModelForCausalLM.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1], "
            "safe_serialization=True)\" ",
            dir));
      }
    }
    return absl::NotFoundError(
        absl::StrCat(dir, ": no weights; expected model.safetensors or model.safetensors.index.json with its shards"));
  }

  const TensorInfo* Find(const std::string& name) const {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : it->second.info;
  }
  const std::string& FileOf(const std::string& name) const { return tensors_.at(name).file; }
  // The mapped files, kept alive by whoever holds the returned owners.
  std::vector<std::shared_ptr<const void>> TakeFiles() {
    std::vector<std::shared_ptr<const void>> owners;
    for (auto& f : files_) owners.push_back(std::shared_ptr<const SafetensorsFile>(std::move(f)));
    files_.clear();
    return owners;
  }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const auto& [n, e] : tensors_) names.push_back(n);
    return names;
  }

 private:
  struct Entry {
    const TensorInfo* info;
    std::string file;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> tensors_;
};

// ---- config.json keys -----------------------------------------------------------------------

// Reads config.json keys with messages that name the key, what was found and what is allowed, and
// records which keys were looked at so that the rest can be refused.
class Keys {
 public:
  Keys(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  absl::Status Error(const std::string& key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": '", key, "' ", what));
  }
  const json* Get(const std::string& key) {
    seen_.insert(key);
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  // The first of `names` present (transformers' aliases, e.g. n_head / num_attention_heads).
  absl::Status Int(std::initializer_list<const char*> names, int lo, int hi, int* out, bool required) {
    const json* v = nullptr;
    std::string key = *names.begin();
    for (const char* n : names) {
      const json* c = Get(n);
      if (c != nullptr && v == nullptr) {
        v = c;
        key = n;
      }
    }
    if (v == nullptr) return required ? Error(key, "is required (an integer)") : absl::OkStatus();
    if (!v->is_number_integer()) return Error(key, absl::StrCat("must be an integer, found ", v->dump()));
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) return Error(key, absl::StrCat("is ", x, "; allowed ", lo, "..", hi));
    *out = static_cast<int>(x);
    return absl::OkStatus();
  }
  absl::Status PositiveFloat(const std::string& key, float* out) {
    const json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_number()) return Error(key, absl::StrCat("must be a number, found ", v->dump()));
    const double x = v->get<double>();
    const float f = static_cast<float>(x);
    if (!(x > 0) || !std::isfinite(f) || f < std::numeric_limits<float>::min()) {
      return Error(key, absl::StrCat("is ", x, "; must be a normal float > 0"));
    }
    *out = f;
    return absl::OkStatus();
  }
  absl::Status Bool(const std::string& key, bool* out) {
    const json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean()) return Error(key, absl::StrCat("must be true or false, found ", v->dump()));
    *out = v->get<bool>();
    return absl::OkStatus();
  }
  // A key whose other values change the math in a way relgen does not implement: only `allowed`
  // (null/absent is always allowed) passes.
  absl::Status Only(const std::string& key, std::vector<json> allowed, absl::string_view why) {
    const json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    for (const json& a : allowed) {
      if (*v == a || (a.is_number() && v->is_number() && a.get<double>() == v->get<double>())) return absl::OkStatus();
    }
    std::vector<std::string> names;
    for (const json& a : allowed) names.push_back(a.dump());
    if (names.empty()) names.push_back("null");
    return Error(key, absl::StrCat("is ", v->dump(), "; relgen serves only ", absl::StrJoin(names, " or "), ": ", why));
  }
  // Keys that do not change inference (dropout, initialisation, training-time fusions, generation
  // defaults): read and dropped.
  void Ignore(std::initializer_list<const char*> keys) {
    for (const char* k : keys) seen_.insert(k);
  }
  // Refuses every key nobody looked at: an option relgen does not know may change the math.
  absl::Status RefuseUnknown(absl::string_view model_type) const {
    for (const auto& [key, value] : j_.items()) {
      if (!seen_.contains(key)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where_, ": key '", key, "' (", value.dump().substr(0, 60), ") is not known to relgen for model_type '",
            model_type, "' and may change the model's math; docs/models.md lists the keys handled"));
      }
    }
    return absl::OkStatus();
  }

 private:
  const json& j_;
  std::string where_;
  std::set<std::string> seen_;
};

// PretrainedConfig's own keys: generation defaults and bookkeeping, none of which changes a forward
// pass (relgen's requests carry their own sampling parameters), except those checked here.
absl::Status GenericKeys(Keys& k, bool encoder_decoder) {
  k.Ignore({"_name_or_path", "architectures", "auto_map", "transformers_version", "torch_dtype", "use_bfloat16",
            "return_dict", "output_hidden_states", "output_attentions", "torchscript", "tf_legacy_loss",
            "chunk_size_feed_forward", "is_decoder", "tie_encoder_decoder", "max_length", "min_length", "do_sample",
            "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
            "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
            "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
            "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "finetuning_task",
            "id2label", "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
            "task_specific_params", "problem_type", "_attn_implementation_autoset", "_commit_hash",
            "model_type", "use_cache", "initializer_range", "unk_token_id"});
  absl::Status s;
  s.Update(encoder_decoder ? k.Only("is_encoder_decoder", {true}, "this family is an encoder-decoder")
                           : k.Only("is_encoder_decoder", {false}, "this family is a decoder"));
  s.Update(k.Only("add_cross_attention", {false}, "a decoder without cross-attention"));
  s.Update(k.Only("pruned_heads", {json::object()}, "pruned heads change the attention shapes"));
  return s;
}

absl::Status TokenIds(Keys& k, ModelConfig& c) {
  absl::Status s;
  for (auto [key, field] : {std::pair{"bos_token_id", &c.bos_token_id}, std::pair{"eos_token_id", &c.eos_token_id},
                            std::pair{"pad_token_id", &c.pad_token_id}}) {
    const json* v = k.Get(key);
    if (v == nullptr) continue;
    // transformers allows a list of eos ids; relgen stops on one.
    if (v->is_array() && v->size() == 1) v = &(*v)[0];
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() >= c.vocab_size) {
      s.Update(k.Error(key, absl::StrCat("is ", v->dump(), "; allowed: one token id in 0..", c.vocab_size - 1)));
      continue;
    }
    *field = v->get<int>();
  }
  return s;
}

// ---- families ---------------------------------------------------------------------------------

// Where one relgen tensor comes from: a Hugging Face tensor, whole or one third of a fused QKV.
enum class Split { kNone, kHeadInterleaved, kChunked, kTranspose };
struct Source {
  std::string name;  // without the base model prefix ("transformer.")
  Split split = Split::kNone;
  int part = 0;  // 0 q, 1 k, 2 v
};

struct Family {
  std::string embed;  // the embedding's name, to find the base model prefix
  // Where transformers' model class keeps the base model's modules (BloomForCausalLM.transformer):
  // PEFT names an adapter's modules by that path, however the checkpoint names its tensors.
  std::string module_prefix;
  // relgen name -> source; empty name: not in this family. `stack` is "" (the decoder) or
  // "encoder." (encoder-decoder models).
  std::function<Source(const std::string& stack, const std::string& rest, int layer)> layer_source;
  std::map<std::string, Source> globals;
  // Stored tensors transformers does not use either (e.g. T5's unused cross-attention bias).
  std::function<bool(const std::string& name)> ignored = [](const std::string&) { return false; };
};

absl::Status MapBloom(Keys& k, ModelConfig& c, Family& f) {
  c.architecture = "bloom";
  absl::Status s;
  s.Update(k.Int({"vocab_size"}, 1, 1 << 24, &c.vocab_size, true));
  s.Update(k.Int({"hidden_size", "n_embed"}, 1, 65536, &c.d_model, true));
  s.Update(k.Int({"n_layer", "num_hidden_layers"}, 1, 1024, &c.n_layers, true));
  s.Update(k.Int({"n_head", "num_attention_heads"}, 1, 1024, &c.n_heads, true));
  c.max_seq_len = 2048;  // ALiBi has no position table; BLOOM trained on 2048
  s.Update(k.Int({"seq_length"}, 1, 1 << 20, &c.max_seq_len, false));
  s.Update(k.PositiveFloat("layer_norm_epsilon", &c.norm_eps));
  s.Update(k.Bool("tie_word_embeddings", &c.tie_embeddings));
  if (!s.ok()) return s;
  if (c.d_model % c.n_heads != 0) {
    return k.Error("hidden_size", absl::StrCat("(", c.d_model, ") is not divisible by n_head (", c.n_heads, ")"));
  }
  s.Update(k.Only("apply_residual_connection_post_layernorm", {false},
                  "the residual taken after the norm is not implemented"));
  s.Update(k.Only("n_inner", {4 * c.d_model}, "transformers' BLOOM always uses 4 x hidden_size"));
  // Tensor-parallel slicing of the dense layers: the same sums in another order.
  k.Ignore({"pretraining_tp", "slow_but_exact"});
  // Megatron training-time switches transformers ignores; offset_alibi shifts every logit of a row alike.
  k.Ignore({"hidden_dropout", "attention_dropout", "attention_softmax_in_fp32", "masked_softmax_fusion",
            "bias_dropout_fusion", "skip_bias_add", "skip_bias_add_qkv", "offset_alibi"});
  c.head_dim = c.d_model / c.n_heads;
  c.ffn_dim = 4 * c.d_model;
  c.ffn_activation = Activation::kGeluTanh;
  c.norm = NormKind::kLayerNorm;
  c.norm_placement = NormPlacement::kPre;
  c.embedding_norm = true;
  c.linear_bias = true;
  c.rel.scheme = relpos::Scheme::kAlibi;
  c.rel.scale_with_qk = false;  // alibi + QK^T / sqrt(d)
  if (!s.ok()) return s;
  f.embed = "word_embeddings.weight";
  f.module_prefix = "transformer.";
  f.globals = {{"embed.weight", {"word_embeddings.weight"}},
               {"embed_norm.weight", {"word_embeddings_layernorm.weight"}},
               {"embed_norm.bias", {"word_embeddings_layernorm.bias"}},
               {"final_norm.weight", {"ln_f.weight"}},
               {"final_norm.bias", {"ln_f.bias"}}};
  f.layer_source = [](const std::string&, const std::string& rest, int l) -> Source {
    const std::string p = absl::StrCat("h.", l, ".");
    static const std::map<std::string, std::pair<std::string, int>> kMap = {
        {"attn_norm", {"input_layernorm", -1}},
        {"attn.q", {"self_attention.query_key_value", 0}},
        {"attn.k", {"self_attention.query_key_value", 1}},
        {"attn.v", {"self_attention.query_key_value", 2}},
        {"attn.o", {"self_attention.dense", -1}},
        {"ffn_norm", {"post_attention_layernorm", -1}},
        {"ffn.up", {"mlp.dense_h_to_4h", -1}},
        {"ffn.down", {"mlp.dense_4h_to_h", -1}}};
    const size_t dot = rest.rfind('.');
    auto it = kMap.find(rest.substr(0, dot));
    if (it == kMap.end()) return {};
    const auto& [name, part] = it->second;
    return {p + name + rest.substr(dot), part < 0 ? Split::kNone : Split::kHeadInterleaved, std::max(part, 0)};
  };
  return absl::OkStatus();
}

absl::Status MapMpt(Keys& k, ModelConfig& c, Family& f) {
  c.architecture = "mpt";
  absl::Status s;
  int expansion = 4;
  s.Update(k.Int({"vocab_size"}, 1, 1 << 24, &c.vocab_size, true));
  s.Update(k.Int({"d_model"}, 1, 65536, &c.d_model, true));
  s.Update(k.Int({"n_layers"}, 1, 1024, &c.n_layers, true));
  s.Update(k.Int({"n_heads"}, 1, 1024, &c.n_heads, true));
  s.Update(k.Int({"max_seq_len"}, 1, 1 << 20, &c.max_seq_len, true));
  // transformers' MPT hard-codes 4; the original (llm-foundry) reads it: the weights' shapes decide.
  s.Update(k.Int({"expansion_ratio"}, 1, 64, &expansion, false));
  s.Update(k.PositiveFloat("layer_norm_epsilon", &c.norm_eps));
  s.Update(k.Bool("tie_word_embeddings", &c.tie_embeddings));
  bool no_bias = true;
  s.Update(k.Bool("no_bias", &no_bias));
  if (!s.ok()) return s;
  if (c.d_model % c.n_heads != 0) {
    return k.Error("d_model", absl::StrCat("(", c.d_model, ") is not divisible by n_heads (", c.n_heads, ")"));
  }
  s.Update(k.Only("logit_scale", {}, "scaled logits are not implemented (transformers ignores the key)"));
  s.Update(k.Only("norm_type", {"low_precision_layernorm", "layernorm"},
                  "other norms are not implemented (transformers' MPT always uses LayerNorm)"));
  s.Update(k.Only("fc_type", {"torch"}, "other dense-layer implementations are not implemented"));
  if (const json* ffn = k.Get("ffn_config"); ffn != nullptr) {
    if (!ffn->is_object() || ffn->value("ffn_type", "mptmlp") != "mptmlp" ||
        ffn->value("fc_type", "torch") != "torch" || ffn->size() > (ffn->contains("fc_type") ? 2u : 1u)) {
      return k.Error("ffn_config", absl::StrCat("is ", ffn->dump(), "; relgen serves only {\"ffn_type\": \"mptmlp\"}"));
    }
  }
  // Training-time only: dropout, initialisation, where weights are made, logging; the embedding
  // fraction scales a gradient, not the forward value; the tokenizer is read from tokenizer.json;
  // learned positions are not used where ALiBi is (checked below).
  k.Ignore({"resid_pdrop", "emb_pdrop", "embedding_fraction", "init_device", "init_config", "verbose",
            "tokenizer_name", "learned_pos_emb", "use_pad_tok_in_ffn"});
  if (const json* a = k.Get("attn_config"); a != nullptr) {
    if (!a->is_object()) return k.Error("attn_config", "must be an object");
    Keys ak(*a, "config.json: attn_config");
    s.Update(ak.Only("attn_type", {"multihead_attention"}, "multi-query attention is not implemented"));
    s.Update(ak.Only("alibi", {true}, "without ALiBi MPT uses learned positions, which transformers does not implement"));
    s.Update(ak.Only("qk_ln", {false}, "LayerNorm on queries and keys is not implemented (transformers ignores it)"));
    s.Update(ak.Only("clip_qkv", {}, "clipping the QKV projection is not implemented"));
    s.Update(ak.Only("prefix_lm", {false}, "prefix-LM (bidirectional prompt) attention is not implemented"));
    s.Update(ak.Only("rope", {false}, "rotary embeddings are not implemented"));
    s.Update(ak.Only("sliding_window_size", {-1}, "sliding-window attention is not implemented"));
    s.Update(ak.Only("kv_n_heads", {c.n_heads}, "grouped-query attention is not implemented"));
    s.Update(ak.Only("fused_qkv", {true}, "unfused QKV weights are not implemented"));
    s.Update(ak.Only("attn_logit_softcapping", {}, "softcapped logits are not implemented"));
    float scale = 0.f;
    s.Update(ak.PositiveFloat("softmax_scale", &scale));
    if (scale > 0.f) c.attention_scale = scale;
    s.Update(ak.PositiveFloat("alibi_bias_max", &c.rel.alibi_bias_max));
    // Implementation choice, dropout, packing of several documents per row (not served), and the
    // rotary options that apply only with rope.
    ak.Ignore({"model_type", "attn_impl", "attn_pdrop", "attn_uses_sequence_id", "rope_theta", "rope_impl", "rope_dail_config",
               "rope_hf_config"});
    s.Update(ak.RefuseUnknown("mpt"));
  }
  if (!s.ok()) return s;
  c.head_dim = c.d_model / c.n_heads;
  c.ffn_dim = expansion * c.d_model;
  c.ffn_activation = Activation::kGelu;
  c.norm = NormKind::kLayerNorm;
  c.norm_placement = NormPlacement::kPre;
  c.linear_bias = !no_bias;
  c.norm_bias = !no_bias;  // transformers drops norm biases; llm-foundry has them with no_bias false
  c.rel.scheme = relpos::Scheme::kAlibi;
  c.rel.scale_with_qk = false;  // QK^T * softmax_scale + alibi
  f.embed = "wte.weight";
  f.module_prefix = "transformer.";
  f.globals = {{"embed.weight", {"wte.weight"}},
               {"final_norm.weight", {"norm_f.weight"}},
               {"final_norm.bias", {"norm_f.bias"}}};
  f.layer_source = [](const std::string&, const std::string& rest, int l) -> Source {
    const std::string p = absl::StrCat("blocks.", l, ".");
    static const std::map<std::string, std::pair<std::string, int>> kMap = {
        {"attn_norm", {"norm_1", -1}},         {"attn.q", {"attn.Wqkv", 0}},
        {"attn.k", {"attn.Wqkv", 1}},          {"attn.v", {"attn.Wqkv", 2}},
        {"attn.o", {"attn.out_proj", -1}},     {"ffn_norm", {"norm_2", -1}},
        {"ffn.up", {"ffn.up_proj", -1}},       {"ffn.down", {"ffn.down_proj", -1}}};
    const size_t dot = rest.rfind('.');
    auto it = kMap.find(rest.substr(0, dot));
    if (it == kMap.end()) return {};
    const auto& [name, part] = it->second;
    return {p + name + rest.substr(dot), part < 0 ? Split::kNone : Split::kChunked, std::max(part, 0)};
  };
  return absl::OkStatus();
}


// T5 v1.0 / v1.1 / Flan-T5 and mT5 (T5ForConditionalGeneration, MT5ForConditionalGeneration).
absl::Status MapT5(Keys& k, ModelConfig& c, Family& f, const std::string& model_type) {
  c.architecture = "t5";
  c.encoder_decoder = true;
  if (model_type == "mt5") c.tie_embeddings = false;  // MT5Config's default
  absl::Status s;
  s.Update(k.Int({"vocab_size"}, 1, 1 << 24, &c.vocab_size, true));
  s.Update(k.Int({"d_model"}, 1, 65536, &c.d_model, true));
  s.Update(k.Int({"d_kv"}, 1, 4096, &c.head_dim, true));
  s.Update(k.Int({"d_ff"}, 1, 1 << 20, &c.ffn_dim, true));
  s.Update(k.Int({"num_layers"}, 1, 1024, &c.n_encoder_layers, true));
  c.n_layers = c.n_encoder_layers;  // T5Config: num_decoder_layers defaults to num_layers
  s.Update(k.Int({"num_decoder_layers"}, 1, 1024, &c.n_layers, false));
  s.Update(k.Int({"num_heads"}, 1, 1024, &c.n_heads, true));
  s.Update(k.Int({"relative_attention_num_buckets"}, 2, 1 << 16, &c.rel.num_buckets, false));
  s.Update(k.Int({"relative_attention_max_distance"}, 1, 1 << 20, &c.rel.max_distance, false));
  // Relative positions have no length limit; n_positions (older configs) is the trained input length.
  c.max_seq_len = 512;
  s.Update(k.Int({"n_positions"}, 1, 1 << 20, &c.max_seq_len, false));
  c.norm_eps = 1e-6f;
  s.Update(k.PositiveFloat("layer_norm_epsilon", &c.norm_eps));
  s.Update(k.Bool("tie_word_embeddings", &c.tie_embeddings));
  // feed_forward_proj "[gated-]ACT"; the derived dense_act_fn / is_gated_act, where saved, win (as
  // in T5Config, whose super().__init__ sets them last).
  std::string proj = "relu";
  if (const json* v = k.Get("feed_forward_proj"); v != nullptr) {
    if (!v->is_string()) return k.Error("feed_forward_proj", absl::StrCat("must be a string, found ", v->dump()));
    proj = v->get<std::string>();
  }
  const size_t dash = proj.find('-');
  bool gated = dash != std::string::npos && proj.substr(0, dash) == "gated";
  std::string act = dash == std::string::npos ? proj : proj.substr(dash + 1);
  if (act == "gelu" && gated) act = "gelu_new";  // T5Config's special case for "gated-gelu"
  if (const json* v = k.Get("dense_act_fn"); v != nullptr && v->is_string()) act = v->get<std::string>();
  s.Update(k.Bool("is_gated_act", &gated));
  if (!s.ok()) return s;
  static const std::map<std::string, Activation> kActs = {{"relu", Activation::kRelu},
                                                         {"gelu_new", Activation::kGeluTanh},
                                                         {"gelu_pytorch_tanh", Activation::kGeluTanh},
                                                         {"gelu", Activation::kGelu}};
  auto a = kActs.find(act);
  if (a == kActs.end()) {
    return k.Error("feed_forward_proj", absl::StrCat("is '", proj, "' (activation '", act, "'", gated ? ", gated" : "",
                                                     "); activation '", act,
                                                     "' is not implemented: relgen serves relu, gelu_new, "
                                                     "gelu_pytorch_tanh and gelu, gated or not"));
  }
  c.ffn_activation = a->second;
  c.ffn_gated = gated;
  // Training-time only: dropout, initialisation, the legacy cache switch.
  k.Ignore({"dropout_rate", "classifier_dropout", "initializer_factor", "output_past", "gradient_checkpointing"});
  c.rel.scheme = relpos::Scheme::kT5;
  c.rel.bidirectional = false;      // the decoder's buckets; the encoder uses both directions
  c.rel.share_across_layers = true;  // the first block's table serves every layer of its stack
  c.rel.heads_share_table = false;
  c.attention_scale = 1.0f;  // T5 folds 1/sqrt(d_kv) into the query weights at initialisation
  c.norm = NormKind::kRmsNorm;
  c.norm_placement = NormPlacement::kPre;
  c.norm_bias = false;
  c.linear_bias = false;
  c.decoder_start_token_id = 0;
  s.Update(k.Int({"decoder_start_token_id"}, 0, c.vocab_size - 1, &c.decoder_start_token_id, false));
  if (!s.ok()) return s;
  if (c.tie_embeddings) c.lm_head_input_scale = static_cast<float>(std::pow(static_cast<double>(c.d_model), -0.5));
  f.embed = "shared.weight";
  f.globals = {{"embed.weight", {"shared.weight"}},
               {"encoder.final_norm.weight", {"encoder.final_layer_norm.weight"}},
               {"final_norm.weight", {"decoder.final_layer_norm.weight"}},
               {"encoder.attn.rel_bias", {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                          Split::kTranspose}},
               {"attn.rel_bias", {"decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                  Split::kTranspose}}};
  f.layer_source = [gated](const std::string& stack, const std::string& rest, int l) -> Source {
    const bool enc = stack == "encoder.";
    const std::string p = absl::StrCat(enc ? "encoder" : "decoder", ".block.", l, ".layer.");
    const std::string ffn = enc ? "1" : "2";
    const std::map<std::string, std::string> map = {
        {"attn_norm", "0.layer_norm"},       {"attn.q", "0.SelfAttention.q"},
        {"attn.k", "0.SelfAttention.k"},     {"attn.v", "0.SelfAttention.v"},
        {"attn.o", "0.SelfAttention.o"},     {"cross_norm", "1.layer_norm"},
        {"cross.q", "1.EncDecAttention.q"},  {"cross.k", "1.EncDecAttention.k"},
        {"cross.v", "1.EncDecAttention.v"},  {"cross.o", "1.EncDecAttention.o"},
        {"ffn_norm", ffn + ".layer_norm"},   {"ffn.up", ffn + (gated ? ".DenseReluDense.wi_1" : ".DenseReluDense.wi")},
        {"ffn.gate", ffn + ".DenseReluDense.wi_0"}, {"ffn.down", ffn + ".DenseReluDense.wo"}};
    const size_t dot = rest.rfind('.');
    auto it = map.find(rest.substr(0, dot));
    if (it == map.end()) return {};
    return {p + it->second + rest.substr(dot)};
  };
  // Tied copies of the embedding in older saves, and the cross-attention bias table older
  // checkpoints carry but T5 never uses (transformers ignores both on load).
  f.ignored = [](const std::string& name) {
    return name == "encoder.embed_tokens.weight" || name == "decoder.embed_tokens.weight" ||
           name == "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight";
  };
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> IsHfCheckpoint(const std::string& dir) {
  if (!fs::exists(dir)) return absl::NotFoundError(absl::StrCat("model directory ", dir, " does not exist"));
  std::ifstream in(dir + "/config.json", std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model config ", dir, "/config.json"));
  std::stringstream ss;
  ss << in.rdbuf();
  // Unparseable text is left to relgen's own parser, whose message says where it broke.
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  return !j.is_discarded() && j.is_object() && j.contains("model_type");
}

absl::StatusOr<HfCheckpoint> LoadHfCheckpoint(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  auto j = ReadJsonFile(config_path);
  if (!j.ok()) return j.status();
  const json& mt = (*j)["model_type"];
  const std::string model_type = mt.is_string() ? mt.get<std::string>() : mt.dump();
  HfCheckpoint out;
  ModelConfig& c = out.config;
  c.source = "hf:" + model_type;
  c.name = fs::path(dir).lexically_normal().filename().string();
  if (c.name.empty()) c.name = fs::path(dir).lexically_normal().parent_path().filename().string();
  Keys keys(*j, config_path);
  Family family;
  absl::Status s;
  c.tie_embeddings = true;  // PretrainedConfig's default
  if (model_type == "bloom") {
    s = MapBloom(keys, c, family);
  } else if (model_type == "mpt") {
    s = MapMpt(keys, c, family);
  } else if (model_type == "t5" || model_type == "mt5") {
    s = MapT5(keys, c, family, model_type);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": model_type '", model_type,
                                                   "' is not served by relgen; Hugging Face checkpoints of "
                                                   "model_type bloom, mpt, t5 and mt5 are (docs/models.md)"));
  }
  if (!s.ok()) return s;
  if (auto st = GenericKeys(keys, c.encoder_decoder); !st.ok()) return st;
  if (auto st = TokenIds(keys, c); !st.ok()) return st;
  if (auto st = keys.RefuseUnknown(model_type); !st.ok()) return st;
  if (c.attention_scale == 0.0f) c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  // generation_config.json, where present, has the final word on the special ids.
  const std::string gen_path = dir + "/generation_config.json";
  if (fs::exists(gen_path)) {
    auto g = ReadJsonFile(gen_path);
    if (!g.ok()) return g.status();
    Keys gk(*g, gen_path);
    if (auto st = TokenIds(gk, c); !st.ok()) return st;
  }
  c.bos_before_text = false;  // the tokenizer adds what the model expects
  if (c.architecture == "t5") {
    // T5's SentencePiece model plus its sentinels <extra_id_N> above it; every text ends with </s>.
    if (!fs::exists(dir + "/spiece.model")) {
      return absl::NotFoundError(absl::StrCat(dir, ": no spiece.model (the SentencePiece model of the checkpoint, "
                                              "as downloaded with it)"));
    }
    c.tokenizer = TokenizerKind::kSentencePiece;
    c.tokenizer_file = "spiece.model";
    c.tokenizer_extra_ids = 100;  // T5Tokenizer's default
    if (fs::exists(dir + "/tokenizer_config.json")) {
      auto tc = ReadJsonFile(dir + "/tokenizer_config.json");
      if (!tc.ok()) return tc.status();
      if (auto e = tc->find("extra_ids"); e != tc->end() && e->is_number_integer()) {
        c.tokenizer_extra_ids = e->get<int>();
      }
    }
    c.tokenizer_append_eos = true;
  } else {
    if (!fs::exists(dir + "/tokenizer.json")) {
      return absl::NotFoundError(absl::StrCat(dir, ": no tokenizer.json (the Hugging Face tokenizer of the "
                                              "checkpoint, as downloaded with it)"));
    }
    c.tokenizer = TokenizerKind::kBpe;
    c.tokenizer_file = "tokenizer.json";
  }

  auto weights = Weights::Open(dir);
  if (!weights.ok()) return weights.status();
  const std::string prefix = weights->Find("transformer." + family.embed) != nullptr ? "transformer." : "";
  std::set<std::string> used;
  const std::vector<TensorSpec> specs = ExpectedTensors(c);
  for (const TensorSpec& spec : specs) {
    Source src;
    if (auto g = family.globals.find(spec.name); g != family.globals.end()) {
      src = g->second;
    } else if (spec.name == "lm_head.weight") {
      src = {"lm_head.weight"};
    } else {
      const std::string stack = spec.name.rfind("encoder.", 0) == 0 ? "encoder." : "";
      const std::string rest = spec.name.substr(stack.size());
      if (rest.rfind("layers.", 0) == 0) {
        const size_t dot = rest.find('.', 7);
        src = family.layer_source(stack, rest.substr(dot + 1), std::stoi(rest.substr(7, dot - 7)));
      }
    }
    if (src.name.empty()) return absl::InternalError(absl::StrCat("no source for tensor ", spec.name));
    const std::string name = src.name == "lm_head.weight" ? src.name : prefix + src.name;
    const TensorInfo* t = weights->Find(name);
    std::vector<int64_t> shape = spec.shape;
    if (src.split == Split::kTranspose) {
      std::swap(shape[0], shape[1]);
    } else if (src.split != Split::kNone) {
      shape[0] *= 3;
    }
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": missing tensor '", name, "' ", ShapeStr(shape), " (",
                                                     c.source, ", ", c.linear_bias ? "with" : "without",
                                                     " biases, ", c.tie_embeddings ? "tied" : "untied", " head)"));
    }
    if (auto st = CheckFloatTensor(*t, name, shape, weights->FileOf(name)); !st.ok()) return st;
    used.insert(name);
    if (src.split == Split::kTranspose) {  // T5's bias table [buckets, heads] -> [heads, buckets] (small)
      auto v = ToFloat32(*t);
      if (!v.ok()) return v.status();
      const int64_t rows = shape[0], cols = shape[1];
      std::vector<float> tr(v->size());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t col = 0; col < cols; ++col) tr[col * rows + r] = (*v)[r * cols + col];
      }
      out.tensors.small.emplace(spec.name, std::move(tr));
      continue;
    }
    // Rows of a fused projection: BLOOM interleaves per head ([heads, 3, head_dim]); MPT chunks
    // ([3, heads * head_dim]). A bias is a matrix of one column. Each part is a view of the fused bytes.
    const StoredMatrix::Rows layout = src.split == Split::kNone      ? StoredMatrix::Rows::kAll
                                      : src.split == Split::kChunked ? StoredMatrix::Rows::kChunked
                                                                     : StoredMatrix::Rows::kHeadInterleaved;
    AddStored(spec.name, *t, &out.tensors, layout, src.part, c.head_dim);
    // A layer's projection: what a LoRA adapter of its module adapts.
    if (spec.name.find("layers.") != std::string::npos && IsStoredMatrix(spec.name) && absl::EndsWith(src.name, ".weight")) {
      const std::string module = family.module_prefix + src.name.substr(0, src.name.size() - 7);
      out.tensors.peft_modules[module].push_back(spec.name);
    }
  }
  // A tied head may still be stored; transformers ties it to the embedding regardless.
  if (c.tie_embeddings && weights->Find("lm_head.weight") != nullptr) used.insert("lm_head.weight");
  for (const std::string& name : weights->Names()) {
    if (!used.contains(name) && !family.ignored(name)) {
      return absl::InvalidArgumentError(absl::StrCat(weights->FileOf(name), ": unexpected tensor '", name,
                                                     "': the ", c.source, " mapping does not use it, so the "
                                                     "checkpoint is not the model relgen would serve"));
    }
  }
  const TensorInfo* embed = weights->Find(prefix + family.embed);
  out.file_dtype = embed->dtype;
  out.tensors.owners = weights->TakeFiles();
  return out;
}

}  // namespace relgen
