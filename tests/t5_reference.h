// Transformers' outputs for the tiny T5 / mT5 checkpoints tools/make_t5_checkpoints.py writes (ctest
// fixture t5_checkpoints, directory in RELGEN_T5_CASES_DIR), and the check that a backend reproduces
// them: the encoder once, then the decoder step by step, every step's logits and greedy token.
// Shared by the CPU test (t5_checkpoint_test) and the CUDA suite (cuda_backend_test).
#pragma once

#include <algorithm>
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

inline std::string T5CasesDir() {
  const char* d = std::getenv("RELGEN_T5_CASES_DIR");
  return d == nullptr ? "" : d;
}

inline nlohmann::json T5Manifest() { return ReadJson(T5CasesDir() + "/manifest.json"); }

// The manifest's good checkpoints; empty where the fixture was not run.
inline std::vector<nlohmann::json> T5Cases() {
  if (T5CasesDir().empty()) return {};
  const nlohmann::json manifest = T5Manifest();
  std::vector<nlohmann::json> cases;
  for (const auto& c : manifest["cases"]) cases.push_back(c);
  return cases;
}

struct T5Input {
  std::vector<int32_t> input, greedy;
  std::vector<double> logits;  // [greedy, vocab]: the decoder's logits before each greedy token
};

inline std::vector<T5Input> ReadT5Reference(const nlohmann::json& c) {
  auto file = SafetensorsFile::Open(c["reference"].get<std::string>());
  EXPECT_TRUE(file.ok()) << file.status();
  std::vector<T5Input> out;
  if (!file.ok()) return out;
  for (int i = 0; i < c["inputs"].get<int>(); ++i) {
    T5Input p;
    auto ints = [&](const std::string& name) {
      const TensorInfo* t = (*file)->Find(name);
      std::vector<int32_t> v(t->numel());
      std::memcpy(v.data(), t->data, t->nbytes);
      return v;
    };
    p.input = ints("input_" + std::to_string(i));
    p.greedy = ints("greedy_" + std::to_string(i));
    const TensorInfo* l = (*file)->Find("logits_" + std::to_string(i));
    std::vector<float> f(l->numel());
    std::memcpy(f.data(), l->data, l->nbytes);
    p.logits.assign(f.begin(), f.end());
    out.push_back(std::move(p));
  }
  return out;
}

// Encodes the input in the step of the decoder's first token (decoder_start_token_id), then feeds
// transformers' greedy tokens one at a time; decoder and cross-attention blocks are scattered over
// the pool. `chunked`: after the first step, the rest of the decoder tokens in one chunk (what a
// preempted sequence recomputes). Returns every step's logits (empty after a failure, which it
// reports).
inline std::vector<float> TeacherForcedT5(Backend& backend, const T5Input& p, int decoder_start, bool chunked,
                                          int max_new, const std::string& what, const LoraAdapter* adapter = nullptr) {
  const int block = backend.Describe().kv_cache.block_size;
  const int new_tokens = std::min<int>(max_new, static_cast<int>(p.greedy.size()));
  std::vector<int32_t> dec = {decoder_start};
  dec.insert(dec.end(), p.greedy.begin(), p.greedy.begin() + new_tokens - 1);
  const int n = static_cast<int>(p.input.size());
  const int self_blocks = (new_tokens + block - 1) / block, cross_blocks = (n + block - 1) / block;
  if (self_blocks + cross_blocks > backend.Describe().kv_cache.num_blocks) {
    ADD_FAILURE() << what << ": the pool is too small";
    return {};
  }
  // Interleaved, from the top of the pool down: neither table is contiguous.
  std::vector<int32_t> self, cross;
  for (int b = backend.Describe().kv_cache.num_blocks - 1; static_cast<int>(self.size() + cross.size()) <
                                                    self_blocks + cross_blocks; --b) {
    ((b % 2 == 0 && static_cast<int>(self.size()) < self_blocks) || static_cast<int>(cross.size()) == cross_blocks
         ? self
         : cross)
        .push_back(b);
  }
  std::vector<float> all, part;
  SequenceStep s;
  s.tokens = absl::MakeConstSpan(dec).subspan(0, 1);
  s.block_table = self;
  s.encoder_tokens = p.input;
  s.encoder_len = n;
  s.cross_block_table = cross;
  s.adapter = adapter;
  if (!ForwardLogits(backend, {&s, 1}, &all).ok()) {
    ADD_FAILURE() << what << ": the encoding step failed";
    return {};
  }
  s.encoder_tokens = {};
  if (chunked && new_tokens > 1) {
    s.tokens = absl::MakeConstSpan(dec).subspan(1);
    s.start_pos = 1;
    s.all_logits = true;
    if (!ForwardLogits(backend, {&s, 1}, &part).ok()) {
      ADD_FAILURE() << what << ": the chunk failed";
      return {};
    }
    all.insert(all.end(), part.begin(), part.end());
  }
  for (int t = 1; !chunked && t < new_tokens; ++t) {
    s.tokens = absl::MakeConstSpan(dec).subspan(t, 1);
    s.start_pos = t;
    if (!ForwardLogits(backend, {&s, 1}, &part).ok()) {
      ADD_FAILURE() << what << ": decode step " << t << " failed";
      return {};
    }
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// TeacherForcedT5 for each input: every step's logits within `rtol` (relative to the row's
// largest) and each argmax equal to transformers' token. Returns all logits, for bitwise
// comparisons.
inline std::vector<float> ExpectBackendMatchesT5(Backend& backend, const std::vector<T5Input>& inputs, int vocab,
                                                 int decoder_start, double rtol, const std::string& what,
                                                 bool chunked = false, int max_new = 1 << 30) {
  std::vector<float> everything;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const T5Input& p = inputs[i];
    const int n = static_cast<int>(p.input.size());
    const std::string name = what + " input " + std::to_string(i) + " (" + std::to_string(n) + " tokens)";
    const std::vector<float> all = TeacherForcedT5(backend, p, decoder_start, chunked, max_new, name);
    if (all.empty()) return everything;
    const int rows = static_cast<int>(all.size() / vocab);
    EXPECT_EQ(rows, std::min<int>(max_new, static_cast<int>(p.greedy.size()))) << name;
    for (int t = 0; t < rows; ++t) {
      const float* row = all.data() + int64_t{t} * vocab;
      const int argmax = static_cast<int>(std::max_element(row, row + vocab) - row);
      EXPECT_EQ(argmax, p.greedy[t]) << name << " new token " << t;
    }
    ExpectRowsClose(all.data(), p.logits.data(), rows, vocab, rtol, name);
    everything.insert(everything.end(), all.begin(), all.end());
  }
  return everything;
}

}  // namespace relgen::testing
