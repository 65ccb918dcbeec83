// relgen-bench batching: decode throughput of N concurrent sequences vs the same work one at a time.
#pragma once

#include <string>

namespace relgen::bench {

// `sequential` false: only the concurrent run (no one-at-a-time baseline, no speedup line).
// `beams` > 1: each sequence is a beam search of that many beams returning its best (tokens counted:
// the returned sequences').
int RunBatchingBench(const std::string& model_dir, int sequences, int prompt_len, int new_tokens, int threads,
                     bool sequential = true, int beams = 1);

}  // namespace relgen::bench
