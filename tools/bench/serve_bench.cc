#include "tools/bench/serve_bench.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include "nlohmann/json.hpp"
#include "relgen/v1/generation.grpc.pb.h"

#ifndef RELGEN_SOURCE_DIR
#define RELGEN_SOURCE_DIR "."
#endif

namespace relgen::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct Sample {
  bool ok = false;
  std::string error;
  int prompt_tokens = 0, output_tokens = 0;
  double send = 0, ttft = 0, e2e = 0, tpot = 0;
  std::vector<double> itl;
};

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p * (v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

json Summary(const std::vector<double>& v) {
  double mean = 0;
  for (double x : v) mean += x;
  return {{"mean", v.empty() ? 0 : mean / v.size()},
          {"p50", Percentile(v, 0.5)}, {"p90", Percentile(v, 0.9)}, {"p99", Percentile(v, 0.99)}};
}

class Runner {
 public:
  Runner(const ServeOptions& o, std::shared_ptr<grpc::Channel> channel) : o_(o), stub_(v1::GenerationService::NewStub(channel)) {
    if (!o.prompts_file.empty()) {
      std::ifstream in(o.prompts_file);
      for (std::string line; std::getline(in, line);) {
        if (!line.empty()) prompts_.push_back(line);
      }
    }
  }
  bool has_prompts() const { return o_.prompts_file.empty() || !prompts_.empty(); }

  v1::GenerateRequest Make(std::mt19937_64& rng) const {
    v1::GenerateRequest r;
    auto length = [&](int mean) {
      const int lo = std::max(1, static_cast<int>(mean * (1 - o_.spread)));
      const int hi = std::max(lo, static_cast<int>(mean * (1 + o_.spread)));
      return std::uniform_int_distribution<int>(lo, hi)(rng);
    };
    if (!prompts_.empty()) {
      r.set_text(prompts_[rng() % prompts_.size()]);
    } else {
      std::mt19937_64 shared(o_.seed ^ 0x5eed);  // the same prefix in every request of the run
      for (int i = 0; i < o_.shared_prefix_len; ++i) {
        r.mutable_token_ids()->add_ids(static_cast<int32_t>(32 + shared() % 95));
      }
      const int n = length(o_.prompt_len);
      for (int i = 0; i < n; ++i) r.mutable_token_ids()->add_ids(static_cast<int32_t>(32 + rng() % 95));
    }
    r.set_max_new_tokens(length(o_.output_len));
    r.set_ignore_eos(true);
    r.set_temperature(o_.temperature);
    if (o_.top_p < 1.0f) r.set_top_p(o_.top_p);
    if (o_.top_k > 0) r.set_top_k(o_.top_k);
    r.set_seed(rng());
    return r;
  }

  Sample Call(const v1::GenerateRequest& req, Clock::time_point origin) const {
    return o_.api == "http" ? CallHttp(req, origin) : CallGrpc(req, origin);
  }

  // The served model's name, for the HTTP API's requests.
  void set_model(std::string model) { model_ = std::move(model); }

  // The same request as a streamed completion. A chunk carries text, not token ids: each chunk
  // counts as one token for the inter-token latencies, and the tokens are counted from the usage
  // chunk at the end.
  Sample CallHttp(const v1::GenerateRequest& req, Clock::time_point origin) const {
    Sample s;
    json body = {{"model", model_}, {"max_tokens", req.max_new_tokens()}, {"ignore_eos", true},
                 {"temperature", req.temperature()}, {"seed", req.seed()}, {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    if (req.has_text()) {
      body["prompt"] = req.text();
    } else {
      body["prompt"] = std::vector<int32_t>(req.token_ids().ids().begin(), req.token_ids().ids().end());
    }
    if (req.has_top_p()) body["top_p"] = req.top_p();
    if (req.has_top_k()) body["top_k"] = req.top_k();
    httplib::Client client("http://" + o_.server);
    client.set_read_timeout(static_cast<time_t>(o_.timeout));
    const auto t0 = Clock::now();
    s.send = Seconds(origin, t0);
    Clock::time_point first, prev;
    int chunks = 0;
    std::string pending;
    bool done = false;
    httplib::Request r;
    r.method = "POST";
    r.path = "/v1/completions";
    r.set_header("Content-Type", "application/json");
    r.body = body.dump();
    r.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
      const auto now = Clock::now();
      pending.append(data, len);
      for (size_t end; (end = pending.find("\n\n")) != std::string::npos; pending.erase(0, end + 2)) {
        const std::string event = pending.substr(0, end);
        if (event.rfind("data: ", 0) != 0) continue;
        if (event == "data: [DONE]") {
          done = true;
          continue;
        }
        const json chunk = json::parse(event.substr(6), nullptr, false);
        if (chunk.is_discarded() || chunk.contains("error")) {
          s.error = chunk.is_discarded() ? "a chunk that is not JSON" : chunk["error"]["message"].get<std::string>();
          return false;
        }
        if (chunk.contains("usage") && chunk["usage"].is_object()) {
          s.prompt_tokens = chunk["usage"]["prompt_tokens"].get<int>();
          s.output_tokens = chunk["usage"]["completion_tokens"].get<int>();
        }
        if (chunk["choices"].empty()) continue;
        if (chunks++ == 0) {
          first = now;
          s.ttft = Seconds(t0, now);
        } else {
          s.itl.push_back(Seconds(prev, now));
        }
        prev = now;
      }
      return true;
    };
    const httplib::Result res = client.send(r);
    s.e2e = Seconds(t0, Clock::now());
    s.ok = res && res->status == 200 && done && s.error.empty();
    if (!s.ok && s.error.empty()) {
      s.error = res ? "HTTP " + std::to_string(res->status) + ": " + res->body : httplib::to_string(res.error());
    }
    if (s.output_tokens > 1) s.tpot = Seconds(first, prev) / (s.output_tokens - 1);
    return s;
  }

  Sample CallGrpc(const v1::GenerateRequest& req, Clock::time_point origin) const {
    Sample s;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.timeout * 1000)));
    const auto t0 = Clock::now();
    s.send = Seconds(origin, t0);
    auto reader = stub_->GenerateStream(&ctx, req);
    v1::GenerateStreamResponse m;
    Clock::time_point first, prev;
    while (reader->Read(&m)) {
      const auto now = Clock::now();
      const int n = m.token_ids_size();
      if (n == 0) continue;
      if (s.output_tokens == 0) {
        first = now;
        s.ttft = Seconds(t0, now);
      } else {
        for (int i = 0; i < n; ++i) s.itl.push_back(Seconds(prev, now) / n);
      }
      prev = now;
      s.output_tokens += n;
      if (m.has_usage()) s.prompt_tokens = m.usage().prompt_tokens();
    }
    const grpc::Status st = reader->Finish();
    s.e2e = Seconds(t0, Clock::now());
    s.ok = st.ok();
    if (!st.ok()) s.error = st.error_message();
    if (s.output_tokens > 1) s.tpot = Seconds(first, prev) / (s.output_tokens - 1);
    return s;
  }

 private:
  const ServeOptions& o_;
  std::unique_ptr<v1::GenerationService::Stub> stub_;
  std::vector<std::string> prompts_;
  std::string model_;
};

void Progress(const std::string& label, const std::atomic<int>& done, int total, Clock::time_point start,
              const std::atomic<bool>& stop) {
  const bool tty = isatty(2);
  int last_decile = -1;
  while (!stop.load()) {
    const int d = done.load();
    if (tty) {
      const int width = 30, filled = total > 0 ? d * width / total : width;
      std::fprintf(stderr, "\r%s [%s%s] %d/%d  %.1fs ", label.c_str(), std::string(filled, '#').c_str(),
                   std::string(width - filled, '.').c_str(), d, total, Seconds(start, Clock::now()));
    } else if (d * 10 / std::max(total, 1) != last_decile) {
      last_decile = d * 10 / std::max(total, 1);
      std::fprintf(stderr, "%s %d/%d  %.1fs\n", label.c_str(), d, total, Seconds(start, Clock::now()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (tty) std::fprintf(stderr, "\r%s done: %d/%d in %.1fs%20s\n", label.c_str(), done.load(), total, Seconds(start, Clock::now()), "");
}

// The engine-step histograms' totals from the server's /metrics (docs/metrics.md, "Host time per
// step").
struct StepTotals {
  double plan = 0, wait = 0, land = 0, step = 0, steps = 0;
};

// False when /metrics cannot be read or lacks the histograms (a server older than them).
bool ReadStepTotals(const std::string& address, StepTotals* t) {
  httplib::Client client("http://" + address);
  client.set_connection_timeout(10);
  client.set_read_timeout(30);
  const httplib::Result res = client.Get("/metrics");
  if (!res || res->status != 200) return false;
  const std::pair<const char*, double*> series[] = {{"relgen_engine_step_plan_seconds_sum", &t->plan},
                                                    {"relgen_engine_step_wait_seconds_sum", &t->wait},
                                                    {"relgen_engine_step_land_seconds_sum", &t->land},
                                                    {"relgen_engine_step_seconds_sum", &t->step},
                                                    {"relgen_engine_step_seconds_count", &t->steps}};
  int found = 0;
  std::istringstream in(res->body);
  for (std::string line; std::getline(in, line);) {
    const size_t sp = line.find(' ');
    if (line.empty() || line[0] == '#' || sp == std::string::npos) continue;
    for (const auto& [name, value] : series) {
      if (line.compare(0, sp, name) == 0) {
        *value = std::strtod(line.c_str() + sp + 1, nullptr);
        ++found;
      }
    }
  }
  return found == static_cast<int>(std::size(series));
}

// The means per step over a load from the totals before and after it.
json HostPerStep(const StepTotals& a, const StepTotals& b) {
  const double steps = b.steps - a.steps, step = b.step - a.step, wait = b.wait - a.wait;
  auto per_step_ms = [&](double s) { return steps > 0 ? s / steps * 1e3 : 0.0; };
  return {{"steps", steps},
          {"plan_ms", per_step_ms(b.plan - a.plan)},
          {"wait_ms", per_step_ms(wait)},
          {"land_ms", per_step_ms(b.land - a.land)},
          {"step_ms", per_step_ms(step)},
          {"host_share", step > 0 ? (step - wait) / step : 0.0}};
}

json RunOne(const Runner& runner, const ServeOptions& o, double rate, int concurrency) {
  std::vector<Sample> samples(o.num_requests);
  std::vector<v1::GenerateRequest> reqs;
  std::mt19937_64 rng(o.seed);
  for (int i = 0; i < o.num_requests; ++i) reqs.push_back(runner.Make(rng));
  std::atomic<int> done{0};
  std::atomic<bool> stop{false};
  const auto origin = Clock::now();
  const std::string label = rate > 0 ? "rate " + std::to_string(rate).substr(0, 5) + "/s" : "concurrency " + std::to_string(concurrency);
  std::thread progress([&] { Progress(label, done, o.num_requests, origin, stop); });
  if (rate > 0) {
    // Open loop: Poisson arrivals, each request on its own thread.
    std::exponential_distribution<double> gap(rate);
    std::vector<std::thread> calls;
    double at = 0;
    for (int i = 0; i < o.num_requests; ++i) {
      std::this_thread::sleep_until(origin + std::chrono::microseconds(static_cast<int64_t>(at * 1e6)));
      calls.emplace_back([&, i] {
        samples[i] = runner.Call(reqs[i], origin);
        ++done;
      });
      at += gap(rng);
    }
    for (auto& t : calls) t.join();
  } else {
    std::atomic<int> next{0};
    std::vector<std::thread> workers;
    for (int w = 0; w < concurrency; ++w) {
      workers.emplace_back([&] {
        for (int i; (i = next++) < o.num_requests;) {
          samples[i] = runner.Call(reqs[i], origin);
          ++done;
        }
      });
    }
    for (auto& t : workers) t.join();
  }
  stop = true;
  progress.join();

  std::vector<double> ttft, tpot, itl, e2e;
  int ok = 0, good = 0;
  int64_t out_tokens = 0, in_tokens = 0;
  double end = 0, first_send = 1e30;
  std::string error;
  for (const Sample& s : samples) {
    first_send = std::min(first_send, s.send);
    end = std::max(end, s.send + s.e2e);
    if (!s.ok) {
      if (error.empty()) error = s.error;
      continue;
    }
    ++ok;
    ttft.push_back(s.ttft);
    if (s.output_tokens > 1) tpot.push_back(s.tpot);
    itl.insert(itl.end(), s.itl.begin(), s.itl.end());
    e2e.push_back(s.e2e);
    out_tokens += s.output_tokens;
    in_tokens += s.prompt_tokens;
    if (s.ttft <= o.slo_ttft && s.tpot <= o.slo_tpot) ++good;
  }
  const double duration = std::max(end - first_send, 1e-9);
  json r = {{"rate", rate}, {"concurrency", rate > 0 ? 0 : concurrency}, {"requests", o.num_requests},
            {"completed", ok}, {"failed", o.num_requests - ok}, {"duration_s", duration},
            {"request_throughput", ok / duration}, {"output_token_throughput", out_tokens / duration},
            {"prompt_token_throughput", in_tokens / duration}, {"goodput", good / duration},
            {"ttft_s", Summary(ttft)}, {"tpot_s", Summary(tpot)}, {"itl_s", Summary(itl)}, {"e2e_s", Summary(e2e)}};
  if (!error.empty()) r["first_error"] = error;
  return r;
}

}  // namespace

int RunServeBench(const ServeOptions& o) {
  auto channel = grpc::CreateChannel(o.server, grpc::InsecureChannelCredentials());
  std::string model;
  if (o.api == "http") {
    httplib::Client client("http://" + o.server);
    client.set_connection_timeout(10);
    const httplib::Result res = client.Get("/v1/models");
    const json models = res && res->status == 200 ? json::parse(res->body, nullptr, false) : json();
    if (!models.is_object() || !models.contains("data") || models["data"].empty()) {
      std::fprintf(stderr, "relgen-bench: cannot list the models of the HTTP API at %s\n", o.server.c_str());
      return 14;
    }
    model = models["data"][0]["id"].get<std::string>();
  } else if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    std::fprintf(stderr, "relgen-bench: cannot reach relgen-server at %s\n", o.server.c_str());
    return 14;
  }
  StepTotals totals;
  if (!o.metrics.empty() && !ReadStepTotals(o.metrics, &totals)) {
    std::fprintf(stderr, "relgen-bench: cannot read the engine-step histograms at %s/metrics\n", o.metrics.c_str());
    return 14;
  }
  Runner runner(o, channel);
  runner.set_model(model);
  if (!runner.has_prompts()) {
    std::fprintf(stderr, "relgen-bench: no prompts in %s\n", o.prompts_file.c_str());
    return 2;
  }
  json results = json::array();
  std::printf("%-12s %6s %9s %9s %10s | %-21s | %-21s | %-21s | %-21s\n", "load", "ok", "req/s", "tok/s", "goodput",
              "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "e2e p50/p90/p99 s");
  std::vector<double> loads = o.rates;
  if (loads.empty()) loads = {0};
  for (double rate : loads) {
    StepTotals before, after;
    const bool timed = !o.metrics.empty() && ReadStepTotals(o.metrics, &before);
    json r = RunOne(runner, o, rate, o.concurrency);
    if (timed && ReadStepTotals(o.metrics, &after)) r["host_per_step"] = HostPerStep(before, after);
    results.push_back(r);
    auto ms = [&](const char* k) {
      char b[64];
      std::snprintf(b, sizeof(b), "%6.1f/%6.1f/%6.1f", r[k]["p50"].get<double>() * 1e3, r[k]["p90"].get<double>() * 1e3,
                    r[k]["p99"].get<double>() * 1e3);
      return std::string(b);
    };
    char e2e[64];
    std::snprintf(e2e, sizeof(e2e), "%6.2f/%6.2f/%6.2f", r["e2e_s"]["p50"].get<double>(), r["e2e_s"]["p90"].get<double>(),
                  r["e2e_s"]["p99"].get<double>());
    const std::string load = rate > 0 ? std::to_string(rate).substr(0, 5) + "/s" : "c=" + std::to_string(o.concurrency);
    std::printf("%-12s %6d %9.2f %9.1f %10.2f | %s | %s | %s | %s\n", load.c_str(), r["completed"].get<int>(),
                r["request_throughput"].get<double>(), r["output_token_throughput"].get<double>(),
                r["goodput"].get<double>(), ms("ttft_s").c_str(), ms("tpot_s").c_str(), ms("itl_s").c_str(), e2e);
    if (r.contains("host_per_step")) {
      const json& h = r["host_per_step"];
      std::printf("host per step: plan+build %.3f ms, wait %.3f ms, land %.3f ms, step %.3f ms; host share %.1f%% (%.0f steps)\n",
                  h["plan_ms"].get<double>(), h["wait_ms"].get<double>(), h["land_ms"].get<double>(),
                  h["step_ms"].get<double>(), h["host_share"].get<double>() * 100, h["steps"].get<double>());
    } else if (!o.metrics.empty()) {
      std::fprintf(stderr, "relgen-bench: no engine-step histograms at %s/metrics\n", o.metrics.c_str());
    }
    std::fflush(stdout);
  }
  const json out = {{"server", o.server}, {"api", o.api}, {"num_requests", o.num_requests}, {"prompt_len", o.prompt_len},
                    {"shared_prefix_len", o.shared_prefix_len},
                    {"output_len", o.output_len}, {"spread", o.spread}, {"slo_ttft_s", o.slo_ttft},
                    {"slo_tpot_s", o.slo_tpot}, {"results", results}};
  if (!o.json_out.empty()) {
    std::ofstream(o.json_out) << out.dump(2) << "\n";
    std::printf("wrote %s\n", o.json_out.c_str());
  }
  if (!o.png_out.empty()) {
    const std::string json_path = o.json_out.empty() ? o.png_out + ".json" : o.json_out;
    if (o.json_out.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    const std::string cmd = "/usr/bin/python3 '" RELGEN_SOURCE_DIR "/tools/plot_bench.py' '" + json_path + "' '" + o.png_out + "'";
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "relgen-bench: plotting failed (%s)\n", cmd.c_str());
      return 1;
    }
    std::printf("wrote %s\n", o.png_out.c_str());
  }
  int failed = 0;
  for (const auto& r : results) failed += r["failed"].get<int>();
  return failed == 0 ? 0 : 1;
}

}  // namespace relgen::bench
