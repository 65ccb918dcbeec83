// Transformers' outputs for the tiny Hugging Face checkpoints tools/make_hf_checkpoints.py writes
// (ctest fixture hf_checkpoints, directory in RELGEN_HF_CASES_DIR), and the check that a backend
// reproduces them: every position's logits and the greedy tokens. Shared by the CPU test
// (hf_checkpoint_test) and the CUDA suite (cuda_backend_test, on a GPU and on the emulator).
#pragma once

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "engine/backends/backend.h"
#include "engine/backends/step_sync.h"
#include "engine/model/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace relgen::testing {

inline std::string HfCasesDir() {
  const char* d = std::getenv("RELGEN_HF_CASES_DIR");
  return d == nullptr ? "" : d;
}

// The manifest's cases (good checkpoints); empty where the fixture was not run.
inline std::vector<nlohmann::json> HfCases() {
  if (HfCasesDir().empty()) return {};
  const nlohmann::json manifest = ReadJson(HfCasesDir() + "/manifest.json");
  std::vector<nlohmann::json> cases;
  for (const auto& c : manifest["cases"]) cases.push_back(c);
  return cases;
}

struct HfPrompt {
  std::vector<int32_t> prompt, greedy;
  std::vector<double> logits;  // [prompt + greedy, vocab]
};

inline std::vector<HfPrompt> ReadHfReference(const nlohmann::json& c) {
  auto file = SafetensorsFile::Open(c["reference"].get<std::string>());
  EXPECT_TRUE(file.ok()) << file.status();
  std::vector<HfPrompt> out;
  if (!file.ok()) return out;
  for (int i = 0; i < c["prompts"].get<int>(); ++i) {
    HfPrompt p;
    auto ints = [&](const std::string& name) {
      const TensorInfo* t = (*file)->Find(name);
      std::vector<int32_t> v(t->numel());
      std::memcpy(v.data(), t->data, t->nbytes);
      return v;
    };
    p.prompt = ints("prompt_" + std::to_string(i));
    p.greedy = ints("greedy_" + std::to_string(i));
    const TensorInfo* l = (*file)->Find("logits_" + std::to_string(i));
    std::vector<float> f(l->numel());
    std::memcpy(f.data(), l->data, l->nbytes);
    p.logits.assign(f.begin(), f.end());
    out.push_back(std::move(p));
  }
  return out;
}

// Prefills the prompt, then decodes transformers' greedy tokens one at a time (a page-scattered
// block table). Returns the logits of every prompt position and every decoded one (empty after a
// failure, which it reports).
inline std::vector<float> TeacherForcedHf(Backend& backend, const HfPrompt& p, int max_new, const std::string& what,
                                          const LoraAdapter* adapter = nullptr) {
  const int block = backend.Describe().kv_cache.block_size;
  const int new_tokens = std::min<int>(max_new, static_cast<int>(p.greedy.size()));
  std::vector<int32_t> seq = p.prompt;
  seq.insert(seq.end(), p.greedy.begin(), p.greedy.begin() + new_tokens);
  std::vector<int32_t> table((seq.size() + block - 1) / block);
  std::iota(table.begin(), table.end(), 0);
  std::reverse(table.begin(), table.end());
  std::vector<float> all, part;
  const int n = static_cast<int>(p.prompt.size());
  SequenceStep s{absl::MakeConstSpan(seq).subspan(0, n), 0, table, true};
  s.adapter = adapter;
  if (!ForwardLogits(backend, {&s, 1}, &all).ok()) {
    ADD_FAILURE() << what << ": the prefill failed";
    return {};
  }
  for (int t = 0; t + 1 < new_tokens; ++t) {
    SequenceStep d{absl::MakeConstSpan(seq).subspan(n + t, 1), n + t, table, false};
    d.adapter = adapter;
    if (!ForwardLogits(backend, {&d, 1}, &part).ok()) {
      ADD_FAILURE() << what << ": decode step " << t << " failed";
      return {};
    }
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// TeacherForcedHf for each prompt: every position's logits within `rtol` (relative to the row's
// largest), and each step's argmax equal to transformers' next token. Returns all logits, for
// bitwise comparisons.
inline std::vector<float> ExpectBackendMatchesHf(Backend& backend, const std::vector<HfPrompt>& prompts, int vocab,
                                                 double rtol, const std::string& what, int max_new = 1 << 30) {
  std::vector<float> everything;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const HfPrompt& p = prompts[i];
    const std::string name = what + " prompt " + std::to_string(i);
    const std::vector<float> all = TeacherForcedHf(backend, p, max_new, name);
    if (all.empty()) return everything;
    const int rows = static_cast<int>(all.size() / vocab), n = static_cast<int>(p.prompt.size());
    for (int t = 0; n - 1 + t < rows; ++t) {
      // The token transformers chose from these logits must be relgen's argmax too.
      const float* row = all.data() + int64_t{n - 1 + t} * vocab;
      const int argmax = static_cast<int>(std::max_element(row, row + vocab) - row);
      EXPECT_EQ(argmax, p.greedy[t]) << name << " new token " << t;
    }
    ExpectRowsClose(all.data(), p.logits.data(), rows, vocab, rtol, name);
    everything.insert(everything.end(), all.begin(), all.end());
  }
  return everything;
}

}  // namespace relgen::testing
