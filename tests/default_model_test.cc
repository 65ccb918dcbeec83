// The shipped default model: relgen equals the PyTorch module it was trained as (greedy tokens and
// logits), and relgen-server serves it, readably, when no --model is given.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <regex>

#include "engine/backends/cpu_backend.h"
#include "engine/backends/step_sync.h"
#include "engine/core/engine.h"
#include "relgen/v1/generation.grpc.pb.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

#include <grpcpp/grpcpp.h>

namespace relgen {
namespace {

const std::string kModelDir = std::string(RELGEN_SOURCE_DIR) + "/models/default";
const std::vector<std::string> kPrompts = {"The meaning of life is", "A computer", "Q: Why did the chicken",
                                           "Love is", "There was a young man"};

nlohmann::json PyTorchGreedy(int max_new) {
  std::string cmd = "/usr/bin/python3 '" + std::string(RELGEN_SOURCE_DIR) + "/tools/greedy_ref.py' --model '" +
                    kModelDir + "' --new " + std::to_string(max_new);
  for (const std::string& p : kPrompts) cmd += " '" + p + "'";
  FILE* f = popen(cmd.c_str(), "r");
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  EXPECT_EQ(pclose(f), 0) << cmd;
  return nlohmann::json::parse(out);
}

TEST(DefaultModelTest, GreedyAndLogitsEqualPyTorch) {
  auto model = Model::Load(kModelDir);
  ASSERT_TRUE(model.ok()) << model.status();
  const nlohmann::json ref = PyTorchGreedy(100);
  auto engine = *Engine::Create(*model, *NewCpuBackend(*model, KvCacheConfig{16, 256}, 0), NewByteTokenizer(), EngineConfig{});
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    Request r;
    r.prompt = {(*model)->config().bos_token_id};
    for (char c : kPrompts[i]) r.prompt.push_back(static_cast<uint8_t>(c));
    r.stop.max_new_tokens = 100;
    r.stop.ignore_eos = true;
    r.sampling.temperature = 0;
    auto h = *engine->Submit(r);
    std::vector<int32_t> got;
    Output o;
    while (h->Next(&o)) got.insert(got.end(), o.token_ids.begin(), o.token_ids.end());
    EXPECT_EQ(got, ref["tokens"][i].get<std::vector<int32_t>>()) << "prompt " << i << ": " << kPrompts[i];
  }
  // Logits of the first prompt + continuation, position by position.
  const std::vector<int32_t> seq = ref["first_sequence"].get<std::vector<int32_t>>();
  const std::vector<std::vector<double>> want = ref["logits"].get<std::vector<std::vector<double>>>();
  auto backend = *NewCpuBackend(*model, KvCacheConfig{16, 16}, 0);
  std::vector<int32_t> table(16);
  for (int b = 0; b < 16; ++b) table[b] = b;
  std::vector<float> logits;
  SequenceStep step{seq, 0, table, true};
  ASSERT_TRUE(ForwardLogits(*backend, {&step, 1}, &logits).ok());
  const int vocab = (*model)->config().vocab_size;
  std::vector<double> flat;
  for (const auto& row : want) flat.insert(flat.end(), row.begin(), row.end());
  testing::ExpectRowsClose(logits.data(), flat.data(), static_cast<int>(seq.size()), vocab, 1e-4, "default model");
}

TEST(DefaultModelTest, ServerWithoutModelFlagServesReadableText) {
  testing::ServerProcess server;
  std::string error;
  ASSERT_TRUE(server.Start({"--kv_cache_tokens", "8192"}, &error)) << error;
  EXPECT_THAT(server.startup_output(), ::testing::HasSubstr("models/default"));
  auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_text("The secret of happiness is");
  req.set_max_new_tokens(80);
  req.set_ignore_eos(true);  // a fortune may end early; 80 tokens are enough text to judge
  req.set_temperature(0.7f);
  req.set_seed(3);
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok());
  // Readable: mostly letters, spaces and punctuation, and several real-looking words.
  int readable = 0;
  for (unsigned char c : resp.text()) readable += std::isalpha(c) || std::isspace(c) || std::ispunct(c);
  EXPECT_GT(readable, 0.9 * resp.text().size()) << resp.text();
  const std::regex word("[A-Za-z]{2,}");
  const auto words = std::distance(std::sregex_iterator(resp.text().begin(), resp.text().end(), word), std::sregex_iterator());
  EXPECT_GE(words, 8) << resp.text();
  std::printf("sample: The secret of happiness is%s\n", resp.text().c_str());
}

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define RELGEN_UNDER_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RELGEN_UNDER_SANITIZER 1
#endif

// At the defaults the server sizes its KV pool for --max_num_seqs (64) whole contexts (1024 tokens)
// and takes its pages only as they are written: idle, it holds little.
TEST(DefaultModelTest, IdleServerAtTheDefaultsHoldsUnder300MB) {
#ifdef RELGEN_UNDER_SANITIZER
  GTEST_SKIP() << "a sanitizer's shadow memory is resident too: the main tree checks this";
#endif
  testing::ServerProcess server;
  std::string error;
  ASSERT_TRUE(server.Start({}, &error)) << error;
  EXPECT_THAT(server.startup_output(), ::testing::HasSubstr("KV cache 65536 tokens"));
  auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_text("Idle after one request");
  req.set_max_new_tokens(16);
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok());
  std::ifstream status("/proc/" + std::to_string(server.pid()) + "/status");
  std::string line;
  int64_t rss_kib = -1;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss_kib = std::stoll(line.substr(6));
  }
  ASSERT_GT(rss_kib, 0);
  std::printf("idle server: VmRSS %.1f MiB\n", rss_kib / 1024.0);
  EXPECT_LT(rss_kib, 300 * 1024);
}

}  // namespace
}  // namespace relgen
