// relgen-bench: engine micro-benchmarks (and, later, the serving load generator).
//   relgen-bench memory [--lengths 512,1024,2048] [--d_model 512] [--heads 8]
//   relgen-bench batching --model DIR [--sequences 16] [--prompt 16] [--new 128] [--threads 0]
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tools/bench/batching_bench.h"
#include "tools/bench/memory_bench.h"

namespace {

int Usage() {
  std::fprintf(stderr,
               "usage: relgen-bench memory [--lengths 512,1024,2048] [--d_model 512] [--heads 8]\n"
               "       relgen-bench batching --model DIR [--sequences 16] [--prompt 16] [--new 128] [--threads 0]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string cmd = argv[1];
  if (cmd == "batching") {
    std::string model;
    int sequences = 16, prompt = 16, fresh = 128, threads = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
      const std::string flag = argv[i], value = argv[i + 1];
      int* target = flag == "--sequences" ? &sequences : flag == "--prompt" ? &prompt : flag == "--new" ? &fresh
                  : flag == "--threads" ? &threads : nullptr;
      if (flag == "--model") {
        model = value;
      } else if (target == nullptr || !absl::SimpleAtoi(value, target) || *target < 0) {
        return Usage();
      }
    }
    if (model.empty() || sequences < 1 || prompt < 1 || fresh < 1) return Usage();
    return relgen::bench::RunBatchingBench(model, sequences, prompt, fresh, threads);
  }
  if (cmd != "memory") return Usage();
  std::vector<int> lengths = {512, 1024, 2048};
  int d_model = 512, heads = 8;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--lengths") {
      lengths.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        int v;
        if (!absl::SimpleAtoi(part, &v) || v < 1) return Usage();
        lengths.push_back(v);
      }
    } else if (flag == "--d_model") {
      if (!absl::SimpleAtoi(value, &d_model) || d_model < 1) return Usage();
    } else if (flag == "--heads") {
      if (!absl::SimpleAtoi(value, &heads) || heads < 1 || d_model % heads) return Usage();
    } else {
      return Usage();
    }
  }
  return relgen::bench::RunMemoryBench(lengths, d_model, heads);
}
