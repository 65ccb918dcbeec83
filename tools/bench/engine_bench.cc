#include "tools/bench/engine_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include "engine/backends/cpu_backend.h"
#include "engine/backends/device.h"
#include "engine/model/model.h"
#include "kernels/cpu/gemm.h"
#include "kernels/thread_pool.h"
#include "nlohmann/json.hpp"
#include "tools/bench/machine_bench.h"

#ifndef RELGEN_SOURCE_DIR
#define RELGEN_SOURCE_DIR "."
#endif

namespace relgen::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Read bandwidth: sum a 1 GiB buffer on every thread (decode streams weights and KV: reads).
double ReadBandwidth(cpu::ThreadPool& pool) {
  const size_t n = size_t{1} << 28;  // floats, on the weights' kind of pages
  std::unique_ptr<float, decltype(&std::free)> buffer(reinterpret_cast<float*>(cpu::AllocateWeights(n * sizeof(float))),
                                                      &std::free);
  float* const a = buffer.get();
  std::fill(a, a + n, 1.0f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> part(pool.num_threads());
    const auto t = Clock::now();
    pool.ParallelFor(pool.num_threads(), [&](int b, int e) {
      for (int w = b; w < e; ++w) {
        float acc[16] = {};
        const size_t lo = n * w / pool.num_threads(), hi = n * (w + 1) / pool.num_threads();
        for (size_t i = lo; i + 16 <= hi; i += 16) {
          for (int l = 0; l < 16; ++l) acc[l] += a[i + l];
        }
        for (float x : acc) part[w] += x;
      }
    });
    best = std::max(best, n * sizeof(float) / Since(t));
    if (part[0] < 0) std::printf("-");  // keep the sum alive
  }
  return best;
}

double CopyBandwidth() {
  const size_t n = size_t{1} << 28;
  std::vector<char> a(n, 1), b(n, 0);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    best = std::max(best, 2.0 * n / Since(t));  // bytes read + written
  }
  return best;
}

double GemmFlops(cpu::ThreadPool& pool) {
  const int m = 256, k = 2048, n = 2048;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> w(size_t(n) * k), x(size_t(m) * k), y(size_t(m) * n);
  for (float& v : w) v = nd(rng);
  for (float& v : x) v = nd(rng);
  const cpu::PackedMatrix packed(w.data(), n, k);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t = Clock::now();
    cpu::LinearPacked(x.data(), m, packed, nullptr, y.data(), &pool);
    best = std::max(best, 2.0 * m * n * k / Since(t));
  }
  return best;
}

struct Result {
  bool ok = false;
  double prefill_tps = 0, batch_prefill_tps = 0, decode_tps = 0;
  std::string device;  // the backend's device, as it names itself
};

// KV blocks per sequence of a cell: an encoder-decoder's context is its input, held as cross K/V
// beside the decoder's own short context.
struct CellBlocks {
  int cross = 0, total = 0;
};
CellBlocks BlocksOf(const ModelConfig& c, int context, int steps, int bs) {
  CellBlocks b;
  b.cross = c.encoder_decoder ? BlocksForTokens(context, bs) : 0;
  b.total = BlocksForTokens((c.encoder_decoder ? 1 : context) + steps + 1, bs) + b.cross;
  return b;
}
constexpr int kBlockSize = 16;

// One backend for every cell of a run, sized for its largest: the weights are uploaded (a GPU's
// rounded to bf16) once, not once per cell.
std::unique_ptr<Backend> MakeBackend(const std::shared_ptr<const Model>& model, const EngineBenchOptions& o,
                                     int threads) {
  const ModelConfig& c = model->config();
  int max_batch = 1, max_context = 1;
  int64_t blocks = 0;
  for (int batch : o.batches) max_batch = std::max(max_batch, batch);
  for (int context : o.contexts) {
    max_context = std::max(max_context, context);
    for (int batch : o.batches) {
      blocks = std::max<int64_t>(blocks, int64_t{batch} * BlocksOf(c, context, o.steps, kBlockSize).total);
    }
  }
  if (o.device == "cpu") {
    auto made = NewCpuBackend(model, KvCacheConfig{kBlockSize, static_cast<int>(blocks)}, threads, o.weights, o.kv_type,
                              o.bf16_activations ? ProjectionInputs::kBf16Dot : ProjectionInputs::kF32);
    if (!made.ok()) {
      std::fprintf(stderr, "relgen-bench: %s\n", std::string(made.status().message()).c_str());
      return nullptr;
    }
    return *std::move(made);
  }
  // The device's step buffers are sized at start for the largest step: here the largest batch's
  // whole prefill.
  DeviceOptions d;
  d.device = o.device;
  // At least one whole sequence, as the device's pool must hold.
  d.kv_cache_tokens = std::max<int64_t>(blocks * kBlockSize, int64_t{c.encoder_decoder ? 2 : 1} *
                                                                 BlocksForTokens(c.max_seq_len, kBlockSize) * kBlockSize);
  d.kv_block_size = kBlockSize;
  d.weights_dtype = cpu::WeightTypeName(o.weights);
  d.kv_cache_dtype = cpu::KvTypeName(o.kv_type);
  d.cuda_gemm = o.cuda_gemm;
  d.cuda_attention = o.cuda_attention;
  d.cuda_split_keys = o.cuda_split_keys;
  // The largest prefill, or a decode step of the largest batch where that has more rows.
  d.max_step_tokens = std::max(max_batch, (o.batch_prefill ? max_batch : 1) * (c.encoder_decoder ? 1 : max_context));
  d.max_step_seqs = max_batch;
  if (c.encoder_decoder) {
    d.max_step_encoder_tokens = std::max(d.max_step_encoder_tokens, (o.batch_prefill ? max_batch : 1) * max_context);
  }
  auto made = NewBackend(model, d);
  if (!made.ok()) {
    std::fprintf(stderr, "relgen-bench: %s\n", std::string(made.status().message()).c_str());
    return nullptr;
  }
  return *std::move(made);
}

// Encoder-decoder models: `context` is the encoder's input; the decoder starts from its start token
// and decodes `steps` tokens against it (its own context is short), as a translation does. Every
// step goes through Launch and Collect with a greedy draw per sequence, as the engine runs it: on a
// GPU the rows are answered on the device and only the drawn tokens come back, and (an asynchronous
// backend) each decode step is launched before the previous one is collected, its tokens fed from
// that one's answers on the device.
Result RunRelgen(Backend& backend, const Model& model, int batch, int context, int steps, bool batch_prefill) {
  const int bs = kBlockSize;
  const bool enc_dec = model.config().encoder_decoder;
  const CellBlocks blocks = BlocksOf(model.config(), context, steps, bs);
  const int per_seq = blocks.total, cross_per_seq = blocks.cross;
  Result r;
  r.device = backend.Describe().device;
  std::vector<std::vector<int32_t>> tables(batch), cross(batch);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < per_seq - cross_per_seq; ++i) tables[b].push_back(b * per_seq + i);
    for (int i = per_seq - cross_per_seq; i < per_seq; ++i) cross[b].push_back(b * per_seq + i);
  }
  std::mt19937 rng(0);
  std::vector<int32_t> prompt(context);
  for (int32_t& t : prompt) t = rng() % 256;
  const std::vector<int32_t> start{model.config().decoder_start_token_id};
  // A decoder's prompt, or an encoder-decoder's input (encoded) and the decoder's start token.
  auto first = [&](int b) {
    SequenceStep s{enc_dec ? absl::MakeConstSpan(start) : absl::MakeConstSpan(prompt), 0, tables[b], false};
    if (enc_dec) {
      s.encoder_tokens = prompt;
      s.encoder_len = context;
      s.cross_block_table = cross[b];
    }
    return s;
  };
  SamplingParams greedy;
  greedy.temperature = 0;
  // A greedy draw from each step's last row of every sequence.
  auto queries = [&](int n, int index) {
    std::vector<RowQuery> q(n);
    for (int b = 0; b < n; ++b) {
      q[b].row = b;
      q[b].params = &greedy;
      q[b].index = index;
    }
    return q;
  };
  std::vector<SampleResult> answers;
  auto run = [&](absl::Span<const SequenceStep> st, int index) {
    return backend.Launch(st, queries(static_cast<int>(st.size()), index)).ok() && backend.Collect(&answers).ok();
  };
  {  // one sequence alone (after a warm-up, as the peer), then all of them in one call (which fills every cache)
    SequenceStep s = first(0);
    if (!run({&s, 1}, 0)) return r;
    auto t = Clock::now();
    if (!run({&s, 1}, 0)) return r;
    r.prefill_tps = context / Since(t);
    // Without it, the other sequences' caches stay as the pool holds them: a decode step reads them
    // as it reads filled ones, and its time does not depend on their values.
    if (batch_prefill) {
      std::vector<SequenceStep> all;
      for (int b = 0; b < batch; ++b) all.push_back(first(b));
      t = Clock::now();
      if (!run(all, 0)) return r;
      r.batch_prefill_tps = double(batch) * context / Since(t);
    }
  }
  std::vector<int32_t> tokens(batch, 65);
  const int pos0 = enc_dec ? 1 : context;
  // Decode step `s` (its token at pos0 + s): fed from the previous launch's draws when `fed`.
  auto launch = [&](int s, bool fed) {
    std::vector<SequenceStep> st;
    for (int b = 0; b < batch; ++b) {
      st.push_back({absl::MakeConstSpan(&tokens[b], 1), pos0 + s, tables[b], false});
      if (fed) st.back().fed_query = b;
      if (enc_dec) {
        st.back().encoder_len = context;
        st.back().cross_block_table = cross[b];
      }
    }
    return backend.Launch(st, queries(batch, s + 1)).ok();
  };
  auto collect = [&] {
    if (!backend.Collect(&answers).ok() || static_cast<int>(answers.size()) != batch) return false;
    for (int b = 0; b < batch; ++b) tokens[b] = std::max(answers[b].token, 0);
    return true;
  };
  if (!launch(0, false) || !collect()) return r;  // warm-up (a GPU captures the batch's graph)
  const bool overlap = backend.asynchronous();
  const auto t = Clock::now();
  if (overlap) {
    // As the engine overlaps steps: N + 1 is launched before N lands.
    if (!launch(1, false)) return r;
    for (int s = 2; s <= steps; ++s) {
      if (!launch(s, true) || !collect()) return r;
    }
    if (!collect()) return r;
  } else {
    for (int s = 1; s <= steps; ++s) {
      if (!launch(s, false) || !collect()) return r;
    }
  }
  r.decode_tps = double(batch) * steps / Since(t);
  r.ok = true;
  return r;
}

std::string PeerCommand(const EngineBenchOptions& o, int batch, int context, int threads) {
  const std::string shape = " --batch " + std::to_string(batch) + " --context " + std::to_string(context) +
                            " --steps " + std::to_string(o.steps) + " --threads " + std::to_string(threads);
  if (o.peer == "torch") {
    const std::string py = o.peer_python.empty() ? "/usr/bin/python3" : o.peer_python;
    return "'" + py + "' '" RELGEN_SOURCE_DIR "/tools/torch_bench.py' --model '" + o.model + "'" + shape +
           (o.device == "cpu" ? "" : " --device '" + o.device + "'");
  }
  const std::string py = o.peer_python.empty() ? RELGEN_SOURCE_DIR "/build-hf-venv/bin/python" : o.peer_python;
  return "'" + py + "' '" RELGEN_SOURCE_DIR "/tools/bench/ct2_peer.py' bench --model '" + o.model + "'" + shape +
         " --compute_type " + o.peer_compute_type;
}

json RunPeer(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return nullptr;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  if (pclose(p) != 0) return nullptr;
  json j = json::parse(out, nullptr, false);
  return j.is_discarded() ? json(nullptr) : j;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// "median [min-max]" of a series; ratios are taken per repetition, then summarised.
std::string Summary(const std::vector<double>& v, const char* fmt) {
  if (v.empty()) return "-";
  char b[96];
  const std::string f = std::string(fmt) + " [" + fmt + "-" + fmt + "]";
  std::snprintf(b, sizeof(b), f.c_str(), Median(v), *std::min_element(v.begin(), v.end()),
                *std::max_element(v.begin(), v.end()));
  return b;
}

json Series(const std::vector<double>& v) {
  if (v.empty()) return nullptr;
  return {{"median", Median(v)}, {"min", *std::min_element(v.begin(), v.end())},
          {"max", *std::max_element(v.begin(), v.end())}, {"samples", v}};
}

}  // namespace

int RunEngineBench(const EngineBenchOptions& o) {
  auto model = Model::Load(o.model);
  if (!model.ok()) {
    std::fprintf(stderr, "relgen-bench: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const ModelConfig& cfg = (*model)->config();
  for (int context : o.contexts) {
    // An encoder-decoder's context is its input; the decoder's own length is the steps.
    if (cfg.encoder_decoder ? std::max(context, o.steps + 2) > cfg.max_seq_len : context + o.steps + 1 > cfg.max_seq_len) {
      std::fprintf(stderr, "relgen-bench: context %d + %d steps exceeds the model's max_seq_len %d\n", context,
                   o.steps + 1, cfg.max_seq_len);
      return 2;
    }
  }
  const bool gpu = o.device != "cpu";
  if (gpu && o.peer == "ct2") {
    std::fprintf(stderr, "relgen-bench: --device %s compares with --peer torch (on the same GPU) or none\n",
                 o.device.c_str());
    return 2;
  }
  if (gpu && !o.machine.empty()) {
    std::fprintf(stderr, "relgen-bench: --machine holds this CPU's ceilings; with --device %s give --device_GBps\n",
                 o.device.c_str());
    return 2;
  }
  MachineFigures machine;
  if (!o.machine.empty() && !LoadMachineFigures(o.machine, &machine)) return 2;
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double read_bw = 0, copy_bw = 0, gemm_flops = 0;
  if (gpu) {
    // Decode on a GPU is bound by its memory: the floor is the step's bytes at the card's nominal
    // bandwidth (a figure this run does not produce); FLOPs are not bounded here.
    read_bw = o.device_gbps * 1e9;
    if (read_bw > 0) {
      std::printf("device %s; roofline from --device_GBps %.0f (nominal memory bandwidth)\n", o.device.c_str(),
                  o.device_gbps);
    } else {
      std::printf("device %s; no roofline (give --device_GBps, the card's nominal memory bandwidth)\n",
                  o.device.c_str());
    }
  } else {
    cpu::ThreadPool pool(threads);
    std::printf("measuring the machine's ceilings (%d threads)...\n", threads);
    read_bw = ReadBandwidth(pool);
    copy_bw = CopyBandwidth();
    gemm_flops = GemmFlops(pool);
    std::printf("read bandwidth %.1f GB/s, copy bandwidth %.1f GB/s, GEMM %.1f GFLOP/s (relgen packed, 256x2048x2048)\n",
                read_bw / 1e9, copy_bw / 1e9, gemm_flops / 1e9);
  }
  if (!o.machine.empty()) {
    if (machine.threads != threads) {
      std::printf("note: %s was measured with %d threads, this run uses %d\n", o.machine.c_str(), machine.threads,
                  threads);
    }
    std::printf("roofline bounds from %s (measured apart): read bandwidth by working set, FMA peak %.1f GFLOP/s\n",
                o.machine.c_str(), machine.peak_flops / 1e9);
  } else if (!gpu) {
    std::printf("roofline bounds from this run's own probes above (pass --machine FILE for independent ones)\n");
  }
  std::printf("\n");
  const double flops = machine.peak_flops > 0 ? machine.peak_flops : gemm_flops;
  auto bandwidth_for = [&](double bytes) { return machine.read.empty() ? read_bw : ReadBandwidthFor(machine, bytes); };

  // Work per decode token: every weight is read once per step (shared by the batch); each sequence
  // reads its own K/V; the dense FLOPs scale with the batch.
  const int64_t dense_params = (*model)->num_parameters() - int64_t{cfg.vocab_size} * cfg.d_model * (cfg.tie_embeddings ? 0 : 1);
  // Nearly every parameter sits in a dense layer or the LM head, stored as --weights_dtype.
  // A decode step reads neither an untied input embedding (a row per token) nor an encoder's layers.
  const int64_t encoder_params = int64_t{cfg.n_encoder_layers} * (4 * int64_t{cfg.d_model} * cfg.qkv_width() +
                                                                 (cfg.ffn_gated ? 3 : 2) * int64_t{cfg.d_model} * cfg.ffn_dim);
  const int64_t step_params = dense_params - (cfg.encoder_decoder ? encoder_params : 0);
  const double weight_bytes = double(step_params) * cpu::WeightTypeBytes(o.weights);
  std::printf("model %s: %s, d_model %d, %d layers, %d heads, ffn %d, %.1fM parameters (%s weights, %.0f MB read a step; %s K/V)\n",
              cfg.name.c_str(), std::string(SchemeName(cfg.rel.scheme)).c_str(), cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.ffn_dim,
              (*model)->num_parameters() / 1e6, cpu::WeightTypeName(o.weights), weight_bytes / 1e6, cpu::KvTypeName(o.kv_type));
  const bool peer = o.peer != "none";
  const std::string peer_name = o.peer == "torch" ? (gpu ? "torch on " + o.device : "torch") : "ct2 " + o.peer_compute_type;
  if (peer) std::printf("peer: %s\n", PeerCommand(o, 1, o.contexts[0], threads).c_str());
  struct Cell {
    int batch, context;
    std::vector<double> pre, bpre, dec, peer_pre, peer_bpre, peer_dec, r_pre, r_bpre, r_dec;
  };
  std::vector<Cell> cells;
  for (int context : o.contexts) {
    for (int batch : o.batches) cells.push_back({batch, context});
  }
  const auto made_at = Clock::now();
  std::unique_ptr<Backend> backend = MakeBackend(*model, o, threads);
  if (backend == nullptr) return 1;
  const BackendInfo info = backend->Describe();
  std::printf("backend: %s, %s weights (%s), %s K/V, made in %.1f s%s\n", info.device.c_str(),
              info.weights_dtype.c_str(), info.projections.c_str(), info.kv_cache_dtype.c_str(),
              Since(made_at), gpu ? (", " + std::to_string(o.cuda_split_keys) + " keys per attention split").c_str() : "");
  // Repetitions interleave relgen and the peer cell by cell, so drift in the machine's load hits both.
  for (int rep = 0; rep < o.reps; ++rep) {
    std::printf("repetition %d of %d\n", rep + 1, o.reps);
    std::fflush(stdout);
    for (Cell& c : cells) {
      const Result r = RunRelgen(*backend, **model, c.batch, c.context, o.steps, o.batch_prefill);
      if (!r.ok) {
        std::fprintf(stderr, "relgen-bench: the backend failed at batch %d, context %d\n", c.batch, c.context);
        return 1;
      }
      c.pre.push_back(r.prefill_tps);
      if (o.batch_prefill) c.bpre.push_back(r.batch_prefill_tps);
      c.dec.push_back(r.decode_tps);
      if (!peer) continue;
      const json t = RunPeer(PeerCommand(o, c.batch, c.context, threads));
      if (!t.is_object()) {
        std::fprintf(stderr, "relgen-bench: the peer failed (batch %d, context %d): %s\n", c.batch, c.context,
                     PeerCommand(o, c.batch, c.context, threads).c_str());
        return 1;
      }
      const double tp = t["prefill_tokens_per_s"].get<double>(), td = t["decode_tokens_per_s"].get<double>();
      const double tb = t.value("batch_prefill_tokens_per_s", 0.0);
      c.peer_pre.push_back(tp);
      c.peer_dec.push_back(td);
      c.r_pre.push_back(r.prefill_tps / tp);
      c.r_dec.push_back(r.decode_tps / td);
      if (tb > 0) {
        c.peer_bpre.push_back(tb);
        c.r_bpre.push_back(r.batch_prefill_tps / tb);
      }
    }
  }
  if (peer) {
    std::printf("\ntokens/s and relgen / %s, median [min-max] over %d interleaved repetitions\n", peer_name.c_str(),
                o.reps);
  } else {
    std::printf("\ntokens/s, median [min-max] over %d repetitions (no peer)\n", o.reps);
  }
  std::printf("%5s %7s | %-34s | %-34s | %-34s | %9s\n", "batch", "context", "prefill 1 seq: relgen, ratio",
              "prefill whole batch: relgen, ratio", "decode: relgen, ratio", "roofline");
  json rows = json::array();
  for (const Cell& c : cells) {
    const double decode_tps = Median(c.dec);
    const double kv_bytes = double(c.batch) * c.context * cfg.n_layers * 2.0 * cfg.qkv_width() * cpu::KvTypeBytes(o.kv_type);
    const double step_flops = 2.0 * c.batch * step_params + 4.0 * c.batch * c.context * cfg.n_layers * cfg.qkv_width();
    const double bw = bandwidth_for(weight_bytes + kv_bytes);
    const double roof_s = gpu ? (weight_bytes + kv_bytes) / bw : std::max((weight_bytes + kv_bytes) / bw, step_flops / flops);
    const double fraction = bw > 0 ? roof_s / (c.batch / decode_tps) : 0;
    auto cell = [&](const std::vector<double>& mine, const std::vector<double>& ratio) {
      return Summary(mine, "%.0f") + (ratio.empty() ? std::string() : ", " + Summary(ratio, "%.2fx"));
    };
    std::printf("%5d %7d | %-34s | %-34s | %-34s | %8.0f%%\n", c.batch, c.context, cell(c.pre, c.r_pre).c_str(),
                cell(c.bpre, c.r_bpre).c_str(), cell(c.dec, c.r_dec).c_str(), 100 * fraction);
    rows.push_back({{"batch", c.batch}, {"context", c.context}, {"relgen_prefill_tps", Series(c.pre)},
                    {"relgen_batch_prefill_tps", Series(c.bpre)}, {"relgen_decode_tps", Series(c.dec)},
                    {"peer_prefill_tps", Series(c.peer_pre)}, {"peer_batch_prefill_tps", Series(c.peer_bpre)},
                    {"peer_decode_tps", Series(c.peer_dec)}, {"prefill_ratio", Series(c.r_pre)},
                    {"batch_prefill_ratio", Series(c.r_bpre)}, {"decode_ratio", Series(c.r_dec)},
                    {"decode_roofline_fraction", fraction},
                    {"roofline_bandwidth_Bps", bw},
                    {"roofline_bound", gpu || (weight_bytes + kv_bytes) / bw >= step_flops / flops ? "memory" : "compute"}});
  }
  if (!o.json_out.empty()) {
    std::ofstream(o.json_out) << json({{"read_bandwidth_Bps", read_bw}, {"copy_bandwidth_Bps", copy_bw},
                                       {"gemm_flops", gemm_flops}, {"roofline_flops", flops},
                                       {"roofline_source", gpu ? "--device_GBps" : o.machine.empty() ? "own probes" : o.machine},
                                       {"device", o.device}, {"cuda_gemm", gpu ? json(o.cuda_gemm) : json(nullptr)},
                                       {"cuda_attention", gpu ? json(o.cuda_attention) : json(nullptr)},
                                       {"cuda_split_keys", gpu ? json(o.cuda_split_keys) : json(nullptr)},
                                       {"threads", threads}, {"peer", peer ? peer_name : "none"},
                                       {"weights_dtype", cpu::WeightTypeName(o.weights)},
                                       {"activations_dtype", o.bf16_activations ? "bf16" : "f32"},
                                       {"kv_cache_dtype", cpu::KvTypeName(o.kv_type)},
                                       {"repetitions", o.reps}, {"results", rows}}).dump(2);
  }
  if (gpu) {
    std::printf("\nroofline: decode step time if bound only by reading weights + this batch's K/V once at\n"
                "--device_GBps, shown as a fraction of the measured step time.\n");
  } else {
    std::printf("\nroofline: decode step time if bound only by reading weights + this batch's K/V at the read\n"
                "bandwidth (with --machine: of the smallest measured working set that holds them), or by the\n"
                "dense FLOPs at the arithmetic ceiling (--machine: the FMA peak; else relgen's GEMM), whichever\n"
                "is larger; shown as a fraction of the measured step time.\n");
  }
  return 0;
}

}  // namespace relgen::bench
