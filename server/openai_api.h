// The OpenAI-compatible HTTP API (docs/operations.md, "HTTP API"): POST /v1/completions (unary
// and server-sent events), GET /v1/models, and a 404 for /v1/chat/completions (no chat templates);
// vLLM's POST /tokenize, POST /detokenize and GET /version, which its clients call beside them.
// A completion's JSON becomes the GenerateRequests a gRPC client would send (one per prompt; type
// checks only) and enters the engine through the same request path as a gRPC call
// (server/request_path.h), so admission, validation, limits and the books are shared; calls are
// booked with api="http". Errors answer OpenAI's shape {"error": {message, type, param, code}}
// with the HTTP status its clients expect.
//
// A handler runs on the listener's thread for the whole call. A stream writes each chunk as the
// engine delivers it; a write that fails (the client left) or stalls past
// --stream_write_timeout_seconds cancels every request of the call, so its KV blocks are freed at
// the engine's next step.
#pragma once

#include <httplib.h>

#include "server/metrics.h"
#include "server/options.h"
#include "server/request_path.h"

namespace relgen::server {

class OpenAiApi {
 public:
  OpenAiApi(RequestPath* path, Metrics* metrics);
  // Adds the API's routes, and a JSON error body for every error status without one.
  void Register(httplib::Server* server);

 private:
  void Completions(const httplib::Request& req, httplib::Response& res);
  void Models(const httplib::Request& req, httplib::Response& res);
  // vLLM's tokenizer endpoints, in its shapes: text to the ids a completion's prompt becomes (with
  // the model's BOS where add_special_tokens, as a prompt gets it), and ids back to text.
  void Tokenize(const httplib::Request& req, httplib::Response& res);
  void Detokenize(const httplib::Request& req, httplib::Response& res);

  RequestPath* path_;
  Metrics* metrics_;
  const int64_t created_;  // the model's "created" time: the server's start
};

}  // namespace relgen::server
