#include "server/request_path.h"

#include <random>
#include <utility>

#include "absl/strings/str_format.h"
#include "server/validation.h"

namespace relgen::server {
namespace {

// The engine's failures that are not the caller's (FailedPrecondition, Internal, ...) all read as
// INTERNAL; the codes a refusal means something by keep their own.
grpc::StatusCode ToGrpc(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kInvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
    case absl::StatusCode::kResourceExhausted: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case absl::StatusCode::kUnavailable: return grpc::StatusCode::UNAVAILABLE;
    case absl::StatusCode::kDeadlineExceeded: return grpc::StatusCode::DEADLINE_EXCEEDED;
    case absl::StatusCode::kCancelled: return grpc::StatusCode::CANCELLED;
    case absl::StatusCode::kUnauthenticated: return grpc::StatusCode::UNAUTHENTICATED;
    case absl::StatusCode::kNotFound: return grpc::StatusCode::NOT_FOUND;
    default: return grpc::StatusCode::INTERNAL;
  }
}

std::string NewRequestId() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("%016x", rng());
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& s) {
  return s.ok() ? grpc::Status::OK : grpc::Status(ToGrpc(s.code()), std::string(s.message()));
}

grpc::Status FinalStatus(const Output& o) {
  switch (o.finish_reason) {
    case FinishReason::kLength:
    case FinishReason::kStop:
    case FinishReason::kEos:
      return grpc::Status::OK;
    case FinishReason::kDeadline:
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed");
    case FinishReason::kCancelled:
      if (o.status.code() == absl::StatusCode::kUnavailable) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(o.status.message()));
      }
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    default:  // kError: INTERNAL, or UNAVAILABLE once the device failed
      return grpc::Status(ToGrpc(o.status.code()), std::string(o.status.message()));
  }
}

absl::Status RequestPath::Admit(const v1::GenerateRequest& request, const Caller& caller, Admission* out) {
  std::vector<Admission> admitted;
  const absl::Status s = Book(caller, [&](Engine* engine) {
    return AdmitAll<v1::GenerateRequest>(engine, {&request}, caller.deadline, &admitted, nullptr);
  });
  if (s.ok()) *out = std::move(admitted[0]);
  return s;
}

absl::Status RequestPath::Admit(const v1::ScoreRequest& request, const Caller& caller, Admission* out) {
  std::vector<Admission> admitted;
  const absl::Status s = Book(caller, [&](Engine* engine) {
    return AdmitAll<v1::ScoreRequest>(engine, {&request}, caller.deadline, &admitted, nullptr);
  });
  if (s.ok()) *out = std::move(admitted[0]);
  return s;
}

absl::Status RequestPath::Admit(Reader read, const Caller& caller, std::vector<Admission>* out, int* refused) {
  *refused = -1;
  return Book(caller, [&](Engine* engine) {
    std::vector<v1::GenerateRequest> requests;
    if (absl::Status s = read(*engine, &requests); !s.ok()) return s;
    std::vector<const v1::GenerateRequest*> each;
    for (const v1::GenerateRequest& r : requests) each.push_back(&r);
    return AdmitAll(engine, each, caller.deadline, out, refused);
  });
}

absl::Status RequestPath::Book(const Caller& caller, absl::FunctionRef<absl::Status(Engine* engine)> admit) {
  metrics_->OnReceived(caller.api);
  Engine* engine = engine_.load();
  absl::Status s;
  if (engine == nullptr) {
    s = absl::UnavailableError("the model is loading");
  } else if (draining_.load()) {
    s = absl::UnavailableError("the server is draining");
  } else if (!caller.auth.ok()) {
    s = absl::Status(static_cast<absl::StatusCode>(caller.auth.error_code()), caller.auth.error_message());
  } else {
    s = admit(engine);
  }
  if (!s.ok()) metrics_->OnRejected(ToGrpc(s.code()), caller.api);
  return s;
}

template <typename Req>
absl::Status RequestPath::AdmitAll(Engine* engine, const std::vector<const Req*>& requests, absl::Time deadline,
                                   std::vector<Admission>* out, int* refused) {
  std::vector<Request> mapped(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::Status s = ToEngineRequest(*requests[i], engine->model().config(), engine->tokenizer(), options_,
                                     engine->config().limits, &mapped[i]);
    // One request is checked by SubmitGroup alone; several are checked before any is submitted.
    // As SubmitGroup sees it: the prompt as kept.
    if (s.ok() && requests.size() > 1) {
      TruncatePrompt(&mapped[i]);
      s = engine->Check(mapped[i]);
    }
    if (!s.ok()) {
      if (refused != nullptr) *refused = static_cast<int>(i);
      return s;
    }
  }
  for (Request& r : mapped) {
    Admission a;
    if (absl::Status s = Submit(engine, std::move(r), deadline, &a); !s.ok()) {
      for (Admission& taken : *out) {
        for (const auto& h : taken.handles) h->Cancel();
        Done();
      }
      out->clear();
      return s;
    }
    out->push_back(std::move(a));
  }
  return absl::OkStatus();
}

absl::Status RequestPath::Submit(Engine* engine, Request r, absl::Time deadline, Admission* out) {
  if (r.id.empty()) r.id = NewRequestId();
  // The prompt as the engine keeps it: its count for usage, and HTTP's echo.
  TruncatePrompt(&r);
  out->request_id = r.id;
  out->prompt = r.prompt;
  out->continuations = r.continuations;
  r.deadline = deadline;
  auto h = engine->SubmitGroup(std::move(r));
  if (!h.ok()) return h.status();
  if (h->empty()) return absl::InternalError("the engine returned no request handle");
  out->handles = *std::move(h);
  in_flight_.fetch_add(1);
  return absl::OkStatus();
}

}  // namespace relgen::server
