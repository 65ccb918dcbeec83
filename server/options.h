// relgen-server's settings (its flags), shared by the service, validation and metrics.
#pragma once

#include <cstdint>
#include <string>

namespace relgen::server {

struct Options {
  std::string model;
  // LoRA adapters: NAME=DIR each (a PEFT adapter directory for the model), at most `max_loras` in a
  // step and resident at once, none of rank over `max_lora_rank`.
  std::vector<std::string> lora_modules;
  int max_loras = 8;
  int max_lora_rank = 16;
  std::string listen = "0.0.0.0:50051";
  std::string metrics_listen = "0.0.0.0:9400";
  std::string http_listen = "0.0.0.0:8000";  // empty: no HTTP API
  int http_threads = 128;
  bool http_compression = false;  // compress HTTP answers when the client offers an encoding
  std::string device = "auto";
  int threads = 0;                       // 0: every hardware thread
  std::string weights_dtype = "f32";     // dense weights on the CPU: f32, bf16, int8
  std::string kv_cache_dtype = "f32";    // K/V cache (CPU and CUDA): f32, bf16
  std::string activations_dtype = "f32";  // CPU projections' inputs: f32, bf16
  std::string cuda_gemm = "auto";
  std::string cuda_attention = "simt";  // CUDA attention: simt (float32 kernels) or mma (tensor cores)  // CUDA projections: auto, invariant (relgen's kernel), cublas or mma
  int max_num_seqs = 64;
  int max_batch_tokens = 512;
  int max_encoder_tokens = 2048;
  int max_waiting = 1024;
  int64_t kv_cache_tokens = 0;           // 0: size by kv_cache_memory_fraction
  double kv_cache_memory_fraction = 0.2;
  int kv_block_size = 16;
  bool enable_prefix_caching = true;     // reuse computed prompt prefixes' KV blocks
  bool overlap_steps = true;             // an asynchronous backend: launch step N+1 before N lands
  int max_new_tokens = 4096;             // largest a request may ask for
  int default_max_new_tokens = 128;
  int64_t max_prompt_bytes = 256 << 10;  // text prompts
  int64_t max_message_bytes = 4 << 20;   // gRPC's own limit on a received message
  int max_concurrent_streams = 100;      // HTTP/2 streams per client connection
  double stream_write_timeout_seconds = 30;  // a stream whose reader stalls this long is cancelled
  // An HTTP call's deadline (0: none). HTTP clients cannot send one as gRPC's do, and a unary call
  // whose client left is noticed only when its answer is written: this bounds its work.
  double http_request_timeout_seconds = 600;
  double drain_grace_seconds = 30;
  std::string tls_cert, tls_key;
  std::string tls_client_ca;             // set: clients must present a certificate it signed (mTLS)
  std::string auth_token;                // set: GenerationService calls need "authorization: Bearer <it>"
};

}  // namespace relgen::server
