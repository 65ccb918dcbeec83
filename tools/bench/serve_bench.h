// relgen-bench serve: a load generator against a running relgen-server.
#pragma once

#include <string>
#include <vector>

namespace relgen::bench {

struct ServeOptions {
  std::string server = "localhost:50051";
  std::string api = "grpc";   // grpc: GenerateStream; http: POST /v1/completions with stream (the OpenAI API)
  std::vector<double> rates;  // requests/s, open loop (Poisson arrivals); empty: closed loop
  int concurrency = 8;        // closed loop
  int num_requests = 100;     // per rate
  int prompt_len = 64;        // tokens, uniform in [len*(1-spread), len*(1+spread)]
  int output_len = 64;
  double spread = 0.5;
  std::string prompts_file;   // one text prompt per line instead of synthetic prompts
  float temperature = 0.8f;   // 0: greedy
  float top_p = 1.0f;
  int top_k = 0;
  int shared_prefix_len = 0;  // synthetic prompts: the same first tokens (a system prompt), then prompt_len random ones
  double slo_ttft = 1.0;      // seconds, for goodput
  double slo_tpot = 0.1;
  double timeout = 300;
  uint64_t seed = 1;
  std::string json_out, png_out;
  // The server's --metrics_listen address: its engine-step histograms are read before and after
  // each load, for the host's time per step (empty: not read).
  std::string metrics;
};

int RunServeBench(const ServeOptions& options);

}  // namespace relgen::bench
