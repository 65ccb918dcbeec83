// relgen-server: serves a relgen model over gRPC (relgen.v1.GenerationService) with the standard
// health service and server reflection, and Prometheus metrics over HTTP.
//
// Start-up: listen first (health NOT_SERVING, requests UNAVAILABLE while the model loads), then
// load, then SERVING. SIGTERM or SIGINT: health NOT_SERVING, new requests UNAVAILABLE, requests in
// flight get up to --drain_grace_seconds to finish, the rest end UNAVAILABLE, exit 0.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/backends/device.h"
#include "engine/core/engine.h"
#include "server/http_listener.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/options.h"
#include "server/request_path.h"
#include "server/service.h"

#ifndef RELGEN_SOURCE_DIR
#define RELGEN_SOURCE_DIR "."
#endif

ABSL_FLAG(std::string, model, "", "model directory; default: models/default (here, then in the source tree)");
ABSL_FLAG(std::vector<std::string>, lora_modules, {},
          "LoRA adapters of the model, NAME=DIR,... (PEFT's adapter_config.json + adapter_model.safetensors in "
          "DIR); a request names one by gRPC's `adapter` or HTTP's `model`");
ABSL_FLAG(int32_t, max_loras, 8,
          "LoRA adapters resident at once and in one step (more may be registered: the rest wait for a slot)");
ABSL_FLAG(int32_t, max_lora_rank, 16, "largest LoRA rank an adapter may have (1..256)");
ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC address HOST:PORT (port 0 picks a free one)");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9400",
          "admin HTTP address HOST:PORT for /metrics, /healthz, /readyz (port 0 picks one)");
ABSL_FLAG(std::string, http_listen, "0.0.0.0:8000",
          "OpenAI-compatible HTTP API address HOST:PORT (POST /v1/completions, GET /v1/models; port 0 picks one; "
          "empty: no HTTP API). The same TLS and bearer-token flags as gRPC protect it");
ABSL_FLAG(int32_t, http_threads, 128,
          "HTTP connections served at once (one thread each, a stream holding its thread until it ends); more "
          "connections wait for a thread in arrival order");
ABSL_FLAG(std::string, device, "auto", "auto (CUDA when a GPU is present), cpu, cuda or cuda:N");
ABSL_FLAG(int32_t, threads, 0, "CPU threads for the model (0: all)");
ABSL_FLAG(std::string, weights_dtype, "auto",
          "how the backend stores the dense layers' weights: auto (on a GPU bf16; on the CPU bf16 for a bf16 checkpoint, "
          "else f32), f32, bf16 "
          "(half the bytes) or, on the CPU, int8 (a quarter; per-output-channel scales). f32 and bf16 multiply in float32; "
          "int8 quantises each projection's input row and multiplies in integers. docs/benchmarks.md gives each one's "
          "accuracy");
ABSL_FLAG(std::string, activations_dtype, "auto",
          "the CPU projections' inputs: auto (bf16 with bf16 weights where the CPU has AMX-BF16 or AVX-512 BF16, else "
          "f32), f32, or bf16 (rounded to nearest even first; with bf16 weights multiplied by AMX-BF16 tiles or "
          "AVX-512 BF16 dot products where the CPU has them: twice the arithmetic, the accuracy in docs/benchmarks.md)");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "how the K/V cache is stored (CPU and CUDA): auto (on a GPU bf16; on the CPU bf16 for a bf16 checkpoint, else "
          "f32), f32, or bf16 "
          "(half the bytes: twice the tokens in the same memory, half the cache read per decode step); arithmetic "
          "stays float32");
ABSL_FLAG(std::string, cuda_gemm, "auto",
          "the CUDA backend's projections: auto (invariant, until a GPU has timed mma), invariant (relgen's float32 "
          "kernel: a row's bits never depend on the rows batched with it; bias, activation and residual in the same "
          "launch), cublas (cuBLAS: bf16 weights on its tensor-core GEMM with activations rounded to bf16, float32 "
          "weights by SGEMM; fast prefills, but a row's bits may change with the rows batched with it) or mma (relgen's "
          "tensor-core kernel over bf16 weights, activations rounded to bf16, rows batch invariant)");
ABSL_FLAG(std::string, cuda_attention, "simt",
          "the CUDA backend's attention: simt (relgen's float32 kernels over the cache, any head size) or mma "
          "(tensor cores where the cache is bf16 and head_dim is 16, 32, 64 or 128: q, the relative tables' rows and the "
          "softmax weights rounded to bf16; prefill and decode give the same bits; other layers keep simt)");
ABSL_FLAG(bool, http_compression, false,
          "compress HTTP answers (the API's JSON, /metrics) with gzip or br when a request's Accept-Encoding offers "
          "it; off (the default), every answer goes uncompressed whatever the client offers: completions are small, "
          "and a client whose brotli cannot read what it offers (aiohttp with an old Brotli) would fail on every one. "
          "Server-sent events are never compressed");
ABSL_FLAG(int32_t, max_num_seqs, 64, "sequences in the running batch at most");
ABSL_FLAG(int32_t, max_batch_tokens, 512, "tokens computed per engine step (prompt chunks + decode tokens)");
ABSL_FLAG(int32_t, max_encoder_tokens, 2048,
          "encoder-decoder models: input tokens encoded per engine step, apart from --max_batch_tokens (an input "
          "longer than this encodes alone in its step)");
ABSL_FLAG(int32_t, max_waiting, 1024, "queued requests at most; beyond, RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, kv_cache_tokens, 0, "KV cache capacity in tokens (0: use --kv_cache_memory_fraction)");
ABSL_FLAG(double, kv_cache_memory_fraction, 0,
          "KV cache size as a fraction of available memory (on a GPU: of the memory free after the weights, the "
          "largest step's buffers and 64 MiB of headroom). 0, the default: 0.9 of that on a GPU; on the CPU "
          "--max_num_seqs whole sequences of the model's context, at most 0.2 of the memory available, its pages "
          "taken only as they are written");
ABSL_FLAG(int32_t, kv_block_size, 16, "tokens per KV cache block");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "reuse the KV blocks of prompt prefixes computed before (same outputs either way); "
          "--noenable_prefix_caching turns it off");
ABSL_FLAG(bool, overlap_steps, true,
          "on a GPU, launch each step before the previous one's tokens reach the host, so scheduling and "
          "output processing overlap the device's work (same outputs either way); --nooverlap_steps turns it off");
ABSL_FLAG(int32_t, max_new_tokens, 4096, "largest max_new_tokens a request may ask for");
ABSL_FLAG(int32_t, default_max_new_tokens, 128, "max_new_tokens when a request does not set it");
ABSL_FLAG(int64_t, max_prompt_bytes, 256 << 10, "largest text prompt in bytes (INVALID_ARGUMENT beyond)");
ABSL_FLAG(int64_t, max_message_bytes, 4 << 20, "largest gRPC message received (RESOURCE_EXHAUSTED beyond)");
ABSL_FLAG(double, drain_grace_seconds, 30, "on SIGTERM, time given to requests in flight");
ABSL_FLAG(double, device_failure_exit_delay_seconds, 5,
          "after the device fails (every request then fails UNAVAILABLE): seconds to go on answering, health "
          "NOT_SERVING, before exiting with status 3 so the orchestrator restarts the server");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificates: require every client to present a certificate they signed (mutual TLS; needs --tls_cert)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token: GenerationService calls must send metadata 'authorization: Bearer <token>'");
ABSL_FLAG(int32_t, max_concurrent_streams, 100, "concurrent calls per client connection (HTTP/2 streams)");
ABSL_FLAG(bool, reuse_port, false,
          "share --listen's port with other processes that also set it (SO_REUSEPORT; the kernel splits "
          "connections between them). Off: a port another process listens on is refused at start");
ABSL_FLAG(bool, enable_test_hooks, false,
          "testing only: POST /testing/pause and /testing/resume on the admin listener hold and release the "
          "engine before its next step; POST /testing/step, while paused, lets one more step run");
ABSL_FLAG(double, http_request_timeout_seconds, 600,
          "the deadline of an HTTP call, as a gRPC client's deadline is (0: none): past it the call's requests are "
          "cancelled and it answers 504. 600, the OpenAI Python client's own timeout: by then a client on its defaults "
          "has left");
ABSL_FLAG(double, stream_write_timeout_seconds, 30,
          "cancel a stream whose client leaves a message unread this long (0: never)");

namespace relgen::server {
namespace {

int Fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "relgen-server: %s\n", msg.c_str());
  return code;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

std::string DefaultModelDir() {
  for (const std::string& dir : {std::string("models/default"), std::string(RELGEN_SOURCE_DIR) + "/models/default"}) {
    if (std::ifstream(dir + "/config.json")) return dir;
  }
  return "";
}

// Why gRPC could not listen on HOST:PORT: binds a probe socket there (without SO_REUSEPORT) and
// reports what the kernel says, e.g. that another process already listens on the port.
std::string WhyNotListening(const std::string& addr) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return "expected HOST:PORT";
  std::string host = addr.substr(0, colon);
  const std::string port = addr.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.empty() || host == "0.0.0.0" ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return "cannot resolve the host or port";
  }
  std::string why;
  for (addrinfo* a = res; a != nullptr && why.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = errno == EADDRINUSE
                ? "port " + port + " is already in use by another process (--reuse_port shares it deliberately)"
                : std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(res);
  return why.empty() ? "gRPC refused the address" : why;
}

// Host part of HOST:PORT with the bound port.
std::string WithPort(const std::string& addr, int port) {
  return absl::StrCat(addr.substr(0, addr.rfind(':')), ":", port);
}

// Set by the handler for a stop signal that reached a thread other than main's.
std::atomic<int> g_stop_signal{0};
void OnStopSignal(int sig) { g_stop_signal.store(sig, std::memory_order_relaxed); }

// Main blocks the stop signals and takes them here; the short timeout notices one the handler caught
// on another thread. Returns the signal, or 0 once `give_up` (checked each tick) says so.
int WaitForStopSignal(const sigset_t& signals, const std::function<bool()>& give_up) {
  const timespec tick = {0, 100 * 1000 * 1000};
  while (true) {
    const int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig > 0) return sig;
    if (const int caught = g_stop_signal.load(std::memory_order_relaxed); caught != 0) return caught;
    if (give_up()) return 0;
  }
}

// absl's own --help lists only the flags of a file named after the binary (relgen-server.cc) and
// exits 1, so it printed "No flags matched" for these, defined in server/main.cc. Asking for help
// is not an error: the flags are listed here, sorted, and the process exits 0. --helpfull stays
// absl's (every flag linked in, gRPC's and absl's own too).
bool WantsHelp(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--help" || a == "-help" || a == "--helpshort" || a == "-helpshort" || a == "-h") return true;
  }
  return false;
}

void PrintHelp() {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "server/main.cc")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  std::string out = absl::StrCat(absl::ProgramUsageMessage(), "\n\nflags:\n");
  for (const absl::CommandLineFlag* f : flags) {
    const bool text = f->IsOfType<std::string>();
    absl::StrAppend(&out, "  --", f->Name(), " (default ", text ? "\"" : "", f->DefaultValue(), text ? "\"" : "", ")\n");
    // The help, wrapped at 100 columns under the flag.
    std::string line = "     ";
    for (absl::string_view word : absl::StrSplit(f->Help(), ' ', absl::SkipEmpty())) {
      if (line.size() + 1 + word.size() > 100 && line.size() > 5) {
        absl::StrAppend(&out, line, "\n");
        line = "     ";
      }
      absl::StrAppend(&line, " ", word);
    }
    absl::StrAppend(&out, line, "\n");
  }
  std::fputs(out.c_str(), stdout);
}

// The flags as Options, each checked; 0, or the exit status after saying what is wrong.
int ReadOptions(Options* out) {
  Options& o = *out;
  o.model = absl::GetFlag(FLAGS_model);
  o.lora_modules = absl::GetFlag(FLAGS_lora_modules);
  o.max_loras = absl::GetFlag(FLAGS_max_loras);
  o.max_lora_rank = absl::GetFlag(FLAGS_max_lora_rank);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.http_listen = absl::GetFlag(FLAGS_http_listen);
  o.http_threads = absl::GetFlag(FLAGS_http_threads);
  o.http_compression = absl::GetFlag(FLAGS_http_compression);
  o.device = absl::GetFlag(FLAGS_device);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.weights_dtype = absl::GetFlag(FLAGS_weights_dtype);
  o.kv_cache_dtype = absl::GetFlag(FLAGS_kv_cache_dtype);
  o.activations_dtype = absl::GetFlag(FLAGS_activations_dtype);
  o.cuda_gemm = absl::GetFlag(FLAGS_cuda_gemm);
  o.cuda_attention = absl::GetFlag(FLAGS_cuda_attention);
  o.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.max_encoder_tokens = absl::GetFlag(FLAGS_max_encoder_tokens);
  o.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  o.kv_cache_tokens = absl::GetFlag(FLAGS_kv_cache_tokens);
  o.kv_cache_memory_fraction = absl::GetFlag(FLAGS_kv_cache_memory_fraction);
  o.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  o.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  o.overlap_steps = absl::GetFlag(FLAGS_overlap_steps);
  o.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  o.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  o.max_prompt_bytes = absl::GetFlag(FLAGS_max_prompt_bytes);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.drain_grace_seconds = absl::GetFlag(FLAGS_drain_grace_seconds);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  o.stream_write_timeout_seconds = absl::GetFlag(FLAGS_stream_write_timeout_seconds);
  o.http_request_timeout_seconds = absl::GetFlag(FLAGS_http_request_timeout_seconds);
  const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);

  if (o.threads < 0 || o.max_num_seqs < 1 || o.max_batch_tokens < 1 || o.max_encoder_tokens < 1 || o.max_waiting < 1 ||
      o.kv_block_size < 1 || o.max_loras < 1 || o.max_lora_rank < 1 || o.max_lora_rank > 256 ||
      o.max_new_tokens < 1 || o.default_max_new_tokens < 1 || o.max_prompt_bytes < 1 || o.max_message_bytes < 1024 ||
      o.drain_grace_seconds < 0 || o.kv_cache_tokens < 0 || o.max_concurrent_streams < 1 || o.http_threads < 1 ||
      !(o.stream_write_timeout_seconds >= 0) || !(o.http_request_timeout_seconds >= 0)) {
    return Fail("a limit flag is out of range (counts >= 1, --threads >= 0, --max_message_bytes >= 1024, "
                "--drain_grace_seconds >= 0, --stream_write_timeout_seconds >= 0, "
                "--http_request_timeout_seconds >= 0)", 2);
  }
  if (o.default_max_new_tokens > o.max_new_tokens) {
    return Fail("--default_max_new_tokens may not exceed --max_new_tokens", 2);
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) return Fail("--tls_cert and --tls_key go together", 2);
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) return Fail("--tls_client_ca needs --tls_cert and --tls_key", 2);
  if (!token_file.empty()) {
    if (!ReadFile(token_file, &o.auth_token)) return Fail("cannot read --auth_token_file " + token_file, 2);
    while (!o.auth_token.empty() && std::isspace(static_cast<unsigned char>(o.auth_token.back()))) o.auth_token.pop_back();
    if (o.auth_token.empty()) return Fail("--auth_token_file " + token_file + " holds no token", 2);
    for (char ch : o.auth_token) {
      if (ch < 0x21 || ch > 0x7e) {
        return Fail("--auth_token_file: the token may hold printable ASCII only (no spaces or control characters)", 2);
      }
    }
  }
  if (o.model.empty()) {
    o.model = DefaultModelDir();
    if (o.model.empty()) return Fail("no --model given and no default model in models/default", 2);
  }
  return 0;
}

// SIGTERM/SIGINT are blocked here, so every thread started from now on inherits the block, and
// WaitForStopSignal takes them. Threads that libraries started before main (the BLAS pool) do not
// block them: the handler catches a signal the kernel hands to one of those, where the default
// action would kill the process mid-drain.
sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  struct sigaction on_stop = {};
  on_stop.sa_handler = OnStopSignal;
  sigemptyset(&on_stop.sa_mask);
  sigaction(SIGTERM, &on_stop, nullptr);
  sigaction(SIGINT, &on_stop, nullptr);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const Options& o) {
  if (o.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  if (!ReadFile(o.tls_cert, &pair.cert_chain)) return absl::InvalidArgumentError("cannot read --tls_cert " + o.tls_cert);
  if (!ReadFile(o.tls_key, &pair.private_key)) return absl::InvalidArgumentError("cannot read --tls_key " + o.tls_key);
  ssl.pem_key_cert_pairs.push_back(pair);
  if (!o.tls_client_ca.empty()) {
    if (!ReadFile(o.tls_client_ca, &ssl.pem_root_certs)) {
      return absl::InvalidArgumentError("cannot read --tls_client_ca " + o.tls_client_ca);
    }
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

std::unique_ptr<grpc::Server> StartGrpc(const Options& o, const std::shared_ptr<grpc::ServerCredentials>& creds,
                                        GenerationService* service, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen, creds, port);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(o.max_message_bytes, INT32_MAX)));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, o.max_concurrent_streams);
  // gRPC sets SO_REUSEPORT by default, so a second server on a taken port would start and silently
  // take part of the first one's connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, absl::GetFlag(FLAGS_reuse_port) ? 1 : 0);
  return builder.BuildAndStart();
}

// The admin listener's routes: Prometheus scrapes and probes, never TLS or tokens
// (docs/operations.md), and the test hooks when enabled.
void AddAdminRoutes(HttpListener& admin, const std::shared_ptr<Metrics>& metrics, std::atomic<Engine*>* hooked) {
  admin.server().Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  admin.server().Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("alive\n", "text/plain; charset=utf-8");
  });
  admin.server().Get("/readyz", [metrics](const httplib::Request&, httplib::Response& res) {
    const bool ready = metrics->serving();
    res.status = ready ? 200 : 503;
    res.set_content(ready ? "serving\n" : "not serving\n", "text/plain; charset=utf-8");
  });
  if (!absl::GetFlag(FLAGS_enable_test_hooks)) return;
  for (const std::string hook : {"pause", "resume", "step"}) {
    admin.server().Post("/testing/" + hook, [hooked, hook](const httplib::Request&, httplib::Response& res) {
      Engine* e = hooked->load();
      if (e == nullptr) {
        res.status = 503;
        return res.set_content("the model is loading\n", "text/plain; charset=utf-8");
      }
      if (hook == "pause") e->Pause();
      if (hook == "resume") e->Resume();
      if (hook == "step") e->Advance(1);
      res.set_content(hook + "\n", "text/plain; charset=utf-8");
    });
  }
}

HttpListener::Settings ApiListenerSettings(const Options& o) {
  HttpListener::Settings s;
  s.tls_cert = o.tls_cert;
  s.tls_key = o.tls_key;
  s.tls_client_ca = o.tls_client_ca;
  s.threads = o.http_threads;
  s.max_body_bytes = o.max_message_bytes;
  s.compression = o.http_compression;
  // A stream's write that waits this long for its reader fails, and the call is cancelled.
  s.write_timeout_seconds = o.stream_write_timeout_seconds > 0 ? o.stream_write_timeout_seconds : 1e6;
  // A stalled reader is noticed after 256 KiB (the kernel doubles it), not after the megabytes an
  // auto-sized buffer grows to.
  s.send_buffer_bytes = 256 << 10;
  return s;
}

// The engine on the model, and the start-up line's account of both.
struct Loaded {
  std::unique_ptr<Engine> engine;
  std::string description;  // "model ... on DEVICE; KV cache ..."
};

absl::StatusOr<Loaded> LoadEngine(const Options& o, std::shared_ptr<EngineObserver> observer) {
  auto model = Model::Load(o.model);
  if (!model.ok()) return absl::InvalidArgumentError(absl::StrCat("cannot load model: ", model.status().message()));
  const ModelConfig& c = (*model)->config();
  auto tokenizer = NewTokenizer(c, o.model);
  if (!tokenizer.ok()) return tokenizer.status();
  DeviceOptions dev;
  dev.device = o.device;
  dev.kv_cache_tokens = o.kv_cache_tokens;
  dev.kv_cache_memory_fraction = o.kv_cache_memory_fraction;
  dev.kv_block_size = o.kv_block_size;
  dev.threads = o.threads;
  dev.weights_dtype = o.weights_dtype;
  dev.kv_cache_dtype = o.kv_cache_dtype;
  dev.activations_dtype = o.activations_dtype;
  dev.cuda_gemm = o.cuda_gemm;
  dev.cuda_attention = o.cuda_attention;
  dev.max_step_tokens = o.max_batch_tokens;
  dev.max_step_encoder_tokens = o.max_encoder_tokens;
  dev.max_step_seqs = o.max_num_seqs;
  auto backend = NewBackend(*model, dev);
  if (!backend.ok()) return backend.status();
  std::vector<std::shared_ptr<const LoraAdapter>> adapters;
  for (const std::string& m : o.lora_modules) {
    const size_t eq = m.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == m.size()) {
      return absl::InvalidArgumentError(absl::StrCat("--lora_modules: '", m, "'; allowed: NAME=DIR,..."));
    }
    const std::string name = m.substr(0, eq);
    if (name == c.name) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lora_modules: adapter name '", name, "' is the base model's name; choose another"));
    }
    auto a = LoadLoraAdapter(name, m.substr(eq + 1), **model, o.max_lora_rank);
    if (!a.ok()) return a.status();
    adapters.push_back(*std::move(a));
  }
  if (!adapters.empty()) {
    if (absl::Status s = (*backend)->ConfigureLora(o.max_loras, o.max_lora_rank); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--lora_modules: ", s.message()));
    }
  }
  const BackendInfo info = (*backend)->Describe();
  const KvCacheConfig& kv = info.kv_cache;
  Loaded out;
  out.description = absl::StrFormat(
      "model %s from %s (%s, %lld parameters, %s, %s (%s) weights) on %s; KV cache %lld tokens (%s, %.1f MiB)", c.name,
      o.model, SchemeName(c.rel.scheme), static_cast<long long>((*model)->num_parameters()),
      DTypeName((*model)->file_dtype()), info.weights_dtype, info.projections, info.device,
      static_cast<long long>(int64_t{kv.num_blocks} * kv.block_size), info.kv_cache_dtype,
      info.memory.kv_cache / 1048576.0);
  EngineConfig ec;
  ec.scheduler.max_num_seqs = o.max_num_seqs;
  ec.scheduler.max_batch_tokens = o.max_batch_tokens;
  ec.scheduler.max_encoder_tokens = o.max_encoder_tokens;
  ec.max_waiting = o.max_waiting;
  ec.limits.max_new_tokens = o.max_new_tokens;
  ec.prefix_caching = o.enable_prefix_caching;
  ec.overlap_steps = o.overlap_steps;
  ec.observer = std::move(observer);
  ec.adapters = adapters;
  ec.scheduler.max_loras = adapters.empty() ? 0 : o.max_loras;
  if (!adapters.empty()) {
    int64_t bytes = 0;
    std::vector<std::string> names;
    for (const auto& a : adapters) {
      bytes += a->bytes();
      names.push_back(absl::StrCat(a->name, " (rank ", a->rank, ")"));
    }
    absl::StrAppendFormat(&out.description, "; LoRA adapters %s (%.1f MiB on the host, %d resident at most)",
                          absl::StrJoin(names, ", "), bytes / 1048576.0, o.max_loras);
  }
  auto engine = Engine::Create(*model, *std::move(backend), std::shared_ptr<const Tokenizer>(*std::move(tokenizer)), ec);
  if (!engine.ok()) return engine.status();
  out.engine = *std::move(engine);
  return out;
}

// Waits for a stop signal or the device's failure (then answers NOT_SERVING for a while). Returns
// whether the device failed.
bool AwaitStop(const sigset_t& signals, Engine* e, grpc::Server* server, Metrics* metrics,
               const RequestPath& path, const Options& o) {
  const int sig = WaitForStopSignal(signals, [e] { return !e->Failure().ok(); });
  if (sig != 0) {
    std::printf("relgen-server: %s: draining (%d in flight, grace %.0f s)\n", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                path.in_flight(), o.drain_grace_seconds);
    std::fflush(stdout);
    return false;
  }
  // Nothing can be served any more. Say so where load balancers look, for a while, then exit.
  server->GetHealthCheckService()->SetServingStatus(false);
  metrics->SetServing(false);
  const double delay = absl::GetFlag(FLAGS_device_failure_exit_delay_seconds);
  std::printf("relgen-server: %s; health NOT_SERVING, exiting with status 3 in %.0f s\n",
              std::string(e->Failure().message()).c_str(), delay);
  std::fflush(stdout);
  const absl::Time exit_at = absl::Now() + absl::Seconds(delay);
  WaitForStopSignal(signals, [exit_at] { return absl::Now() >= exit_at; });
  return true;
}

// Drains: no new calls, those in flight get the grace period, the rest end UNAVAILABLE.
void Drain(grpc::Server* server, HttpListener* http, Metrics* metrics, RequestPath* path, Engine* engine,
           std::atomic<Engine*>* hooked, const Options& o) {
  server->GetHealthCheckService()->SetServingStatus(false);
  metrics->SetServing(false);
  path->StartDraining();
  const absl::Time give_up = absl::Now() + absl::Seconds(o.drain_grace_seconds);
  while (path->in_flight() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(20));
  const int left = path->in_flight();
  const absl::Time drained = absl::Now();
  hooked->store(nullptr);
  engine->Shutdown();  // what is left ends UNAVAILABLE, and its calls finish
  const absl::Time calls_done_by = absl::Now() + absl::Seconds(2);
  while (path->in_flight() > 0 && absl::Now() < calls_done_by) absl::SleepFor(absl::Milliseconds(5));
  // Nothing of ours is left: let gRPC cancel its idle machinery at once rather than wait for it.
  server->Shutdown(std::chrono::system_clock::now());
  http->Stop();
  path->SetEngine(nullptr);
  metrics->SetEngine(nullptr);
  std::printf("relgen-server: stopped (%d requests cut at the grace period; drain %.2f s, shutdown %.2f s)\n", left,
              absl::ToDoubleSeconds(drained - (give_up - absl::Seconds(o.drain_grace_seconds))),
              absl::ToDoubleSeconds(absl::Now() - drained));
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage("relgen-server [--model DIR] [--listen HOST:PORT] [--metrics_listen HOST:PORT] ...");
  if (WantsHelp(argc, argv)) {
    PrintHelp();
    return 0;
  }
  absl::ParseCommandLine(argc, argv);
  Options o;
  if (const int status = ReadOptions(&o); status != 0) return status;
  const sigset_t signals = BlockStopSignals();
  auto creds = Credentials(o);
  if (!creds.ok()) return Fail(std::string(creds.status().message()), 2);

  std::atomic<Engine*> hooked_engine{nullptr};  // for the test hooks, once it exists; outlives the admin listener
  auto metrics = std::make_shared<Metrics>();
  RequestPath path(o, metrics.get());  // both APIs' way into the engine
  GenerationService service(&path, metrics.get());
  int port = 0;
  std::unique_ptr<grpc::Server> server = StartGrpc(o, *creds, &service, &port);
  if (server == nullptr || port == 0) return Fail("cannot listen on " + o.listen + ": " + WhyNotListening(o.listen));
  server->GetHealthCheckService()->SetServingStatus(false);
  HttpListener::Settings admin_settings;
  admin_settings.compression = o.http_compression;
  HttpListener admin("metrics", admin_settings);
  AddAdminRoutes(admin, metrics, &hooked_engine);
  auto metrics_port = admin.Start(o.metrics_listen);
  if (!metrics_port.ok()) return Fail(std::string(metrics_port.status().message()));
  HttpListener http("HTTP", ApiListenerSettings(o));
  OpenAiApi openai(&path, metrics.get());
  int http_port = 0;
  if (!o.http_listen.empty()) {
    openai.Register(&http.server());
    auto bound = http.Start(o.http_listen);
    if (!bound.ok()) return Fail(std::string(bound.status().message()));
    http_port = *bound;
  }

  auto loaded = LoadEngine(o, metrics);
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  Engine* const engine = loaded->engine.get();
  metrics->SetEngine(engine);
  hooked_engine.store(engine);
  path.SetEngine(engine);
  server->GetHealthCheckService()->SetServingStatus(true);
  metrics->SetServing(true);
  std::printf("relgen-server: %s; gRPC on %s%s%s; %s; metrics on %s\n", loaded->description.c_str(),
              WithPort(o.listen, port).c_str(),
              o.tls_cert.empty() ? "" : (o.tls_client_ca.empty() ? " (TLS)" : " (mutual TLS)"),
              o.auth_token.empty() ? "" : " (bearer token)",
              o.http_listen.empty() ? "no HTTP API" : ("HTTP on " + WithPort(o.http_listen, http_port)).c_str(),
              WithPort(o.metrics_listen, *metrics_port).c_str());
  std::fflush(stdout);

  const bool device_failed = AwaitStop(signals, engine, server.get(), metrics.get(), path, o);
  Drain(server.get(), &http, metrics.get(), &path, engine, &hooked_engine, o);
  return device_failed ? 3 : 0;
}

}  // namespace
}  // namespace relgen::server

int main(int argc, char** argv) { return relgen::server::Main(argc, argv); }
