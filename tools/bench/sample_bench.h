// relgen-bench sample: the host sampler answering a decode step's rows (AnswerQueries), per
// sampling control, on the CPU backend's thread pool.
#pragma once

namespace relgen::bench {

struct SampleBenchOptions {
  int vocab = 250880;  // bloom-560m's
  int rows = 16;
  int threads = 0;  // 0: every hardware thread, as the CPU backend
  int reps = 21;
};

int RunSampleBench(const SampleBenchOptions& options);

}  // namespace relgen::bench
