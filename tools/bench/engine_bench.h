// relgen-bench engine: prefill and decode throughput of the CPU (or CUDA) backend against a peer on
// the same weights: CTranslate2 (tools/bench/ct2_peer.py) or the PyTorch reference (tools/torch_bench.py),
// in interleaved repetitions, with the machine's ceilings and each result as a fraction of its
// roofline.
#pragma once

#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"

namespace relgen::bench {

struct EngineBenchOptions {
  std::string model;
  std::vector<int> batches = {1, 16};
  std::vector<int> contexts = {512};
  int steps = 16;
  int threads = 0;  // 0: all hardware threads
  std::string peer = "ct2";  // ct2, torch or none
  std::string peer_python;   // empty: build-hf-venv's python for ct2, /usr/bin/python3 for torch
  std::string peer_compute_type = "float32";  // ct2: float32, int8, int8_float32, bfloat16
  int reps = 3;
  std::string json_out;
  cpu::WeightType weights = cpu::WeightType::kF32;  // relgen's dense weights
  cpu::KvType kv_type = cpu::KvType::kF32;          // relgen's K/V cache
  bool bf16_activations = false;  // CPU: projections' inputs rounded to bf16 (--activations_dtype bf16)
  // A `relgen-bench machine --json` file: the roofline's bounds, measured apart from this run.
  // Empty: this run's own probes (then the roofline is not independent of the run).
  std::string machine;
  // cpu (the CPU backend, threads as above) or cuda / cuda:N (through NewBackend; the peer must be
  // torch, run on the same GPU, or none). The GPU's roofline takes its bandwidth from
  // `device_gbps` (the card's nominal HBM figure, e.g. 3350 for an H100 SXM): 0 leaves it out.
  std::string device = "cpu";
  double device_gbps = 0;
  std::string cuda_gemm = "invariant";  // the CUDA projections: invariant or cublas
  std::string cuda_attention = "simt";  // the CUDA attention: simt or mma
  int cuda_split_keys = 128;             // keys per attention block on CUDA
  // Times the whole batch's prefill in one call (which fills every cache); false skips it and decodes
  // over the pool as it is (a large model's batched prefill on a slow path outlasts its decode).
  bool batch_prefill = true;
};

int RunEngineBench(const EngineBenchOptions& options);

}  // namespace relgen::bench
