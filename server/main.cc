// relgen-server: serves a relgen model over gRPC (relgen.v1.GenerationService), with the standard
// health service and server reflection.
// This first version runs one request at a time on the CPU backend; continuous batching, metrics
// and the full request contract come with the engine and server issues.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu_backend.h"
#include "engine/model.h"
#include "relgen/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json + model.safetensors)");
ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC address");
ABSL_FLAG(std::string, device, "auto", "auto, cpu or cuda");
ABSL_FLAG(int32_t, max_new_tokens, 1024, "largest max_new_tokens a request may ask for");

namespace relgen {
namespace {

using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

class GenerationServiceImpl final : public v1::GenerationService::Service {
 public:
  GenerationServiceImpl(std::shared_ptr<const Model> model, std::unique_ptr<Backend> backend)
      : model_(std::move(model)), backend_(std::move(backend)) {}

  Status Generate(ServerContext* ctx, const v1::GenerateRequest* req,
                  v1::GenerateResponse* resp) override {
    const ModelConfig& c = model_->config();
    std::vector<int32_t> prompt;
    if (req->has_token_ids()) {
      prompt.assign(req->token_ids().ids().begin(), req->token_ids().ids().end());
      for (int32_t t : prompt) {
        if (t < 0 || t >= c.vocab_size) {
          return Status(StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("token_ids: id ", t, " out of range; allowed 0..", c.vocab_size - 1));
        }
      }
    } else {
      if (c.tokenizer != TokenizerKind::kByte) {
        return Status(StatusCode::UNIMPLEMENTED, "text prompts need the byte tokenizer in this version");
      }
      for (unsigned char ch : req->text()) prompt.push_back(ch);
    }
    if (prompt.empty()) return Status(StatusCode::INVALID_ARGUMENT, "prompt: must not be empty");
    const int max_new = req->has_max_new_tokens() ? req->max_new_tokens() : 128;
    const int limit = std::min(absl::GetFlag(FLAGS_max_new_tokens), c.max_seq_len - static_cast<int>(prompt.size()));
    if (max_new < 1 || max_new > limit) {
      return Status(StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("max_new_tokens: ", max_new, "; allowed 1..", limit,
                                 " for this prompt of ", prompt.size(), " tokens"));
    }
    const float temperature = req->has_temperature() ? req->temperature() : 1.0f;
    if (!(temperature >= 0.0f && temperature <= 100.0f)) {
      return Status(StatusCode::INVALID_ARGUMENT, "temperature: allowed 0..100");
    }
    std::mt19937_64 rng(req->has_seed() ? req->seed() : std::random_device{}());

    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int32_t> table(backend_->kv_cache().num_blocks);
    for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<int32_t>(b);
    std::vector<float> logits;
    std::vector<int32_t> out;
    SequenceStep step;
    step.tokens = prompt;
    step.block_table = table;
    auto finish = v1::FINISH_REASON_LENGTH;
    int32_t next = 0;
    for (int i = 0; i < max_new; ++i) {
      if (ctx->IsCancelled()) return Status(StatusCode::CANCELLED, "cancelled");
      if (auto s = backend_->Forward({&step, 1}, &logits); !s.ok()) {
        return Status(StatusCode::INTERNAL, std::string(s.message()));
      }
      next = Sample(logits, temperature, rng);
      out.push_back(next);
      if (next == c.eos_token_id && !req->ignore_eos()) {
        finish = v1::FINISH_REASON_EOS;
        break;
      }
      step.start_pos += static_cast<int>(step.tokens.size());
      step.tokens = absl::MakeConstSpan(&next, 1);
    }
    resp->set_request_id(req->request_id());
    for (int32_t t : out) {
      resp->add_token_ids(t);
      if (t < 256 && c.tokenizer == TokenizerKind::kByte) resp->mutable_text()->push_back(static_cast<char>(t));
    }
    resp->set_finish_reason(finish);
    resp->mutable_usage()->set_prompt_tokens(static_cast<int>(prompt.size()));
    resp->mutable_usage()->set_generated_tokens(static_cast<int>(out.size()));
    return Status::OK;
  }

  Status GetModelInfo(ServerContext*, const v1::GetModelInfoRequest*, v1::ModelInfo* info) override {
    const ModelConfig& c = model_->config();
    info->set_name(c.name);
    info->set_vocab_size(c.vocab_size);
    info->set_d_model(c.d_model);
    info->set_n_layers(c.n_layers);
    info->set_n_heads(c.n_heads);
    info->set_head_dim(c.head_dim);
    info->set_ffn_dim(c.ffn_dim);
    info->set_max_seq_len(c.max_seq_len);
    info->mutable_relative_attention()->set_scheme(std::string(SchemeName(c.rel.scheme)));
    info->set_num_parameters(model_->num_parameters());
    info->set_device(std::string(backend_->name()));
    return Status::OK;
  }

 private:
  static int32_t Sample(const std::vector<float>& logits, float temperature, std::mt19937_64& rng) {
    if (temperature == 0.0f) {
      return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
    const float mx = *std::max_element(logits.begin(), logits.end());
    std::vector<double> p(logits.size());
    for (size_t i = 0; i < p.size(); ++i) p[i] = std::exp((logits[i] - mx) / temperature);
    std::discrete_distribution<int32_t> dist(p.begin(), p.end());
    return dist(rng);
  }

  std::shared_ptr<const Model> model_;
  std::mutex mu_;
  std::unique_ptr<Backend> backend_;
};

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage("relgen-server --model DIR [--listen HOST:PORT]");
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) {
    std::fprintf(stderr, "relgen-server: --model DIR is required\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_device) == "cuda") {
    std::fprintf(stderr, "relgen-server: --device cuda: this build has no CUDA backend yet\n");
    return 2;
  }
  auto model = Model::Load(dir);
  if (!model.ok()) {
    std::fprintf(stderr, "relgen-server: cannot load model: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  // One request at a time: a pool for one whole sequence.
  const int block = 16;
  auto backend = NewCpuBackend(*model, KvCacheConfig{block, BlocksForTokens((*model)->config().max_seq_len, block)});
  if (!backend.ok()) {
    std::fprintf(stderr, "relgen-server: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  GenerationServiceImpl service(*model, *std::move(backend));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "relgen-server: cannot listen on %s\n", absl::GetFlag(FLAGS_listen).c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config();
  std::printf("relgen-server: model %s (%s, %lld parameters) on cpu, listening on %s\n",
              c.name.c_str(), std::string(SchemeName(c.rel.scheme)).c_str(),
              static_cast<long long>((*model)->num_parameters()), absl::GetFlag(FLAGS_listen).c_str());
  std::fflush(stdout);
  server->Wait();
  return 0;
}

}  // namespace
}  // namespace relgen

int main(int argc, char** argv) { return relgen::Main(argc, argv); }
