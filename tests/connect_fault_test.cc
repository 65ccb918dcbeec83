// What made the soak fail on a loaded machine: one failed connection attempt of the test's own gRPC
// client. Debian 12's gRPC (1.51) reads errno after calls that may overwrite connect's EINPROGRESS,
// so a connect to a healthy server can fail with a stale errno ("ipv4:127.0.0.1:PORT: No such file
// or directory", without the "Failed to connect to remote host" of a refused connect). A channel in
// that state fails every fail-fast call at once until it reconnects, which let four soak threads
// burn through the remaining requests in a fraction of a second. Runs with tests/faults/
// connect_fault.c preloaded, which makes the next N connects fail that way.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "tests/grpc_test_util.h"
#include "tests/server_process.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;

void FailConnects(int n) {
  auto arm = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "relgen_fail_connects"));
  ASSERT_NE(arm, nullptr) << "run with LD_PRELOAD=libconnect_fault.so";
  arm(n);
}

std::unique_ptr<v1::GenerationService::Stub> NewConnection(const std::string& address, int tag) {
  grpc::ChannelArguments args;
  args.SetInt("relgen.test.connection", tag);  // distinct arguments: a connection of its own
  return v1::GenerationService::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

class ConnectFaultTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = StartServer({"--model", ModelDir("server"), "--kv_cache_tokens", "8192"}).release();
  }
  static void TearDownTestSuite() { delete server_; }
  static testing::ServerProcess* server_;
};
testing::ServerProcess* ConnectFaultTest::server_ = nullptr;

// The old soak's calls (fail-fast): the server is healthy, yet the calls on that connection fail.
TEST_F(ConnectFaultTest, FailFastCallsFailOnOneBadConnectAttempt) {
  auto stub = NewConnection(server_->address(), 1);
  FailConnects(1);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  const grpc::Status s = stub->Generate(&ctx, TokenRequest({1, 2, 3}, 4), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr(server_->address() + ": No such file or directory"));
  // Right after, the channel is in backoff: the next fail-fast call fails too, without a new attempt.
  grpc::ClientContext again;
  EXPECT_EQ(stub->Generate(&again, TokenRequest({1, 2, 3}, 4), &resp).error_code(), grpc::StatusCode::UNAVAILABLE);
}

// The soak's calls now wait for the connection (wait_for_ready, bounded by a deadline): the channel
// attempts again and the same fault costs a reconnect, not the calls.
TEST_F(ConnectFaultTest, WaitForReadyCallsRideOutABadConnectAttempt) {
  auto stub = NewConnection(server_->address(), 2);
  FailConnects(1);
  for (int i = 0; i < 4; ++i) {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    v1::GenerateResponse resp;
    const grpc::Status s = stub->Generate(&ctx, TokenRequest({1, 2, 3}, 4), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.token_ids_size(), 4);
  }
}

}  // namespace
}  // namespace relgen
