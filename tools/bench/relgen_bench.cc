// relgen-bench: engine micro-benchmarks (and, later, the serving load generator).
//   relgen-bench memory [--lengths 512,1024,2048] [--d_model 512] [--heads 8]
//   relgen-bench batching --model DIR [--sequences 16] [--prompt 16] [--new 128] [--threads 0] [--sequential 1] [--beams 1]
//   relgen-bench engine --model DIR ...   (relgen vs CTranslate2 or the PyTorch reference, with rooflines;
//                                          --device cuda: the CUDA backend vs PyTorch on the same GPU)
//   relgen-bench serve [--server HOST:PORT] ...   (load generator: JSON and PNG results)
//   relgen-bench accuracy --model DIR ...   (bf16 / int8 weights against f32)
//   relgen-bench machine [--json FILE]   (bandwidth by working set, FMA peak and the GEMM's share of it, for --machine)
//   relgen-bench sample [--vocab 250880] [--rows 16] [--threads 0] [--reps 21]   (the host sampler per control)
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tools/bench/accuracy_bench.h"
#include "tools/bench/batching_bench.h"
#include "tools/bench/engine_bench.h"
#include "tools/bench/machine_bench.h"
#include "tools/bench/sample_bench.h"
#include "tools/bench/serve_bench.h"
#include "tools/bench/memory_bench.h"

namespace {

// To stderr with status 64 after a usage error; to stdout with status 0 when help was asked for.
int Usage(bool asked = false) {
  std::fprintf(asked ? stdout : stderr,
               "usage: relgen-bench memory [--lengths 512,1024,2048] [--d_model 512] [--heads 8]\n"
               "       relgen-bench batching --model DIR [--sequences 16] [--prompt 16] [--new 128] [--threads 0]\n"
               "                             [--sequential 1]   (0: the concurrent run only)\n"
               "       relgen-bench engine --model DIR [--batches 1,16] [--contexts 512] [--steps 16] [--threads 0]\n"
               "                           [--reps 3] [--peer ct2|torch|none] [--peer_python PATH]\n"
               "                           [--peer_compute_type float32|int8|int8_float32|bfloat16] [--json FILE]\n"
               "                           [--weights_dtype f32|bf16|int8] [--kv_cache_dtype f32|bf16] [--machine FILE]\n"
               "                           [--activations_dtype f32|bf16]   (cpu)\n"
               "                           [--device cpu|cuda[:N] [--device_GBps 3350] [--cuda_gemm invariant|cublas|mma] [--cuda_attention simt|mma]\n"
               "                           [--cuda_split_keys 128]]   (cuda: --peer torch|none) [--batch_prefill 1|0]\n"
               "       relgen-bench machine [--threads 0] [--reps 7] [--json FILE]   (bounds for --machine)\n"
               "       relgen-bench sample [--vocab 250880] [--rows 16] [--threads 0] [--reps 21]   (host sampler per control)\n"
               "       relgen-bench serve [--server HOST:PORT] [--api grpc|http] [--rates 1,2,4 | --concurrency 8]\n"
               "                          [--num_requests 100]   (--api http: --server is the HTTP API's address)\n"
               "                          [--prompt_len 64] [--output_len 64] [--spread 0.5] [--prompts_file FILE]\n"
               "                          [--slo_ttft 1.0] [--slo_tpot 0.1] [--timeout 300] [--seed 1]\n"
               "                          [--shared_prefix_len 0]   (tokens every synthetic prompt starts with)\n"
               "                          [--temperature 0.8] [--top_p 1] [--top_k 0]   (each request's sampling)\n"
               "                          [--json FILE] [--png FILE]\n"
               "                          [--metrics HOST:PORT]   (the server's --metrics_listen: host time per step)\n"
               "       relgen-bench accuracy --model DIR [--weights_dtype f32,bf16,mma,bf16-dot,int8] [--kv_cache_dtype f32,bf16]\n"
               "                             [--fortunes DIR] [--window 256]\n"
               "                             [--max_windows 0] [--greedy_tokens 1000] [--threads 0] [--json FILE]\n");
  return asked ? 0 : 64;
}

bool Ints(const std::string& v, std::vector<int>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(v, ',')) {
    int x;
    if (!absl::SimpleAtoi(part, &x) || x < 1) return false;
    out->push_back(x);
  }
  return !out->empty();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string cmd = argv[1];
  // Help as the command, or in a flag's place: every flag but --no_torch takes the next word as its
  // value, as the parse below reads them.
  if (cmd == "--help" || cmd == "-h" || cmd == "help") return Usage(true);
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help") return Usage(true);
    if (f != "--no_torch") ++i;
  }
  std::vector<std::pair<std::string, std::string>> flags;
  for (int i = 2; i < argc; ++i) {
    std::string f = argv[i];
    if (f.rfind("--", 0) != 0) return Usage();
    if (f == "--no_torch") {
      flags.push_back({f, ""});
    } else if (i + 1 < argc) {
      flags.push_back({f, argv[++i]});
    } else {
      return Usage();
    }
  }
  if (cmd == "memory") {
    std::vector<int> lengths = {512, 1024, 2048};
    int d_model = 512, heads = 8;
    for (auto& [f, v] : flags) {
      if (f == "--lengths" ? !Ints(v, &lengths)
          : f == "--d_model" ? !absl::SimpleAtoi(v, &d_model)
          : f == "--heads" ? !absl::SimpleAtoi(v, &heads) : true) {
        return Usage();
      }
    }
    if (d_model < 1 || heads < 1 || d_model % heads) return Usage();
    return relgen::bench::RunMemoryBench(lengths, d_model, heads);
  }
  if (cmd == "batching") {
    std::string model;
    int sequences = 16, prompt = 16, fresh = 128, threads = 0, sequential = 1, beams = 1;
    for (auto& [f, v] : flags) {
      int* target = f == "--sequences" ? &sequences : f == "--prompt" ? &prompt : f == "--new" ? &fresh
                  : f == "--threads" ? &threads : f == "--sequential" ? &sequential : f == "--beams" ? &beams : nullptr;
      if (f == "--model") {
        model = v;
      } else if (target == nullptr || !absl::SimpleAtoi(v, target) || *target < 0) {
        return Usage();
      }
    }
    if (model.empty() || sequences < 1 || prompt < 1 || fresh < 1 || beams < 1) return Usage();
    return relgen::bench::RunBatchingBench(model, sequences, prompt, fresh, threads, sequential != 0, beams);
  }
  if (cmd == "engine") {
    relgen::bench::EngineBenchOptions o;
    for (auto& [f, v] : flags) {
      bool ok = true;
      if (f == "--model") o.model = v;
      else if (f == "--batches") ok = Ints(v, &o.batches);
      else if (f == "--contexts") ok = Ints(v, &o.contexts);
      else if (f == "--steps") ok = absl::SimpleAtoi(v, &o.steps) && o.steps > 0;
      else if (f == "--threads") ok = absl::SimpleAtoi(v, &o.threads) && o.threads >= 0;
      else if (f == "--no_torch") o.peer = "none";
      else if (f == "--peer") ok = (o.peer = v) == "ct2" || v == "torch" || v == "none";
      else if (f == "--peer_python") o.peer_python = v;
      else if (f == "--peer_compute_type")
        ok = (o.peer_compute_type = v) == "float32" || v == "int8" || v == "int8_float32" || v == "bfloat16";
      else if (f == "--reps") ok = absl::SimpleAtoi(v, &o.reps) && o.reps > 0;
      else if (f == "--json") o.json_out = v;
      else if (f == "--weights_dtype") ok = relgen::cpu::ParseWeightType(v, &o.weights);
      else if (f == "--kv_cache_dtype") ok = relgen::cpu::ParseKvType(v, &o.kv_type);
      else if (f == "--activations_dtype") ok = (o.bf16_activations = v == "bf16") || v == "f32";
      else if (f == "--machine") o.machine = v;
      else if (f == "--device") ok = (o.device = v) == "cpu" || v == "cuda" || v.rfind("cuda:", 0) == 0;
      else if (f == "--device_GBps") ok = absl::SimpleAtod(v, &o.device_gbps) && o.device_gbps > 0;
      else if (f == "--cuda_gemm") ok = (o.cuda_gemm = v) == "invariant" || v == "cublas" || v == "mma";
      else if (f == "--cuda_attention") ok = (o.cuda_attention = v) == "simt" || v == "mma";
      else if (f == "--cuda_split_keys") ok = absl::SimpleAtoi(v, &o.cuda_split_keys) && o.cuda_split_keys > 0;
      else if (f == "--batch_prefill") ok = (v == "0" || v == "1") && (o.batch_prefill = v == "1", true);
      else ok = false;
      if (!ok) return Usage();
    }
    if (o.model.empty()) return Usage();
    return relgen::bench::RunEngineBench(o);
  }
  if (cmd == "machine") {
    relgen::bench::MachineOptions o;
    for (auto& [f, v] : flags) {
      bool ok = true;
      if (f == "--threads") ok = absl::SimpleAtoi(v, &o.threads) && o.threads >= 0;
      else if (f == "--reps") ok = absl::SimpleAtoi(v, &o.reps) && o.reps > 0;
      else if (f == "--json") o.json_out = v;
      else ok = false;
      if (!ok) return Usage();
    }
    return relgen::bench::RunMachineBench(o);
  }
  if (cmd == "accuracy") {
    relgen::bench::AccuracyOptions o;
    for (auto& [f, v] : flags) {
      bool ok = true;
      if (f == "--model") o.model = v;
      else if (f == "--weights_dtype") {
        o.weights.clear();
        for (absl::string_view part : absl::StrSplit(v, ',')) {
          relgen::bench::AccuracyWeights t;
          ok = ok && relgen::bench::ParseAccuracyWeights(std::string(part), &t);
          o.weights.push_back(t);
        }
      } else if (f == "--kv_cache_dtype") {
        o.kv_types.clear();
        for (absl::string_view part : absl::StrSplit(v, ',')) {
          relgen::cpu::KvType t;
          ok = ok && relgen::cpu::ParseKvType(std::string(part), &t);
          o.kv_types.push_back(t);
        }
      } else if (f == "--fortunes") o.fortunes = v;
      else if (f == "--window") ok = absl::SimpleAtoi(v, &o.window) && o.window > 0;
      else if (f == "--max_windows") ok = absl::SimpleAtoi(v, &o.max_windows) && o.max_windows >= 0;
      else if (f == "--greedy_tokens") ok = absl::SimpleAtoi(v, &o.greedy_tokens) && o.greedy_tokens > 0;
      else if (f == "--threads") ok = absl::SimpleAtoi(v, &o.threads) && o.threads >= 0;
      else if (f == "--json") o.json_out = v;
      else ok = false;
      if (!ok) return Usage();
    }
    if (o.model.empty()) return Usage();
    return relgen::bench::RunAccuracyBench(o);
  }
  if (cmd == "sample") {
    relgen::bench::SampleBenchOptions o;
    for (auto& [f, v] : flags) {
      const bool ok = f == "--vocab"     ? absl::SimpleAtoi(v, &o.vocab) && o.vocab > 0
                      : f == "--rows"    ? absl::SimpleAtoi(v, &o.rows) && o.rows > 0
                      : f == "--threads" ? absl::SimpleAtoi(v, &o.threads) && o.threads >= 0
                      : f == "--reps"    ? absl::SimpleAtoi(v, &o.reps) && o.reps > 0
                                         : false;
      if (!ok) return Usage();
    }
    return relgen::bench::RunSampleBench(o);
  }
  if (cmd == "serve") {
    relgen::bench::ServeOptions o;
    for (auto& [f, v] : flags) {
      bool ok = true;
      if (f == "--server") o.server = v;
      else if (f == "--api") ok = (o.api = v) == "grpc" || v == "http";
      else if (f == "--rates") {
        o.rates.clear();
        for (absl::string_view part : absl::StrSplit(v, ',')) {
          double r;
          ok = ok && absl::SimpleAtod(part, &r) && r > 0;
          o.rates.push_back(r);
        }
      } else if (f == "--concurrency") ok = absl::SimpleAtoi(v, &o.concurrency) && o.concurrency > 0;
      else if (f == "--num_requests") ok = absl::SimpleAtoi(v, &o.num_requests) && o.num_requests > 0;
      else if (f == "--prompt_len") ok = absl::SimpleAtoi(v, &o.prompt_len) && o.prompt_len > 0;
      else if (f == "--output_len") ok = absl::SimpleAtoi(v, &o.output_len) && o.output_len > 0;
      else if (f == "--spread") ok = absl::SimpleAtod(v, &o.spread) && o.spread >= 0 && o.spread < 1;
      else if (f == "--prompts_file") o.prompts_file = v;
      else if (f == "--shared_prefix_len") ok = absl::SimpleAtoi(v, &o.shared_prefix_len) && o.shared_prefix_len >= 0;
      else if (f == "--temperature") ok = absl::SimpleAtof(v, &o.temperature) && o.temperature >= 0;
      else if (f == "--top_p") ok = absl::SimpleAtof(v, &o.top_p) && o.top_p > 0 && o.top_p <= 1;
      else if (f == "--top_k") ok = absl::SimpleAtoi(v, &o.top_k) && o.top_k >= 0;
      else if (f == "--slo_ttft") ok = absl::SimpleAtod(v, &o.slo_ttft);
      else if (f == "--slo_tpot") ok = absl::SimpleAtod(v, &o.slo_tpot);
      else if (f == "--timeout") ok = absl::SimpleAtod(v, &o.timeout) && o.timeout > 0;
      else if (f == "--seed") ok = absl::SimpleAtoi(v, &o.seed);
      else if (f == "--json") o.json_out = v;
      else if (f == "--png") o.png_out = v;
      else if (f == "--metrics") ok = !(o.metrics = v).empty();
      else ok = false;
      if (!ok) return Usage();
    }
    return relgen::bench::RunServeBench(o);
  }
  return Usage();
}
