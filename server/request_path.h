// The one way a request enters the engine, whichever API it came by (docs/architecture.md, "A
// request's path"). The gRPC service (server/service.h) and the HTTP API (server/openai_api.h) each
// turn their wire into relgen.v1 requests and call Admit; the path checks that the call may be
// served now (the model loaded, the server not draining, the caller's credentials), maps the
// fields and tokenises the prompt once (server/validation.h), submits to the engine, whose
// Engine::SubmitGroup checks every rule (engine/core/request_checks.h), and books the call as
// received and, when refused, as rejected. The two APIs never include each other: what both use
// lives here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/core/engine.h"
#include "relgen/v1/generation.pb.h"
#include "server/metrics.h"
#include "server/options.h"

namespace relgen::server {

class RequestPath {
 public:
  RequestPath(const Options& options, Metrics* metrics) : options_(options), metrics_(metrics) {}

  // Who calls, as its API saw it.
  struct Caller {
    Api api = Api::kGrpc;
    grpc::Status auth;  // the API's verdict on the call's credentials
    absl::Time deadline = absl::InfiniteFuture();
  };

  // A request the engine took: one handle per sample or continuation. It counts as one call in
  // flight until Done.
  struct Admission {
    std::vector<std::shared_ptr<RequestHandle>> handles;
    std::string request_id;
    std::vector<int32_t> prompt;                      // as the engine keeps it (truncate_prompt_tokens)
    std::vector<std::vector<int32_t>> continuations;  // Score: as tokenised
  };

  // Requests are refused UNAVAILABLE until the engine is set (the model is loading).
  void SetEngine(Engine* engine) { engine_.store(engine); }
  Engine* engine() const { return engine_.load(); }
  // From now on new calls are refused UNAVAILABLE; those already admitted go on.
  void StartDraining() { draining_.store(true); }
  // Admissions not yet Done.
  int in_flight() const { return in_flight_.load(); }
  const Options& options() const { return options_; }

  // A Generate, GenerateStream or Score call: one request. A refusal is the engine's or the
  // mapping's status (a FieldError names its field), or the caller's own (auth, loading, draining).
  absl::Status Admit(const v1::GenerateRequest& request, const Caller& caller, Admission* out);
  absl::Status Admit(const v1::ScoreRequest& request, const Caller& caller, Admission* out);

  // Gives the requests of a call that may carry several (an HTTP completion: one per prompt).
  // Called once the call may be served, so the body of a caller who may not is never read;
  // `engine` is the one the requests will enter (its model, to check what the call names; its
  // tokenizer, for the answer). A refusal is the call's, answered as it is.
  using Reader = absl::FunctionRef<absl::Status(const Engine& engine, std::vector<v1::GenerateRequest>* requests)>;
  // A call of several requests, all admitted or none: each is mapped and checked before any is
  // submitted, so a bad one costs no work. On a refusal of one request, *refused is its index
  // (else -1), so the API can say which.
  absl::Status Admit(Reader read, const Caller& caller, std::vector<Admission>* out, int* refused);

  // An admission's call is over (its handles finished or cancelled).
  void Done() { in_flight_.fetch_sub(1); }

 private:
  // Books the call received, runs `admit` on the engine if the call may be served now, and books
  // the call rejected if either refuses it.
  absl::Status Book(const Caller& caller, absl::FunctionRef<absl::Status(Engine* engine)> admit);
  // Maps and checks every request, then submits them (Req: GenerateRequest or ScoreRequest).
  template <typename Req>
  absl::Status AdmitAll(Engine* engine, const std::vector<const Req*>& requests, absl::Time deadline,
                        std::vector<Admission>* out, int* refused);
  // Submits a mapped request; one call in flight when OK.
  absl::Status Submit(Engine* engine, Request r, absl::Time deadline, Admission* out);

  const Options& options_;
  Metrics* metrics_;
  std::atomic<Engine*> engine_{nullptr};
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
};

// An engine, mapping or admission status as gRPC's (the message, which names the field, unchanged).
grpc::Status ToGrpcStatus(const absl::Status& s);

// The status a finished request ends with, in either API.
grpc::Status FinalStatus(const Output& final_output);

}  // namespace relgen::server
