// relgen-bench memory: peak extra memory of the skew prefill vs a naive Shaw R tensor.
#pragma once

#include <vector>

namespace relgen::bench {

int RunMemoryBench(const std::vector<int>& lengths, int d_model, int n_heads);

}  // namespace relgen::bench
