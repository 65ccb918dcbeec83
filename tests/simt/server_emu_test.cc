// relgen-server end to end on the CUDA backend built against the SIMT emulator
// (relgen-server-emu): it serves what the CPU server serves, and a device fault turns it away
// (health NOT_SERVING, requests UNAVAILABLE) and ends it with status 3.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "tests/grpc_test_util.h"
#include "tests/server_process.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

// Starts `binary` (RELGEN_SERVER_BIN is what ServerProcess runs) with `env` set in the child.
std::unique_ptr<testing::ServerProcess> StartBinary(const std::string& binary, const std::vector<std::string>& args,
                                                    const std::vector<std::pair<std::string, std::string>>& env = {}) {
  const std::string saved = testing::ServerProcess::Binary();
  setenv("RELGEN_SERVER_BIN", binary.c_str(), 1);
  for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
  auto p = StartServer(args);
  for (const auto& [k, v] : env) unsetenv(k.c_str());
  setenv("RELGEN_SERVER_BIN", saved.c_str(), 1);
  return p;
}

std::string EmuBinary() { return testing::ServerProcess::Binary(); }
std::string CpuBinary() {
  const char* b = std::getenv("RELGEN_CPU_SERVER_BIN");
  return b != nullptr ? b : "relgen-server";
}

std::vector<std::string> Args(const std::string& device, std::vector<std::string> more = {}) {
  std::vector<std::string> a = {"--model", ModelDir("skew"), "--device", device, "--kv_cache_tokens", "2048",
                                "--max_batch_tokens", "64", "--max_num_seqs", "4"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::string Health(const testing::ServerProcess& p) {
  const auto [s, body] = RawUnary(grpc::CreateChannel(p.address(), grpc::InsecureChannelCredentials()),
                                  "/grpc.health.v1.Health/Check", "");
  return s.ok() ? body : "error: " + s.error_message();
}
const std::string kServing("\x08\x01", 2), kNotServing("\x08\x02", 2);

// Greedy generations through the emulated device equal the CPU server's, batched or not.
// (float32 weights and cache on both: a GPU's defaults are bf16, which the next test checks are
// taken.)
TEST(EmulatedServerTest, ServesWhatTheCpuServerServes) {
  auto emu = StartBinary(EmuBinary(), Args("cuda", {"--weights_dtype", "f32", "--kv_cache_dtype", "f32"}));
  ASSERT_THAT(emu->startup_output(), HasSubstr("f32 (invariant projections) weights) on simt-emulator:0"));
  auto cpu = StartBinary(CpuBinary(), Args("cpu"));
  ASSERT_THAT(cpu->startup_output(), HasSubstr("on cpu"));
  EXPECT_EQ(Health(*emu), kServing);
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> prompt;
    for (int t = 0; t < 5 + 9 * i; ++t) prompt.push_back((13 * i + 7 * t + 1) % 256);
    requests.push_back(TokenRequest(prompt, 6));
    requests.back().set_temperature(0);
  }
  auto emu_stub = Stub(*emu), cpu_stub = Stub(*cpu);
  std::vector<std::future<Collected>> batched;
  for (const auto& r : requests) {
    batched.push_back(std::async(std::launch::async, [&emu_stub, r] { return Stream(*emu_stub, r); }));
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    const Collected want = Stream(*cpu_stub, requests[i]);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    ASSERT_EQ(want.tokens.size(), 6u);
    const Collected got = batched[i].get();
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.tokens, want.tokens) << "request " << i;
  }
  emu->Signal(SIGTERM);
  EXPECT_EQ(emu->Wait(), 0);
}

// A server started with `more` says `startup` and, in GetModelInfo, bf16 weights and `projections`
// with their batch invariance; and serves a greedy request.
void ExpectServesAndSays(const std::vector<std::string>& more, const std::string& startup,
                         const std::string& projections, bool batch_invariant) {
  auto emu = StartBinary(EmuBinary(), Args("cuda", more));
  EXPECT_THAT(emu->startup_output(), HasSubstr(startup));
  EXPECT_THAT(emu->startup_output(), HasSubstr(" tokens (bf16, "));
  v1::GenerateRequest r = TokenRequest({5, 17, 29, 41, 53, 65, 77}, 4);
  r.set_temperature(0);
  auto stub = Stub(*emu);
  const Collected got = Stream(*stub, r);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens.size(), 4u);
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.compute_weights_dtype(), "bf16");
  EXPECT_EQ(info.projections(), projections);
  EXPECT_EQ(info.batch_invariant(), batch_invariant);
  emu->Signal(SIGTERM);
  EXPECT_EQ(emu->Wait(), 0);
}

// A GPU's defaults: bf16 weights and a bf16 cache, said at startup, and serving.
TEST(EmulatedServerTest, DefaultsToBf16) {
  ExpectServesAndSays({}, "bf16 (invariant projections) weights) on simt-emulator:0", "invariant projections", true);
}

// cuBLAS's projections over bf16 weights serve, and the startup line and GetModelInfo say that a
// request's outputs may change with what is batched beside it.
TEST(EmulatedServerTest, CublasSaysItIsNotBatchInvariant) {
  ExpectServesAndSays({"--cuda_gemm", "cublas"},
                      "bf16 (cublas bf16 tensor-core projections, not batch invariant) weights) on simt-emulator:0",
                      "cublas bf16 tensor-core projections, not batch invariant", false);
}

// The first kernel of the first step faults: that request and every later one fail UNAVAILABLE
// naming the fault, health turns NOT_SERVING and readiness 503 while the server waits out its exit
// delay, and it ends with status 3.
TEST(EmulatedServerTest, DeviceFaultTurnsTheServerAwayAndExits3) {
  auto server = StartBinary(EmuBinary(), Args("cuda", {"--device_failure_exit_delay_seconds", "600"}),
                            {{"RELGEN_SIMT_FAULT_AT_LAUNCH", "1"}});
  EXPECT_EQ(Health(*server), kServing);
  auto stub = Stub(*server);
  const Collected first = Stream(*stub, TokenRequest({1, 2, 3}, 4));
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(first.status.error_message(), HasSubstr("the device failed"));
  EXPECT_THAT(first.status.error_message(), HasSubstr("an illegal memory access"));
  // Main notices within its 100 ms tick; wait for the state, however long the machine takes.
  std::string health;
  for (int i = 0; i < 6000 && health != kNotServing; ++i) {
    health = Health(*server);
    if (health != kNotServing) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(health, kNotServing);
  EXPECT_THAT(testing::HttpGet(server->metrics_port(), "/readyz"), HasSubstr("503 Service Unavailable"));
  const Collected later = Stream(*stub, TokenRequest({4, 5}, 2));
  EXPECT_EQ(later.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(later.status.error_message(), HasSubstr("the device failed"));
  const auto m = testing::ParseMetrics(testing::Scrape(server->metrics_port()));
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"UNAVAILABLE\"}"), 2);
  EXPECT_EQ(Metric(m, "relgen_request_errors_total{code=\"INTERNAL\"}"), 0);
  server->Signal(SIGTERM);  // ends the delay early; still a failed server
  std::string output;
  EXPECT_EQ(server->Wait(&output), 3) << output;
  EXPECT_THAT(output, HasSubstr("health NOT_SERVING, exiting with status 3"));
}

// With no delay the failed server exits 3 on its own.
TEST(EmulatedServerTest, DeviceFaultExits3OnItsOwn) {
  auto server = StartBinary(EmuBinary(), Args("cuda", {"--device_failure_exit_delay_seconds", "0"}),
                            {{"RELGEN_SIMT_FAULT_AT_LAUNCH", "1"}});
  auto stub = Stub(*server);
  EXPECT_EQ(Stream(*stub, TokenRequest({1, 2, 3}, 4)).status.error_code(), grpc::StatusCode::UNAVAILABLE);
  std::string output;
  EXPECT_EQ(server->Wait(&output), 3) << output;
}

}  // namespace
}  // namespace relgen
