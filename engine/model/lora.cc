#include "engine/model/lora.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace relgen {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr absl::string_view kKeyPrefix = "base_model.model.";

// The value PEFT takes for `module` from a rank_pattern or alpha_pattern: the first key that matches
// the end of the module's path (PEFT's get_pattern_key: re.match(rf".*\.{key}$", module)).
const json* PatternValue(const json& patterns, const std::string& module) {
  if (!patterns.is_object()) return nullptr;
  for (const auto& [key, value] : patterns.items()) {
    try {
      if (std::regex_match(module, std::regex(".*\\." + key))) return &value;
    } catch (const std::regex_error&) {
      if (absl::EndsWith(module, "." + key)) return &value;
    }
  }
  return nullptr;
}

}  // namespace

int64_t LoraAdapter::bytes() const {
  int64_t n = 0;
  for (const auto& [name, w] : targets) n += static_cast<int64_t>(w.a.size() + w.b.size()) * sizeof(float);
  return n;
}

absl::StatusOr<std::shared_ptr<const LoraAdapter>> LoadLoraAdapter(const std::string& name, const std::string& dir,
                                                                   const Model& base, int max_rank) {
  const std::string config_path = dir + "/adapter_config.json";
  const std::string weights_path = dir + "/adapter_model.safetensors";
  auto bad = [&](absl::string_view where, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("adapter '", name, "': ", where, ": ", what));
  };
  if (base.peft_modules().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adapter '", name, "': the base model (", base.dir(),
        ") is in relgen's own format; LoRA adapters apply to Hugging Face checkpoints (bloom, mpt, t5, mt5) "
        "as PEFT names their modules"));
  }
  std::ifstream in(config_path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("adapter '", name, "': cannot open ", config_path,
                                            " (a PEFT adapter directory holds adapter_config.json and "
                                            "adapter_model.safetensors)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const json config = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) return bad(config_path, "is not a JSON object");
  auto get = [&](const char* key) -> const json* {
    auto it = config.find(key);
    return it == config.end() || it->is_null() ? nullptr : &*it;
  };
  // What the adapter is and what relgen applies of it.
  if (const json* t = get("peft_type"); t == nullptr || *t != "LORA") {
    return bad(config_path, absl::StrCat("peft_type is ", t == nullptr ? "missing" : t->dump(),
                                         "; relgen applies LORA adapters only"));
  }
  if (const json* m = get("modules_to_save"); m != nullptr && !(m->is_array() && m->empty())) {
    return bad(config_path, absl::StrCat("modules_to_save is ", m->dump(),
                                         ": whole trained copies of base modules are not applied; allowed: null"));
  }
  if (const json* d = get("use_dora"); d != nullptr && *d != false) {
    return bad(config_path, "use_dora is true: DoRA's magnitude vectors are not applied; allowed: false");
  }
  if (const json* b = get("bias"); b != nullptr && *b != "none") {
    return bad(config_path, absl::StrCat("bias is ", b->dump(), ": trained biases are not applied; allowed: \"none\""));
  }
  if (const json* r = get("layer_replication"); r != nullptr) {
    return bad(config_path, "layer_replication is set: a base with replicated layers is not served; allowed: null");
  }
  int r = 0;
  double alpha = 0;
  if (const json* v = get("r"); v != nullptr && v->is_number_integer() && v->get<int64_t>() >= 1) {
    r = v->get<int>();
  } else {
    return bad(config_path, absl::StrCat("r is ", v == nullptr ? "missing" : v->dump(), "; allowed: an integer >= 1"));
  }
  if (const json* v = get("lora_alpha"); v != nullptr && v->is_number()) {
    alpha = v->get<double>();
  } else {
    return bad(config_path, absl::StrCat("lora_alpha is ", v == nullptr ? "missing" : v->dump(), "; allowed: a number"));
  }
  const json* rs = get("use_rslora");
  const bool rslora = rs != nullptr && rs->is_boolean() && rs->get<bool>();
  const json empty = json::object();
  const json& rank_pattern = get("rank_pattern") != nullptr ? *get("rank_pattern") : empty;
  const json& alpha_pattern = get("alpha_pattern") != nullptr ? *get("alpha_pattern") : empty;
  // fan_in_fan_out describes Conv1D bases (GPT-2); for Linear modules, as every one here is, PEFT
  // itself sets it to false and computes the same, so it is accepted either way.

  if (!fs::exists(weights_path)) {
    return absl::NotFoundError(absl::StrCat("adapter '", name, "': no ", weights_path,
                                            " (PEFT's save_pretrained writes it beside adapter_config.json)"));
  }
  auto file = SafetensorsFile::Open(weights_path);
  if (!file.ok()) return file.status();

  // Pairs by module path, then checked as a pair.
  struct Pair {
    const TensorInfo* a = nullptr;
    const TensorInfo* b = nullptr;
  };
  std::map<std::string, Pair> pairs;
  for (const TensorInfo& t : (*file)->tensors()) {
    std::string module;
    bool is_a = false;
    if (absl::StartsWith(t.name, kKeyPrefix) && absl::EndsWith(t.name, ".lora_A.weight")) {
      module = t.name.substr(kKeyPrefix.size(), t.name.size() - kKeyPrefix.size() - 14);
      is_a = true;
    } else if (absl::StartsWith(t.name, kKeyPrefix) && absl::EndsWith(t.name, ".lora_B.weight")) {
      module = t.name.substr(kKeyPrefix.size(), t.name.size() - kKeyPrefix.size() - 14);
    } else {
      return bad(weights_path, absl::StrCat("tensor '", t.name, "' is not a LoRA matrix relgen applies (allowed: ",
                                            kKeyPrefix, "<module>.lora_A.weight and .lora_B.weight)"));
    }
    if (!base.peft_modules().contains(module)) {
      std::set<std::string> kinds;  // the adaptable module names without their layer
      for (const auto& [m, _] : base.peft_modules()) kinds.insert(std::regex_replace(m, std::regex("\\.\\d+\\."), ".N."));
      return bad(weights_path, absl::StrCat("tensor '", t.name, "' adapts module '", module,
                                            "', which the base (", base.config().source,
                                            ") does not have or relgen does not adapt; adaptable: ",
                                            absl::StrJoin(kinds, ", ")));
    }
    if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
      return bad(weights_path, absl::StrCat("tensor '", t.name, "' has dtype ", DTypeName(t.dtype),
                                            "; allowed: F32, F16, BF16"));
    }
    (is_a ? pairs[module].a : pairs[module].b) = &t;
  }
  if (pairs.empty()) return bad(weights_path, "holds no LoRA tensors");

  auto adapter = std::make_shared<LoraAdapter>();
  adapter->name = name;
  adapter->dir = dir;
  for (const auto& [module, p] : pairs) {
    const std::string key = absl::StrCat(kKeyPrefix, module);
    if (p.a == nullptr || p.b == nullptr) {
      return bad(weights_path, absl::StrCat("module '", module, "' has ", p.a == nullptr ? "lora_B" : "lora_A",
                                            " but no ", p.a == nullptr ? "lora_A" : "lora_B", " (", key, ")"));
    }
    const std::vector<std::string>& targets = base.peft_modules().at(module);
    const StoredMatrix* first = base.Matrix(targets.front());
    const int64_t in = first->cols;
    const int64_t out = first->rows * static_cast<int64_t>(targets.size());  // the fused width
    if (p.a->shape.size() != 2 || p.a->shape[1] != in) {
      return bad(weights_path, absl::StrCat("tensor '", p.a->name, "' has shape ", ShapeStr(p.a->shape),
                                            "; module '", module, "' takes ", in, " inputs, so lora_A must be [rank, ",
                                            in, "]"));
    }
    const int64_t rank = p.a->shape[0];
    if (p.b->shape.size() != 2 || p.b->shape[0] != out || p.b->shape[1] != rank) {
      return bad(weights_path, absl::StrCat("tensor '", p.b->name, "' has shape ", ShapeStr(p.b->shape),
                                            "; module '", module, "' has ", out, " outputs and lora_A's rank is ", rank,
                                            ", so lora_B must be [", out, ", ", rank, "]"));
    }
    int want = r;
    if (const json* v = PatternValue(rank_pattern, module); v != nullptr && v->is_number_integer()) want = v->get<int>();
    if (rank != want) {
      return bad(weights_path, absl::StrCat("tensor '", p.a->name, "' has rank ", rank, "; the config says ", want,
                                            " (r or rank_pattern)"));
    }
    if (rank > max_rank) {
      return bad(weights_path, absl::StrCat("module '", module, "' has rank ", rank, ", over --max_lora_rank ",
                                            max_rank, "; allowed: 1..", max_rank));
    }
    double a = alpha;
    if (const json* v = PatternValue(alpha_pattern, module); v != nullptr && v->is_number()) a = v->get<double>();
    const float scale = static_cast<float>(rslora ? a / std::sqrt(static_cast<double>(rank)) : a / rank);
    auto av = ToFloat32(*p.a);
    if (!av.ok()) return av.status();
    auto bv = ToFloat32(*p.b);
    if (!bv.ok()) return bv.status();
    for (const std::vector<float>* v : {&*av, &*bv}) {
      for (float x : *v) {
        if (!std::isfinite(x)) return bad(weights_path, absl::StrCat("module '", module, "' holds a value that is not finite"));
      }
    }
    // Each relgen matrix the module feeds: all of B, or the rows of its part of a fused projection.
    for (const std::string& target : targets) {
      const StoredMatrix* m = base.Matrix(target);
      LoraWeights w;
      w.rank = static_cast<int>(rank);
      w.in = static_cast<int>(in);
      w.out = static_cast<int>(m->rows);
      w.scale = scale;
      w.a = *av;
      w.b.resize(static_cast<size_t>(m->rows * rank));
      for (int64_t row = 0; row < m->rows; ++row) {
        std::copy_n(bv->data() + m->SourceRow(row) * rank, rank, w.b.data() + row * rank);
      }
      adapter->rank = std::max(adapter->rank, w.rank);
      adapter->targets.emplace(target, std::move(w));
    }
  }
  return std::shared_ptr<const LoraAdapter>(std::move(adapter));
}

}  // namespace relgen
