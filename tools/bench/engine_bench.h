// relgen-bench engine: prefill and decode throughput of the CPU backend against the PyTorch
// reference (tools/torch_bench.py) on the same weights, with the machine's ceilings and each
// result as a fraction of its roofline.
#pragma once

#include <string>
#include <vector>

namespace relgen::bench {

struct EngineBenchOptions {
  std::string model;
  std::vector<int> batches = {1, 16};
  std::vector<int> contexts = {512};
  int steps = 16;
  int threads = 0;  // 0: all hardware threads
  bool torch = true;
  std::string json_out;
};

int RunEngineBench(const EngineBenchOptions& options);

}  // namespace relgen::bench
