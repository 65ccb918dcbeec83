// relgen-client: its flags against the proto, and the binary against a live server.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "client/request_flags.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

namespace relgen {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Every GenerateRequest field has exactly one flag, and each flag sets exactly its field.
TEST(ClientFlagsTest, OneFlagPerRequestField) {
  const auto* desc = v1::GenerateRequest::descriptor();
  std::set<std::string> fields, flagged;
  for (int i = 0; i < desc->field_count(); ++i) fields.insert(desc->field(i)->name());
  for (const auto& f : client::RequestFlags()) {
    EXPECT_TRUE(fields.contains(f.field)) << f.flag << " names no field " << f.field;
    EXPECT_TRUE(flagged.insert(f.field).second) << "two flags for " << f.field;
  }
  EXPECT_EQ(flagged, fields);

  const std::map<std::string, std::string> sample = {
      {"--request_id", "abc"}, {"--prompt", "hello"}, {"--token_ids", "1,2,3"}, {"--max_new_tokens", "7"},
      {"--temperature", "0.5"}, {"--top_k", "9"}, {"--top_p", "0.75"}, {"--repetition_penalty", "1.25"},
      {"--seed", "42"}, {"--stop", "END"}, {"--stop_token_id", "13"}, {"--logprobs", "2"}, {"--ignore_eos", ""},
      {"--n", "3"}, {"--prompt_logprobs", "2"}, {"--presence_penalty", "0.5"}, {"--frequency_penalty", "-0.5"},
      {"--logit_bias", "7:-2.5"}, {"--allowed_token_ids", "1,2"}, {"--bad_words", "3,4"}, {"--min_tokens", "2"},
      {"--min_p", "0.1"}, {"--truncate_prompt_tokens", "5"},
      {"--skip_special_tokens", "false"}, {"--no_repeat_ngram_size", "3"}, {"--num_beams", "4"},
      {"--length_penalty", "0.5"}, {"--early_stopping", "never"}, {"--num_return_sequences", "2"},
      {"--adapter", "sql"}};
  for (const auto& f : client::RequestFlags()) {
    client::ClientOptions o;
    std::vector<std::string> args = {"generate", f.flag};
    if (!sample.at(f.flag).empty()) args.push_back(sample.at(f.flag));
    ASSERT_EQ(client::ParseArgs(args, &o), "") << f.flag;
    std::vector<const google::protobuf::FieldDescriptor*> set;
    o.request.GetReflection()->ListFields(o.request, &set);
    ASSERT_EQ(set.size(), 1u) << f.flag;
    EXPECT_EQ(set[0]->name(), f.field) << f.flag;
  }
  client::ClientOptions o;
  ASSERT_EQ(client::ParseArgs({"generate", "--stop", "a", "--stop=b", "--stop_token_id", "3", "--stop_token_id", "4",
                               "--token_ids", "5,6", "--seed", "18446744073709551615", "--temperature=0"},
                              &o),
            "");
  EXPECT_THAT(o.request.stop(), ::testing::ElementsAre("a", "b"));
  EXPECT_THAT(o.request.stop_token_ids(), ::testing::ElementsAre(3, 4));
  EXPECT_THAT(o.request.token_ids().ids(), ::testing::ElementsAre(5, 6));
  EXPECT_EQ(o.request.seed(), 18446744073709551615ull);
  EXPECT_TRUE(o.request.has_temperature());
  EXPECT_EQ(o.request.temperature(), 0.0f);
  EXPECT_FALSE(o.request.has_top_p()) << "unset flags leave fields unset (server defaults apply)";
  client::ClientOptions c;
  ASSERT_EQ(client::ParseArgs({"generate", "--logit_bias", "7:-2.5", "--logit_bias=9:1", "--bad_words", "3,4",
                               "--bad_words", "5", "--allowed_token_ids", "1,2"},
                              &c),
            "");
  EXPECT_EQ(c.request.logit_bias().size(), 2u);
  EXPECT_EQ(c.request.logit_bias().at(7), -2.5f);
  EXPECT_EQ(c.request.logit_bias().at(9), 1.0f);
  ASSERT_EQ(c.request.bad_words_size(), 2);
  EXPECT_THAT(c.request.bad_words(0).ids(), ::testing::ElementsAre(3, 4));
  EXPECT_THAT(c.request.bad_words(1).ids(), ::testing::ElementsAre(5));
  EXPECT_THAT(c.request.allowed_token_ids(), ::testing::ElementsAre(1, 2));
  EXPECT_NE(client::ParseArgs({"generate", "--logit_bias", "7"}, &c), "");
}

// Every ScoreRequest field has a flag of the score command, and each flag sets its field.
TEST(ClientFlagsTest, ScoreFlagsCoverTheScoreRequest) {
  const auto* desc = v1::ScoreRequest::descriptor();
  std::set<std::string> fields, flagged;
  for (int i = 0; i < desc->field_count(); ++i) fields.insert(desc->field(i)->name());
  for (const auto& f : client::ScoreFlags()) {
    EXPECT_TRUE(fields.contains(f.field)) << f.flag << " names no field " << f.field;
    flagged.insert(f.field);
  }
  EXPECT_EQ(flagged, fields);
  const std::map<std::string, std::string> sample = {
      {"--request_id", "abc"}, {"--context", "hello"}, {"--context_token_ids", "1,2"}, {"--continuation", "x"},
      {"--continuation_token_ids", "3,4"}, {"--top_logprobs", "2"}, {"--adapter", "sql"}};
  for (const auto& f : client::ScoreFlags()) {
    client::ClientOptions o;
    std::vector<std::string> args = {"score", f.flag, sample.at(f.flag)};
    if (std::string(f.field) != "continuations") args.insert(args.end(), {"--continuation", "y"});
    ASSERT_EQ(client::ParseArgs(args, &o), "") << f.flag;
    std::vector<const google::protobuf::FieldDescriptor*> set;
    o.score.GetReflection()->ListFields(o.score, &set);
    std::set<std::string> names;
    for (const auto* fd : set) names.insert(fd->name());
    EXPECT_TRUE(names.contains(f.field)) << f.flag;
    EXPECT_LE(names.size(), 2u) << f.flag;
  }
  client::ClientOptions o;
  ASSERT_EQ(client::ParseArgs({"score", "--continuation", "a", "--continuation_token_ids=5,6", "--continuation=b",
                               "--top_logprobs", "3", "the", "context"},
                              &o),
            "");
  EXPECT_EQ(o.score.text(), "the context");
  ASSERT_EQ(o.score.continuations_size(), 3);
  EXPECT_EQ(o.score.continuations(0).text(), "a");
  EXPECT_THAT(o.score.continuations(1).token_ids().ids(), ::testing::ElementsAre(5, 6));
  EXPECT_EQ(o.score.continuations(2).text(), "b");
  EXPECT_EQ(o.score.top_logprobs(), 3);
  EXPECT_FALSE(o.request.has_text()) << "score fills the ScoreRequest only";
}

// --help answers wherever a flag may stand; "help" is a command only in the command's place, and a
// "--help" that is another flag's value stays that value.
TEST(ClientFlagsTest, Help) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--help"}, {"-h"}, {"help"}, {"generate", "--help"}, {"score", "--top_logprobs", "2", "--help"},
           {"generate", "--seed", "3", "--help"}}) {
    client::ClientOptions o;
    EXPECT_EQ(client::ParseArgs(args, &o), "") << args.back();
    EXPECT_TRUE(o.help) << args.back();
  }
  client::ClientOptions words;
  ASSERT_EQ(client::ParseArgs({"generate", "help", "me"}, &words), "");
  EXPECT_FALSE(words.help);
  EXPECT_EQ(words.request.text(), "help me");
  client::ClientOptions value;
  ASSERT_EQ(client::ParseArgs({"generate", "--stop", "--help", "x"}, &value), "");
  EXPECT_FALSE(value.help);
  EXPECT_THAT(value.request.stop(), ::testing::ElementsAre("--help"));
  EXPECT_THAT(client::Usage(), HasSubstr("--max_new_tokens"));
}

TEST(ClientFlagsTest, UsageErrors) {
  client::ClientOptions o;
  EXPECT_THAT(client::ParseArgs({}, &o), HasSubstr("a command is required"));
  EXPECT_THAT(client::ParseArgs({"make"}, &o), HasSubstr("unknown command 'make'"));
  EXPECT_THAT(client::ParseArgs({"generate", "--top_k", "x"}, &o), HasSubstr("--top_k x: expected an integer"));
  EXPECT_THAT(client::ParseArgs({"generate", "--nope", "1"}, &o), HasSubstr("unknown flag --nope"));
  EXPECT_THAT(client::ParseArgs({"generate", "--prompt", "a", "b"}, &o), HasSubstr("give the prompt once"));
  EXPECT_THAT(client::ParseArgs({"generate", "--seed"}, &o), HasSubstr("--seed needs a value"));
  EXPECT_THAT(client::ParseArgs({"score", "--context", "a"}, &o), HasSubstr("score needs at least one --continuation"));
  EXPECT_THAT(client::ParseArgs({"score", "--continuation", "a", "--temperature", "0"}, &o),
              HasSubstr("unknown flag --temperature for score"));
  EXPECT_THAT(client::ParseArgs({"score", "--continuation", "a", "--stream"}, &o),
              HasSubstr("--stream does not apply to score"));
  EXPECT_THAT(client::ParseArgs({"score", "--continuation_token_ids", "1,x"}, &o),
              HasSubstr("--continuation_token_ids 1,x: expected comma-separated integers"));
  EXPECT_THAT(client::ParseArgs({"generate", "--n", "two"}, &o), HasSubstr("--n two: expected an integer"));
}

struct ClientRun {
  int exit_code = -1;
  std::string out, err;
  double first_output_s = -1, total_s = 0;
  int stdout_reads = 0;
};

// Runs relgen-client with `args`, feeding `input` on stdin, timing when stdout first has data;
// `on_first_output` runs when it does.
ClientRun RunClient(const std::vector<std::string>& args, const std::string& input = "",
                    const std::function<void()>& on_first_output = nullptr) {
  int in[2], out[2], err[2];
  EXPECT_EQ(pipe(in), 0);
  EXPECT_EQ(pipe(out), 0);
  EXPECT_EQ(pipe(err), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    close(in[1]);
    close(out[0]);
    close(err[0]);
    std::vector<std::string> all = {std::getenv("RELGEN_CLIENT_BIN")};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  close(err[1]);
  if (!input.empty()) EXPECT_EQ(write(in[1], input.data(), input.size()), static_cast<ssize_t>(input.size()));
  close(in[1]);
  ClientRun r;
  std::thread errs([&] {
    char buf[4096];
    ssize_t n;
    while ((n = read(err[0], buf, sizeof(buf))) > 0) r.err.append(buf, n);
  });
  char buf[4096];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof(buf))) > 0) {
    if (r.first_output_s < 0) {
      r.first_output_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (on_first_output) on_first_output();
    }
    ++r.stdout_reads;
    r.out.append(buf, n);
  }
  errs.join();
  int status = 0;
  waitpid(pid, &status, 0);
  r.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  close(out[0]);
  close(err[0]);
  return r;
}

class ClientBinaryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new testing::ServerProcess();
    std::string error;
    ASSERT_TRUE(server_->Start({"--model", testing::GoldenDir() + "/engine/server", "--kv_cache_tokens", "8192",
                                "--enable_test_hooks"}, &error))
        << error;
  }
  static void TearDownTestSuite() { delete server_; }
  static testing::ServerProcess* server_;
};
testing::ServerProcess* ClientBinaryTest::server_ = nullptr;

TEST_F(ClientBinaryTest, StreamingPrintsIncrementally) {
  // When the first text reaches the client's stdout, the request is still running: the engine is
  // held there and the server's books looked at.
  std::map<std::string, double> at_first_output;
  const ClientRun r = RunClient({"generate", "--server", server_->address(), "--stream", "--max_new_tokens", "1800",
                                 "--temperature", "0", "--ignore_eos", "--prompt", "Once"},
                                "", [&] {
                                  EXPECT_TRUE(testing::PauseEngine(server_->metrics_port()));
                                  at_first_output = testing::ParseMetrics(testing::Scrape(server_->metrics_port()));
                                  EXPECT_TRUE(testing::ResumeEngine(server_->metrics_port()));
                                });
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(at_first_output["relgen_num_requests_running"], 1) << "the first text came only at the end";
  EXPECT_THAT(r.err, HasSubstr("[length: 5 prompt + 1800 generated tokens"));
  // The same request, unary: the same text.
  const ClientRun u = RunClient({"generate", "--server", server_->address(), "--max_new_tokens", "1800", "--temperature",
                                 "0", "--ignore_eos", "--prompt", "Once"});
  ASSERT_EQ(u.exit_code, 0);
  EXPECT_EQ(u.out, r.out);
}

// health in its three states: SERVING, NOT_SERVING (draining) and the server unreachable.
TEST(ClientHealthTest, ServingDrainingAndUnreachable) {
  testing::ServerProcess server;
  std::string error;
  ASSERT_TRUE(server.Start({"--model", testing::GoldenDir() + "/engine/server", "--kv_cache_tokens", "8192",
                            "--enable_test_hooks", "--drain_grace_seconds", "3600"}, &error))
      << error;
  ClientRun r = RunClient({"health", "--server", server.address(), "--timeout", "30"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  // Draining: a request held in flight keeps the server draining until it is let go.
  ASSERT_TRUE(testing::PauseEngine(server.metrics_port()));
  auto held = std::async(std::launch::async, [&] {
    return RunClient({"generate", "--server", server.address(), "--max_new_tokens", "4", "--prompt", "x"});
  });
  for (int i = 0; i < 6000; ++i) {
    if (testing::ParseMetrics(testing::Scrape(server.metrics_port()))["relgen_num_requests_waiting"] == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  server.Signal(SIGTERM);
  for (int i = 0; i < 600; ++i) {
    r = RunClient({"health", "--server", server.address(), "--timeout", "30"});
    if (r.out != "SERVING\n") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.out, "NOT_SERVING\n");
  ASSERT_TRUE(testing::ResumeEngine(server.metrics_port()));
  const ClientRun g = held.get();
  EXPECT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(server.Wait(), 0);
  // Unreachable: nothing listens on port 1.
  r = RunClient({"health", "--server", "127.0.0.1:1", "--timeout", "10"});
  EXPECT_EQ(r.exit_code, 14);
  EXPECT_THAT(r.err, HasSubstr("cannot reach relgen-server at 127.0.0.1:1"));
  EXPECT_EQ(r.out, "");
}

TEST_F(ClientBinaryTest, ExitCodesFollowTheStatus) {
  ClientRun r = RunClient({"generate", "--server", server_->address(), "--temperature", "-1", "--prompt", "x"});
  EXPECT_EQ(r.exit_code, 3);  // INVALID_ARGUMENT
  EXPECT_THAT(r.err, HasSubstr("temperature: -1; allowed 0..100"));
  // The engine is held, so the request cannot finish before its deadline.
  ASSERT_TRUE(testing::PauseEngine(server_->metrics_port()));
  r = RunClient({"generate", "--server", server_->address(), "--timeout", "0.2", "--max_new_tokens", "8",
                 "--ignore_eos", "--prompt", "x"});
  ASSERT_TRUE(testing::ResumeEngine(server_->metrics_port()));
  EXPECT_EQ(r.exit_code, 4);  // DEADLINE_EXCEEDED
  r = RunClient({"generate", "--server", "127.0.0.1:1", "--timeout", "3", "--prompt", "x"});
  EXPECT_EQ(r.exit_code, 14);  // UNAVAILABLE
  EXPECT_THAT(r.err, HasSubstr("cannot reach relgen-server at 127.0.0.1:1"));
  r = RunClient({"generate", "--bogus"});
  EXPECT_EQ(r.exit_code, 64);
  EXPECT_THAT(r.err, HasSubstr("usage: relgen-client"));
}

TEST_F(ClientBinaryTest, PromptFromStdinJsonAndInfo) {
  const ClientRun r = RunClient({"generate", "--server", server_->address(), "--json", "--max_new_tokens", "5",
                           "--temperature", "0", "--ignore_eos"},
                          "from stdin");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"prompt_tokens\":11"));  // BOS + 10 bytes
  EXPECT_THAT(r.out, HasSubstr("\"generated_tokens\":5"));
  const ClientRun info = RunClient({"info", "--server", server_->address()});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_THAT(info.out, HasSubstr("model engine-server: skew relative attention, 4 layers, d_model 256"));
}

// score prints each continuation's tokens and sum; --json the ScoreResponse. generate --n prints
// every sample, sample i being what --seed s + i alone gives.
TEST_F(ClientBinaryTest, ScoreAndSamples) {
  ClientRun r = RunClient({"score", "--server", server_->address(), "--context", "Once upon", "--continuation", " a time",
                           "--continuation", "!", "--top_logprobs", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("continuation 0 ' a time': sum -"));
  EXPECT_THAT(r.out, HasSubstr("over 7 tokens"));
  EXPECT_THAT(r.out, HasSubstr("continuation 1 '!': sum -"));
  EXPECT_THAT(r.out, HasSubstr("  token 6: id 101"));  // 'e'
  const ClientRun j = RunClient({"score", "--server", server_->address(), "--json", "--continuation", " a time",
                                 "--continuation", "!"},
                                "Once upon");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const nlohmann::json score = nlohmann::json::parse(j.out);
  ASSERT_EQ(score["scores"].size(), 2u);
  double sum = 0;
  for (const auto& t : score["scores"][0]["logprobs"]) sum += t["logprob"].get<double>();
  EXPECT_NEAR(score["scores"][0]["sum_logprob"].get<double>(), sum, 1e-6);
  EXPECT_EQ(score["usage"]["prompt_tokens"], 10);  // BOS + "Once upon"
  EXPECT_EQ(score["usage"]["continuation_tokens"], 8);
  r = RunClient({"score", "--server", server_->address(), "--context", "x", "--continuation", ""});
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.err, HasSubstr("continuations: continuations[0] is empty"));

  const std::vector<std::string> gen = {"generate", "--server", server_->address(), "--json", "--max_new_tokens", "12",
                                        "--ignore_eos", "--temperature", "1", "--prompt", "Once"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = gen;
    args.insert(args.end(), extra.begin(), extra.end());
    const ClientRun run = RunClient(args);
    EXPECT_EQ(run.exit_code, 0) << run.err;
    return nlohmann::json::parse(run.out);
  };
  const nlohmann::json samples = with({"--n", "3", "--seed", "11"});
  ASSERT_EQ(samples["samples"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const nlohmann::json alone = with({"--seed", std::to_string(11 + i)});
    EXPECT_EQ(samples["samples"][i]["token_ids"], alone["token_ids"]) << "sample " << i;
  }
  r = RunClient({"generate", "--server", server_->address(), "--max_new_tokens", "4", "--n", "2", "--prompt", "x"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("--- sample 0 ("));
  EXPECT_THAT(r.out, HasSubstr("--- sample 1 ("));
  r = RunClient({"generate", "--server", server_->address(), "--max_new_tokens", "4", "--n", "2", "--stream",
                 "--prompt_logprobs", "1", "--prompt", "xyz"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("prompt log-probabilities"));
  EXPECT_THAT(r.out, HasSubstr("  prompt 3: id 122"));  // 'z', after BOS x y
  EXPECT_THAT(r.err, HasSubstr("[sample 1 "));
  r = RunClient({"generate", "--server", server_->address(), "--n", "0", "--prompt", "x"});
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.err, HasSubstr("n: 0 samples; allowed 1..16"));
}

// relgen-bench serve against the live server: open loop at two rates, then closed loop.
TEST_F(ClientBinaryTest, ServeBenchWritesJsonAndPng) {
  const std::string dir = testing::TempDir("servebench");
  auto bench = [&](std::vector<std::string> args) {
    std::vector<std::string> all = {"serve", "--server", server_->address(), "--num_requests", "12", "--prompt_len", "16",
                                    "--output_len", "8", "--json", dir + "/r.json", "--png", dir + "/r.png"};
    all.insert(all.end(), args.begin(), args.end());
    setenv("RELGEN_CLIENT_BIN", std::getenv("RELGEN_BENCH_BIN"), 1);
    const ClientRun r = RunClient(all);
    setenv("RELGEN_CLIENT_BIN", std::getenv("RELGEN_CLIENT_BIN_SAVED"), 1);
    return r;
  };
  setenv("RELGEN_CLIENT_BIN_SAVED", std::getenv("RELGEN_CLIENT_BIN"), 1);
  ClientRun r = bench({"--rates", "20,40"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = testing::ReadJson(dir + "/r.json");
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& row : j["results"]) {
    EXPECT_EQ(row["completed"], 12);
    EXPECT_EQ(row["failed"], 0);
    for (const char* k : {"ttft_s", "tpot_s", "itl_s", "e2e_s"}) {
      EXPECT_GT(row[k]["p50"].get<double>(), 0) << k;
      EXPECT_LE(row[k]["p50"].get<double>(), row[k]["p99"].get<double>()) << k;
    }
    EXPECT_GT(row["output_token_throughput"].get<double>(), 0);
    EXPECT_LE(row["goodput"].get<double>(), row["request_throughput"].get<double>() + 1e-9);
  }
  const std::string png = testing::ReadFile(dir + "/r.png");
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_THAT(r.out, Not(HasSubstr("host per step:"))) << "no metrics address, no host times";
  EXPECT_FALSE(j["results"][0].contains("host_per_step"));
  // With the server's metrics address: the engine's steps over the load, from its histograms.
  r = bench({"--concurrency", "4", "--metrics", "127.0.0.1:" + std::to_string(server_->metrics_port())});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json c = testing::ReadJson(dir + "/r.json");
  EXPECT_EQ(c["results"][0]["concurrency"], 4);
  const std::regex line(
      R"((^|\n)host per step: plan\+build [0-9.]+ ms, wait [0-9.]+ ms, land [0-9.]+ ms, step [0-9.]+ ms; host share [0-9.]+% \([0-9]+ steps\)\n)");
  EXPECT_TRUE(std::regex_search(r.out, line)) << r.out;
  ASSERT_TRUE(c["results"][0].contains("host_per_step")) << c.dump(2);
  const auto& host = c["results"][0]["host_per_step"];
  // 12 requests of at least 4 tokens: at least 4 steps, each timed before the last one's end.
  EXPECT_GE(host["steps"].get<double>(), 3);
  for (const char* k : {"plan_ms", "wait_ms", "land_ms", "step_ms"}) EXPECT_GE(host[k].get<double>(), 0) << k;
  EXPECT_NEAR(host["plan_ms"].get<double>() + host["wait_ms"].get<double>() + host["land_ms"].get<double>(),
              host["step_ms"].get<double>(), 1e-6 * host["step_ms"].get<double>() + 1e-9);
  EXPECT_GE(host["host_share"].get<double>(), 0);
  EXPECT_LE(host["host_share"].get<double>(), 1);
  // A metrics address that answers nothing is refused before any load.
  r = bench({"--concurrency", "4", "--metrics", "127.0.0.1:1"});
  EXPECT_EQ(r.exit_code, 14);
  EXPECT_THAT(r.err, HasSubstr("cannot read the engine-step histograms at 127.0.0.1:1"));

  // The same load through the OpenAI-compatible HTTP API: every request is a streamed completion,
  // booked with api="http".
  const double before =
      testing::ParseMetrics(testing::Scrape(server_->metrics_port()))["relgen_requests_received_total{api=\"http\"}"];
  r = bench({"--api", "http", "--server", "127.0.0.1:" + std::to_string(server_->http_port()), "--concurrency", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json h = testing::ReadJson(dir + "/r.json");
  EXPECT_EQ(h["api"], "http");
  const auto& row = h["results"][0];
  EXPECT_EQ(row["completed"], 12);
  EXPECT_GT(row["output_token_throughput"].get<double>(), 0);
  for (const char* k : {"ttft_s", "tpot_s", "e2e_s"}) EXPECT_GT(row[k]["p50"].get<double>(), 0) << k;
  auto m = testing::ParseMetrics(testing::Scrape(server_->metrics_port()));
  EXPECT_EQ(m["relgen_requests_received_total{api=\"http\"}"] - before, 12);
  EXPECT_EQ(m["relgen_requests_rejected_total{api=\"http\"}"], 0);
}

}  // namespace
}  // namespace relgen
