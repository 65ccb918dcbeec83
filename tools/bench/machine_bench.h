// relgen-bench machine: this machine's ceilings measured apart from any engine run, repeated, for
// the engine bench's roofline (--machine FILE): read bandwidth by working-set size (so a step whose
// bytes fit a cache level is bounded by that level) and the FMA peak of registers-only chains.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace relgen::bench {

struct MachineOptions {
  int threads = 0;  // 0: every hardware thread
  int reps = 7;
  std::string json_out;
};

int RunMachineBench(const MachineOptions& options);

struct MachineFigures {
  std::vector<std::pair<double, double>> read;  // (working-set bytes, median read bytes/s), ascending
  double peak_flops = 0;                        // median
  int threads = 0;
};

// Reads a `relgen-bench machine --json` file; false (and a message on stderr) when it cannot.
bool LoadMachineFigures(const std::string& path, MachineFigures* out);

// The median read bandwidth of the smallest measured working set that holds `bytes`.
double ReadBandwidthFor(const MachineFigures& m, double bytes);

}  // namespace relgen::bench
