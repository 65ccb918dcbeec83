#include "server/openai_api.h"

#include <chrono>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/auth.h"

namespace relgen::server {
namespace {

using json = nlohmann::ordered_json;

// OpenAI's legacy completions default; a request without max_tokens gets this many.
constexpr int kDefaultMaxTokens = 16;
// Prompts in one completions call at most (each is one engine request of n samples).
constexpr int kMaxPrompts = 64;

struct ApiError {
  grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  std::string message;
  std::string param;     // the request field at fault, if any
  std::string err_code;  // OpenAI's `code`, if any
  int http = 0;          // the HTTP status, where `code`'s usual one is not it
};

int HttpStatus(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::INVALID_ARGUMENT: return 400;
    case grpc::StatusCode::UNAUTHENTICATED: return 401;
    case grpc::StatusCode::NOT_FOUND: return 404;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return 429;
    case grpc::StatusCode::UNAVAILABLE: return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return 504;
    case grpc::StatusCode::CANCELLED: return 499;
    default: return 500;
  }
}

const char* ErrorType(int http) {
  switch (http) {
    case 401: return "authentication_error";
    case 429: return "rate_limit_error";
    case 500:
    case 503:
    case 504: return "server_error";
    default: return "invalid_request_error";
  }
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int HttpStatus(const ApiError& e) { return e.http != 0 ? e.http : HttpStatus(e.code); }

json ErrorBody(const ApiError& e) {
  json err;
  err["message"] = e.message;
  err["type"] = ErrorType(HttpStatus(e));
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.err_code.empty() ? json(nullptr) : json(e.err_code);
  return json{{"error", std::move(err)}};
}

void Reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(Dump(body), "application/json");
}

void ReplyError(httplib::Response& res, const ApiError& e) { Reply(res, HttpStatus(e), ErrorBody(e)); }

// A request field's name in relgen.v1 as this API names it, where the two differ.
std::string ApiField(const std::string& field) {
  if (field == "max_new_tokens") return "max_tokens";
  if (field == "text" || field == "token_ids") return "prompt";
  if (field == "prompt_logprobs") return "echo";  // set by echo with logprobs
  if (field == "num_return_sequences") return "n";  // n, with num_beams
  return field;
}

// An answered call's status (auth, the engine's end of a request): no field at fault.
ApiError FromStatus(const grpc::Status& s) { return ApiError{s.error_code(), s.error_message(), "", ""}; }

// A refusal from the checks (engine/core/request_checks.h): its message as gRPC's, the field
// (its payload) as `param`.
ApiError FromStatus(const absl::Status& s) {
  ApiError e = FromStatus(ToGrpcStatus(s));
  const std::string field = ErrorField(s);
  if (!field.empty()) e.param = ApiField(field);
  return e;
}

ApiError Invalid(const std::string& param, const std::string& what) {
  return ApiError{grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat(param, ": ", what), param, ""};
}

// A `model` that is neither the base nor a registered adapter: 404, naming what is served.
ApiError ModelNotFound(const std::string& asked, const Engine& served) {
  std::string adapters;
  for (const auto& a : served.adapters()) absl::StrAppend(&adapters, adapters.empty() ? "" : ", ", "'", a->name, "'");
  return ApiError{grpc::StatusCode::NOT_FOUND,
                  absl::StrCat("model '", asked, "' is not served here; this server serves '", served.model().config().name,
                               "'", adapters.empty() ? "" : absl::StrCat(" and its LoRA adapters ", adapters)),
                  "model", "model_not_found"};
}

// OK when no token is configured or the request carries "Authorization: Bearer <token>".
grpc::Status CheckAuth(const httplib::Request& req, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const std::string h = req.get_header_value("Authorization");
  constexpr absl::string_view kBearer = "Bearer ";
  if (absl::StartsWith(h, kBearer) && ConstantTimeEquals(absl::string_view(h).substr(kBearer.size()), token)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "this server needs the header 'Authorization: Bearer <token>' with its token (--auth_token_file)");
}

const char* FinishName(FinishReason r) { return r == FinishReason::kLength ? "length" : "stop"; }

// Characters of UTF-8 text (bytes that do not continue a character).
int64_t Chars(absl::string_view s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

struct Prompt {
  bool is_text = true;
  std::string text;
  std::vector<int32_t> ids;
};

struct Completion {
  std::string model;
  std::vector<Prompt> prompts;
  v1::GenerateRequest base;  // every field but the prompt
  bool echo = false;
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;  // -1: none
};

// An integer the engine's int32 field can hold; the engine checks its value.
std::optional<ApiError> GetInt(const json& v, const std::string& name, int64_t* out) {
  constexpr int64_t kLo = std::numeric_limits<int32_t>::min(), kHi = std::numeric_limits<int32_t>::max();
  if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(kHi)
                                                         : v.get<int64_t>() < kLo || v.get<int64_t>() > kHi)) {
    return Invalid(name, "expected a 32-bit integer");
  }
  *out = v.get<int64_t>();
  return std::nullopt;
}

std::optional<ApiError> GetNumber(const json& v, const std::string& name, double* out) {
  if (!v.is_number()) return Invalid(name, "expected a number");
  *out = v.get<double>();
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& v, const std::string& name, bool* out) {
  if (!v.is_boolean()) return Invalid(name, "expected true or false");
  *out = v.get<bool>();
  return std::nullopt;
}

std::optional<ApiError> GetIds(const json& v, const std::string& name, std::vector<int32_t>* out) {
  if (!v.is_array()) return Invalid(name, "expected an array of token ids");
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t id = 0;
    if (auto e = GetInt(v[i], absl::StrCat(name, "[", i, "]"), &id)) {
      e->param = name;
      return e;
    }
    out->push_back(static_cast<int32_t>(id));
  }
  return std::nullopt;
}

std::optional<ApiError> ParsePrompt(const json& v, std::vector<Prompt>* out) {
  const std::string kShape = "expected a string, an array of strings, an array of token ids or an array of those";
  if (v.is_string()) {
    out->push_back(Prompt{true, v.get<std::string>(), {}});
    return std::nullopt;
  }
  if (!v.is_array() || v.empty()) return Invalid("prompt", v.is_array() ? "the array is empty; " + kShape : kShape);
  if (v[0].is_number()) {
    Prompt p{false, "", {}};
    if (auto e = GetIds(v, "prompt", &p.ids)) return e;
    out->push_back(std::move(p));
    return std::nullopt;
  }
  if (v.size() > kMaxPrompts) return Invalid("prompt", absl::StrCat(v.size(), " prompts; allowed at most ", kMaxPrompts));
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i].is_string()) {
      out->push_back(Prompt{true, v[i].get<std::string>(), {}});
    } else if (v[i].is_array() && !v[i].empty()) {
      Prompt p{false, "", {}};
      if (auto e = GetIds(v[i], absl::StrCat("prompt[", i, "]"), &p.ids)) return e;
      out->push_back(std::move(p));
    } else {
      return Invalid("prompt", absl::StrCat("prompt[", i, "] is ", v[i].type_name(), "; ", kShape));
    }
  }
  return std::nullopt;
}

// What the JSON parser found, beyond the GenerateRequest it fills.
struct Parsed {
  bool has_prompt = false;
  bool has_stream_options = false;
  std::optional<int64_t> best_of;
};

// A float field of the GenerateRequest.
using FloatSetter = void (v1::GenerateRequest::*)(float);
// An int32 one.
using IntSetter = void (v1::GenerateRequest::*)(int32_t);

const std::map<std::string, FloatSetter>& FloatFields() {
  static const auto* fields = new std::map<std::string, FloatSetter>{
      {"temperature", &v1::GenerateRequest::set_temperature},
      {"top_p", &v1::GenerateRequest::set_top_p},
      {"repetition_penalty", &v1::GenerateRequest::set_repetition_penalty},
      {"presence_penalty", &v1::GenerateRequest::set_presence_penalty},
      {"frequency_penalty", &v1::GenerateRequest::set_frequency_penalty},
      {"min_p", &v1::GenerateRequest::set_min_p},
      {"length_penalty", &v1::GenerateRequest::set_length_penalty},
  };
  return *fields;
}

const std::map<std::string, IntSetter>& IntFields() {
  static const auto* fields = new std::map<std::string, IntSetter>{
      {"max_tokens", &v1::GenerateRequest::set_max_new_tokens},
      {"n", &v1::GenerateRequest::set_n},
      {"min_tokens", &v1::GenerateRequest::set_min_tokens},
      {"no_repeat_ngram_size", &v1::GenerateRequest::set_no_repeat_ngram_size},  // transformers' (relgen's extra)
      // transformers' beam search (relgen's extra); n: the sequences returned
      {"num_beams", &v1::GenerateRequest::set_num_beams},
      {"truncate_prompt_tokens", &v1::GenerateRequest::set_truncate_prompt_tokens},
  };
  return *fields;
}

std::optional<ApiError> ParseStop(const json& v, v1::GenerateRequest* r) {
  if (v.is_string()) {
    r->add_stop(v.get<std::string>());
    return std::nullopt;
  }
  if (!v.is_array()) return Invalid("stop", "expected a string or an array of strings");
  for (const json& s : v) {
    if (!s.is_string()) return Invalid("stop", "expected a string or an array of strings");
    r->add_stop(s.get<std::string>());
  }
  return std::nullopt;
}

// OpenAI's logit_bias: token ids as strings.
std::optional<ApiError> ParseLogitBias(const json& v, v1::GenerateRequest* r) {
  const std::string key = "logit_bias";
  if (!v.is_object()) return Invalid(key, "expected an object of token id (a string) to bias");
  for (const auto& [id, bias] : v.items()) {
    int32_t t = -1;
    if (!absl::SimpleAtoi(id, &t)) return Invalid(key, absl::StrCat("key '", id, "' is not a token id"));
    if (!bias.is_number()) return Invalid(key, absl::StrCat("the bias of token ", id, " is not a number"));
    (*r->mutable_logit_bias())[t] = bias.get<float>();
  }
  return std::nullopt;
}

// Token id sequences (vLLM's strings are not taken).
std::optional<ApiError> ParseBadWords(const json& v, v1::GenerateRequest* r) {
  if (!v.is_array()) return Invalid("bad_words", "expected an array of token id arrays");
  for (size_t w = 0; w < v.size(); ++w) {
    if (!v[w].is_array()) return Invalid("bad_words", absl::StrCat("bad_words[", w, "] is not an array of token ids"));
    std::vector<int32_t> ids;
    if (auto e = GetIds(v[w], "bad_words", &ids)) return e;
    r->add_bad_words()->mutable_ids()->Assign(ids.begin(), ids.end());
  }
  return std::nullopt;
}

// The fields that fill the GenerateRequest; nullopt with *known false for any other.
std::optional<ApiError> ParseEngineField(const std::string& key, const json& v, v1::GenerateRequest* r, bool* known) {
  *known = true;
  int64_t i = 0;
  double d = 0;
  if (auto f = FloatFields().find(key); f != FloatFields().end()) {
    if (auto e = GetNumber(v, key, &d)) return e;
    (r->*(f->second))(static_cast<float>(d));
  } else if (auto f = IntFields().find(key); f != IntFields().end()) {
    if (auto e = GetInt(v, key, &i)) return e;
    (r->*(f->second))(static_cast<int32_t>(i));
  } else if (key == "top_k") {  // vLLM's -1 is relgen's 0: off
    if (auto e = GetInt(v, key, &i)) return e;
    r->set_top_k(i == -1 ? 0 : static_cast<int32_t>(i));
  } else if (key == "seed") {
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0)) {
      return Invalid("seed", "expected an integer in 0..18446744073709551615");
    }
    r->set_seed(v.get<uint64_t>());
  } else if (key == "stop") {
    return ParseStop(v, r);
  } else if (key == "stop_token_ids" || key == "allowed_token_ids") {
    std::vector<int32_t> ids;
    if (auto e = GetIds(v, key, &ids)) return e;
    auto* field = key == "stop_token_ids" ? r->mutable_stop_token_ids() : r->mutable_allowed_token_ids();
    field->Add(ids.begin(), ids.end());
  } else if (key == "ignore_eos" || key == "skip_special_tokens") {
    bool b = false;
    if (auto e = GetBool(v, key, &b)) return e;
    key == "ignore_eos" ? r->set_ignore_eos(b) : r->set_skip_special_tokens(b);
  } else if (key == "logit_bias") {
    return ParseLogitBias(v, r);
  } else if (key == "bad_words") {
    return ParseBadWords(v, r);
  } else if (key == "early_stopping") {  // true, false or "never", as transformers'
    if (v.is_boolean()) {
      r->set_early_stopping(v.get<bool>() ? v1::EARLY_STOPPING_TRUE : v1::EARLY_STOPPING_FALSE);
    } else if (v.is_string() && v.get<std::string>() == "never") {
      r->set_early_stopping(v1::EARLY_STOPPING_NEVER);
    } else {
      return Invalid(key, "expected true, false or \"never\"");
    }
  } else {
    *known = false;
  }
  return std::nullopt;
}

// The fields that shape the HTTP answer (and OpenAI's that relgen takes only as no-ops).
std::optional<ApiError> ParseApiField(const std::string& key, const json& v, Completion* c, Parsed* parsed) {
  int64_t i = 0;
  if (key == "model") {
    if (!v.is_string()) return Invalid("model", "expected the served model's name (GET /v1/models)");
    c->model = v.get<std::string>();
  } else if (key == "prompt") {
    parsed->has_prompt = true;
    return ParsePrompt(v, &c->prompts);
  } else if (key == "best_of") {
    if (auto e = GetInt(v, key, &i)) return e;
    parsed->best_of = i;
  } else if (key == "logprobs") {
    if (auto e = GetInt(v, key, &i)) return Invalid(key, "expected the number of alternatives per token");
    c->logprobs = static_cast<int>(i);
    c->base.set_logprobs(c->logprobs);
  } else if (key == "echo" || key == "stream") {
    return GetBool(v, key, key == "echo" ? &c->echo : &c->stream);
  } else if (key == "stream_options") {
    if (!v.is_object()) return Invalid("stream_options", "expected an object");
    parsed->has_stream_options = true;
    for (const auto& [k2, v2] : v.items()) {
      if (k2 != "include_usage") {
        return Invalid("stream_options", absl::StrCat("unknown field '", k2, "'; allowed: include_usage"));
      }
      if (!v2.is_null()) {
        if (auto e = GetBool(v2, "stream_options.include_usage", &c->include_usage)) return e;
      }
    }
  } else if (key == "user") {
    if (!v.is_string()) return Invalid("user", "expected a string");
  } else if (key == "suffix") {
    if (!v.is_string() || !v.get<std::string>().empty()) return Invalid(key, "not supported; allowed \"\" only");
  } else {
    return Invalid(key, absl::StrCat("unknown field '", key, "'; docs/operations.md lists the fields /v1/completions takes"));
  }
  return std::nullopt;
}

// The request's JSON into a Completion. Every field is either used or refused by name; their
// values are the engine's to check.
std::optional<ApiError> ParseCompletion(const json& body, Completion* c) {
  if (!body.is_object()) return Invalid("body", "expected a JSON object");
  v1::GenerateRequest& r = c->base;
  r.set_max_new_tokens(kDefaultMaxTokens);
  Parsed parsed;
  for (const auto& [key, v] : body.items()) {
    if (v.is_null() && key != "model" && key != "prompt") continue;  // null: the default
    bool known = false;
    if (auto e = ParseEngineField(key, v, &r, &known)) return e;
    if (known) continue;
    if (auto e = ParseApiField(key, v, c, &parsed)) return e;
  }
  if (c->model.empty()) return Invalid("model", "missing; give the served model's name (GET /v1/models)");
  if (!parsed.has_prompt) return Invalid("prompt", "missing");
  if (parsed.best_of && *parsed.best_of != (r.has_n() ? r.n() : 1)) {
    return Invalid("best_of", "not supported; allowed equal to n only");
  }
  if (r.has_num_beams() && r.num_beams() > 1 && r.has_n()) {
    // With beams, the choices are the best sequences of one search.
    r.set_num_return_sequences(r.n());
    r.clear_n();
  }
  if (parsed.has_stream_options && !c->stream) return Invalid("stream_options", "only with stream: true");
  if (c->echo && c->logprobs >= 0) r.set_prompt_logprobs(c->logprobs);
  return std::nullopt;
}

// OpenAI's logprobs object, built token by token. A token's text_offset counts the characters of
// the choice's text before it, so offsets index that text: a generated token's string and length
// are the text it added to the output (Output::token_text, the engine's one decoder, which follows
// skip_special_tokens); an echoed prompt token's are its own text, the prompt decoded token by token.
class Logprobs {
 public:
  explicit Logprobs(const Tokenizer* tok) : tok_(tok), prompt_decoder_(tok->NewStream()) {}
  // An echoed prompt token.
  void AddPrompt(int32_t token, std::optional<float> logprob, const std::vector<TokenLogprob>* top) {
    Add(tok_->TokenText(token), logprob, top);
    offset_ += Chars(prompt_decoder_->Push(token));
  }
  void AddPrompt(const SampleResult& r) { AddPrompt(r.token, r.logprob, &r.top); }
  // Generated tokens start at this character of the choice's text (after the echo, if any).
  void StartOutput(int64_t offset) { offset_ = offset; }
  // A generated token and the text it added.
  void AddOutput(const SampleResult& r, const std::string& piece) {
    Add(piece, r.logprob, &r.top);
    offset_ += Chars(piece);
  }
  json Take() {
    json j{{"tokens", std::move(tokens_)}, {"token_logprobs", std::move(token_logprobs_)},
           {"top_logprobs", std::move(top_)}, {"text_offset", std::move(offsets_)}};
    tokens_ = json::array();
    token_logprobs_ = json::array();
    top_ = json::array();
    offsets_ = json::array();
    return j;
  }

 private:
  void Add(std::string text, std::optional<float> logprob, const std::vector<TokenLogprob>* top) {
    tokens_.push_back(std::move(text));
    token_logprobs_.push_back(logprob ? json(*logprob) : json(nullptr));
    if (top == nullptr) {
      top_.push_back(nullptr);
    } else {
      // The alternatives were not emitted: each is shown as its own text.
      json alts = json::object();
      for (const TokenLogprob& a : *top) {
        const std::string t = tok_->TokenText(a.token);
        if (!alts.contains(t)) alts[t] = a.logprob;  // most likely first: keep it where texts repeat
      }
      top_.push_back(std::move(alts));
    }
    offsets_.push_back(offset_);
  }

  const Tokenizer* tok_;
  std::unique_ptr<StreamDecoder> prompt_decoder_;
  int64_t offset_ = 0;
  json tokens_ = json::array(), token_logprobs_ = json::array(), top_ = json::array(), offsets_ = json::array();
};

// One prompt's admission and what its echo needs.
struct PromptState {
  RequestPath::Admission admission;
  std::string echo_text;
  std::vector<SampleResult> prompt_logprobs;  // sample 0 delivers them
  bool prompt_logprobs_read = false;
};

struct Choice {
  int index = 0;
  int prompt = 0;
  int sample = 0;
  std::shared_ptr<RequestHandle> handle;
  std::string text;
  std::unique_ptr<Logprobs> logprobs;
  bool started = false;  // its echo is out (stream) or taken (unary)
  bool done = false;
  FinishReason finish = FinishReason::kNone;
  int generated = 0;
};

// What a call admitted: its prompts and choices, in OpenAI's order (prompt-major).
struct Call {
  RequestPath* path = nullptr;
  Metrics* metrics = nullptr;
  const Tokenizer* tok = nullptr;
  std::string id, model;
  int64_t created = 0;
  bool echo = false;
  int logprobs = -1;
  bool include_usage = false;
  std::vector<PromptState> prompts;
  std::vector<Choice> choices;
  bool booked = false;  // its error, if any, is in the books
  bool done = false;    // every choice finished and answered

  ~Call() {
    CancelAll();  // a finished request stays as it finished
    for (PromptState& p : prompts) {
      if (!p.admission.handles.empty()) path->Done();
    }
  }
  void CancelAll() {
    for (PromptState& p : prompts) {
      for (const auto& h : p.admission.handles) h->Cancel();
    }
  }
  void Book(grpc::StatusCode code) {
    if (booked) return;
    booked = true;
    metrics->OnRefused(code, Api::kHttp);
  }
  // The echo before a choice's first output: the prompt's text, and its tokens' log-probabilities.
  void Echo(Choice& ch) {
    ch.started = true;
    if (!echo) return;
    const PromptState& p = prompts[ch.prompt];
    ch.text.insert(0, p.echo_text);
    if (logprobs < 0) return;
    const std::vector<int32_t>& ids = p.admission.prompt;
    if (!ids.empty()) ch.logprobs->AddPrompt(ids[0], std::nullopt, nullptr);
    for (const SampleResult& r : p.prompt_logprobs) ch.logprobs->AddPrompt(r);
    ch.logprobs->StartOutput(Chars(p.echo_text));
  }
  // Takes a read output into the choice. Returns the final status (OK until the last output).
  grpc::Status Take(Choice& ch, Output& o) {
    PromptState& p = prompts[ch.prompt];
    if (ch.sample == 0 && !p.prompt_logprobs_read) {
      p.prompt_logprobs = std::move(o.prompt_logprobs);
      p.prompt_logprobs_read = true;
    }
    if (!ch.started) Echo(ch);
    ch.text += o.text;
    if (logprobs >= 0) {
      for (size_t i = 0; i < o.logprobs.size(); ++i) ch.logprobs->AddOutput(o.logprobs[i], o.token_text.at(i));
    }
    if (!o.finished) return grpc::Status::OK;
    ch.done = true;
    ch.finish = o.finish_reason;
    ch.generated = o.generated_tokens;
    return FinalStatus(o);
  }
  // A choice of a call with echo and logprobs waits for its prompt's log-probabilities (sample 0's).
  bool Ready(const Choice& ch) const {
    return ch.started || ch.sample == 0 || !echo || logprobs < 0 || prompts[ch.prompt].prompt_logprobs_read;
  }
  json ChoiceJson(Choice& ch) {
    json c{{"index", ch.index}, {"text", std::move(ch.text)}};
    c["logprobs"] = logprobs >= 0 ? ch.logprobs->Take() : json(nullptr);
    c["finish_reason"] = ch.done ? json(FinishName(ch.finish)) : json(nullptr);
    ch.text.clear();
    return c;
  }
  json Usage() const {
    int prompt_tokens = 0, completion = 0;
    for (const PromptState& p : prompts) prompt_tokens += static_cast<int>(p.admission.prompt.size());
    for (const Choice& ch : choices) completion += ch.generated;
    return json{{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion},
                {"total_tokens", prompt_tokens + completion}};
  }
  json Envelope(json choices_json) const {
    return json{{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model},
                {"choices", std::move(choices_json)}};
  }
};

// Wakes a stream's writer when the engine delivers output to any of its requests.
struct Wakeup {
  std::mutex mu;
  std::condition_variable cv;
  bool pending = false;
  void Notify() {
    {
      std::lock_guard<std::mutex> lock(mu);
      pending = true;
    }
    cv.notify_one();
  }
  // Waits up to `timeout` for a notification since the last wait.
  void Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, timeout, [this] { return pending; });
    pending = false;
  }
};

}  // namespace

OpenAiApi::OpenAiApi(RequestPath* path, Metrics* metrics)
    : path_(path),
      metrics_(metrics),
      created_(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
                   .count()) {}

void OpenAiApi::Register(httplib::Server* server) {
  server->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { Completions(req, res); });
  server->Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) { Models(req, res); });
  server->Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) { Tokenize(req, res); });
  server->Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) { Detokenize(req, res); });
  server->Get("/version", [](const httplib::Request&, httplib::Response& res) {
    Reply(res, 200, json{{"version", RELGEN_VERSION}});
  });
  server->Post("/v1/chat/completions", [](const httplib::Request&, httplib::Response& res) {
    ReplyError(res, ApiError{grpc::StatusCode::NOT_FOUND,
                             "chat completions are not served: relgen does not render chat templates; send the "
                             "rendered prompt to POST /v1/completions",
                             "", "chat_not_supported"});
  });
  // Every error without a body of its own (unknown route, body too large, malformed HTTP) gets one
  // in OpenAI's shape.
  server->set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    ApiError e;
    if (res.status == 404) {
      e = ApiError{grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("no route ", req.method, " ", req.path,
                                "; this API serves POST /v1/completions, GET /v1/models, POST /tokenize, "
                                "POST /detokenize and GET /version"),
                   "", "not_found"};
    } else if (res.status == 413) {
      e = ApiError{grpc::StatusCode::RESOURCE_EXHAUSTED,
                   absl::StrCat("the request body is larger than ", path_->options().max_message_bytes,
                                " bytes (--max_message_bytes)"),
                   "", "request_too_large", 413};
      if (req.path == "/v1/completions") {
        metrics_->OnReceived(Api::kHttp);
        metrics_->OnRejected(e.code, Api::kHttp);
      }
    } else {
      e.message = absl::StrCat("HTTP ", res.status);
      e.http = res.status;
    }
    const int status = res.status;
    Reply(res, status, ErrorBody(e));
  });
}

namespace {

// A tokenizer endpoint's body: a JSON object whose "model", when given and not null, names the
// served model (vLLM's requests may leave it out). Returns the error to answer, if any; otherwise
// *body holds the parsed object and *served the engine.
std::optional<ApiError> ReadTokenizerBody(const httplib::Request& req, const std::string& auth_token,
                                          RequestPath* path, json* body, const Engine** served) {
  if (grpc::Status auth = CheckAuth(req, auth_token); !auth.ok()) return FromStatus(auth);
  *served = path->engine();
  if (*served == nullptr) return ApiError{grpc::StatusCode::UNAVAILABLE, "the model is loading", "", ""};
  try {
    *body = json::parse(req.body);
  } catch (const json::parse_error& e) {
    return Invalid("body", absl::StrCat("not JSON: ", e.what()));
  }
  if (!body->is_object()) return Invalid("body", "expected a JSON object");
  const std::string& name = (*served)->model().config().name;
  if (body->contains("model") && !(*body)["model"].is_null()) {
    const json& m = (*body)["model"];
    if (!m.is_string()) return Invalid("model", "expected the served model's name (GET /v1/models)");
    // An adapter shares its base's tokenizer.
    if (m.get<std::string>() != name && !(*served)->HasAdapter(m.get<std::string>())) {
      return ModelNotFound(m.get<std::string>(), **served);
    }
  }
  return std::nullopt;
}

}  // namespace

void OpenAiApi::Tokenize(const httplib::Request& req, httplib::Response& res) {
  json body;
  const Engine* served = nullptr;
  if (auto e = ReadTokenizerBody(req, path_->options().auth_token, path_, &body, &served)) return ReplyError(res, *e);
  const ModelConfig& c = served->model().config();
  if (!body.contains("prompt") || !body["prompt"].is_string()) {
    return ReplyError(res, Invalid("prompt", "expected the text to tokenize (a string)"));
  }
  const std::string& text = body["prompt"].get_ref<const std::string&>();
  if (static_cast<int64_t>(text.size()) > path_->options().max_prompt_bytes) {
    return ReplyError(res, Invalid("prompt", absl::StrCat(text.size(), " bytes; allowed at most ",
                                                          path_->options().max_prompt_bytes, " (--max_prompt_bytes)")));
  }
  bool special = true;
  if (body.contains("add_special_tokens") && !body["add_special_tokens"].is_null()) {
    if (!body["add_special_tokens"].is_boolean()) {
      return ReplyError(res, Invalid("add_special_tokens", "expected true or false"));
    }
    special = body["add_special_tokens"].get<bool>();
  }
  bool strs = false;
  if (body.contains("return_token_strs") && !body["return_token_strs"].is_null()) {
    if (!body["return_token_strs"].is_boolean()) {
      return ReplyError(res, Invalid("return_token_strs", "expected true or false"));
    }
    strs = body["return_token_strs"].get<bool>();
  }
  // As a completion's text prompt becomes ids (server/validation.cc): the BOS first where the model
  // puts one before text.
  if (absl::Status st = served->tokenizer().Check(text); !st.ok()) {
    return ReplyError(res, Invalid("prompt", std::string(st.message())));
  }
  std::vector<int32_t> ids;
  if (special && c.bos_token_id >= 0 && c.bos_before_text) ids.push_back(c.bos_token_id);
  for (int32_t t : served->tokenizer().Encode(text)) ids.push_back(t);
  json out{{"count", ids.size()}, {"max_model_len", c.max_seq_len}, {"tokens", ids}, {"token_strs", nullptr}};
  if (strs) {
    json pieces = json::array();
    for (int32_t t : ids) pieces.push_back(served->tokenizer().TokenText(t));
    out["token_strs"] = std::move(pieces);
  }
  Reply(res, 200, out);
}

void OpenAiApi::Detokenize(const httplib::Request& req, httplib::Response& res) {
  json body;
  const Engine* served = nullptr;
  if (auto e = ReadTokenizerBody(req, path_->options().auth_token, path_, &body, &served)) return ReplyError(res, *e);
  const int vocab = served->model().config().vocab_size;
  if (!body.contains("tokens") || !body["tokens"].is_array()) {
    return ReplyError(res, Invalid("tokens", "expected an array of token ids"));
  }
  std::vector<int32_t> ids;
  for (const json& t : body["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return ReplyError(res, Invalid("tokens", absl::StrCat(t.dump(), "; allowed integers 0..", vocab - 1)));
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  // Special tokens keep their text, as a Hugging Face tokenizer's decode does by default.
  Reply(res, 200, json{{"prompt", served->tokenizer().Decode(ids, /*skip_special_tokens=*/false)}});
}

void OpenAiApi::Models(const httplib::Request& req, httplib::Response& res) {
  if (grpc::Status auth = CheckAuth(req, path_->options().auth_token); !auth.ok()) {
    return ReplyError(res, FromStatus(auth));
  }
  Engine* engine = path_->engine();
  if (engine == nullptr) return ReplyError(res, ApiError{grpc::StatusCode::UNAVAILABLE, "the model is loading", "", ""});
  const ModelConfig& c = engine->model().config();
  json model{{"id", c.name}, {"object", "model"}, {"created", created_}, {"owned_by", "relgen"},
             {"root", c.name}, {"parent", nullptr}, {"max_model_len", c.max_seq_len}};
  json data = json::array({std::move(model)});
  // Each LoRA adapter as a model of its own whose parent is the base (vLLM's shape).
  for (const auto& a : engine->adapters()) {
    data.push_back(json{{"id", a->name}, {"object", "model"}, {"created", created_}, {"owned_by", "relgen"},
                        {"root", a->dir}, {"parent", c.name}, {"max_model_len", c.max_seq_len}});
  }
  Reply(res, 200, json{{"object", "list"}, {"data", std::move(data)}});
}

namespace {

// The body as a Completion for the served model.
std::optional<ApiError> ReadCompletion(const httplib::Request& req, const Engine& served, Completion* c) {
  const ModelConfig& config = served.model().config();
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::parse_error& e) {
    return Invalid("body", absl::StrCat("not JSON: ", e.what()));
  }
  if (auto e = ParseCompletion(body, c)) return e;
  if (c->model == config.name) return std::nullopt;
  // A LoRA adapter's name (vLLM's convention): the base under that adapter.
  if (served.HasAdapter(c->model)) {
    c->base.set_adapter(c->model);
    return std::nullopt;
  }
  return ModelNotFound(c->model, served);
}

// One GenerateRequest per prompt: the request a gRPC client would send for it.
std::vector<v1::GenerateRequest> ToRequests(const Completion& c) {
  std::vector<v1::GenerateRequest> out;
  for (const Prompt& p : c.prompts) {
    v1::GenerateRequest& r = out.emplace_back(c.base);
    if (p.is_text) {
      r.set_text(p.text);
    } else {
      r.mutable_token_ids()->mutable_ids()->Add(p.ids.begin(), p.ids.end());
    }
  }
  return out;
}

// A refusal by the request path; with several prompts, the one refused is named.
ApiError Refusal(const absl::Status& s, int refused, size_t prompts) {
  ApiError e = FromStatus(s);
  if (refused >= 0 && prompts > 1) e.message = absl::StrCat("prompt[", refused, "]: ", e.message);
  return e;
}

// Lays out the call's choices over what the path admitted, one admission per prompt.
void LayOut(const Completion& c, std::vector<RequestPath::Admission> admitted, Call* call) {
  const bool truncate = c.base.has_truncate_prompt_tokens();
  call->prompts.resize(admitted.size());
  for (size_t i = 0; i < admitted.size(); ++i) {
    PromptState& p = call->prompts[i];
    p.admission = std::move(admitted[i]);
    if (c.echo) {
      // The prompt as given; a truncated one (truncate_prompt_tokens) as kept.
      p.echo_text = c.prompts[i].is_text && !truncate ? c.prompts[i].text : call->tok->Decode(p.admission.prompt);
    }
    for (size_t j = 0; j < p.admission.handles.size(); ++j) {
      Choice ch;
      ch.index = static_cast<int>(call->choices.size());
      ch.prompt = static_cast<int>(i);
      ch.sample = static_cast<int>(j);
      ch.handle = p.admission.handles[j];
      ch.logprobs = std::make_unique<Logprobs>(call->tok);
      call->choices.push_back(std::move(ch));
    }
  }
  call->id = "cmpl-" + call->prompts[0].admission.request_id;
}

void ReplyUnary(Call& call, httplib::Response& res) {
  // Samples in order: sample 0 delivers its prompt's log-probabilities before the others need them.
  for (Choice& ch : call.choices) {
    Output o;
    while (!ch.done && ch.handle->Next(&o)) {
      if (grpc::Status s = call.Take(ch, o); !s.ok()) {
        call.Book(s.error_code());
        call.CancelAll();
        return ReplyError(res, FromStatus(s));
      }
    }
  }
  json choices = json::array();
  for (Choice& ch : call.choices) choices.push_back(call.ChoiceJson(ch));
  json out = call.Envelope(std::move(choices));
  out["usage"] = call.Usage();
  Reply(res, 200, out);
}

// A stream's writer: each poll writes what its choices have delivered, in turns, and the end.
class StreamWriter {
 public:
  StreamWriter(std::shared_ptr<Call> call, double timeout_s, Metrics* metrics)
      : call_(std::move(call)), wakeup_(std::make_shared<Wakeup>()), timeout_s_(timeout_s), metrics_(metrics) {
    for (Choice& ch : call_->choices) ch.handle->SetListener([w = wakeup_] { w->Notify(); });
  }
  // httplib's content provider: false ends the response unfinished.
  bool Poll(httplib::DataSink& sink) {
    bool any = false;
    const size_t k = call_->choices.size();
    for (size_t step = 0; step < k; ++step) {
      Choice& ch = call_->choices[(next_ + step) % k];
      if (ch.done || !call_->Ready(ch)) continue;
      Output o;
      if (!ch.handle->Next(&o, absl::ZeroDuration())) continue;
      any = true;
      next_ = ch.index + 1;  // the choice whose turn it is: a fast one cannot starve the others
      if (grpc::Status s = call_->Take(ch, o); !s.ok()) {
        call_->Book(s.error_code());
        call_->CancelAll();
        return Write(sink, "data: " + Dump(ErrorBody(FromStatus(s))) + "\n\ndata: [DONE]\n\n") && Finish(sink);
      }
      json chunk = call_->Envelope(json::array({call_->ChoiceJson(ch)}));
      if (call_->include_usage) chunk["usage"] = nullptr;
      if (!Write(sink, "data: " + Dump(chunk) + "\n\n")) return false;
    }
    bool all_done = true;
    for (const Choice& ch : call_->choices) all_done &= ch.done;
    if (all_done) {
      std::string tail;
      if (call_->include_usage) {
        json usage = call_->Envelope(json::array());
        usage["usage"] = call_->Usage();
        tail = "data: " + Dump(usage) + "\n\n";
      }
      return Write(sink, tail + "data: [DONE]\n\n") && Finish(sink);
    }
    // Nothing readable: wait for the engine, a second at most, so the listener checks the
    // connection and its own shutdown between waits.
    if (!any) wakeup_->Wait(std::chrono::milliseconds(1000));
    return true;
  }
  // The response is over, written or not: a call cut short (the client left, the listener
  // stopped) is cancelled and booked; ~Call frees its requests.
  void Release() {
    if (!call_->done) {
      call_->CancelAll();
      call_->Book(grpc::StatusCode::CANCELLED);
    }
  }

 private:
  bool Write(httplib::DataSink& sink, const std::string& event) {
    const auto start = std::chrono::steady_clock::now();
    if (sink.write(event.data(), event.size())) return true;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_s_ > 0 && waited >= 0.9 * timeout_s_) metrics_->OnStreamWriteTimeout();
    call_->CancelAll();
    call_->Book(grpc::StatusCode::CANCELLED);
    return false;
  }
  bool Finish(httplib::DataSink& sink) {
    call_->done = true;
    sink.done();
    return true;
  }

  std::shared_ptr<Call> call_;
  std::shared_ptr<Wakeup> wakeup_;
  double timeout_s_;
  Metrics* metrics_;
  size_t next_ = 0;
};

}  // namespace

void OpenAiApi::Completions(const httplib::Request& req, httplib::Response& res) {
  const Options& o = path_->options();
  RequestPath::Caller caller;
  caller.api = Api::kHttp;
  caller.auth = CheckAuth(req, o.auth_token);
  if (o.http_request_timeout_seconds > 0) caller.deadline = absl::Now() + absl::Seconds(o.http_request_timeout_seconds);
  Completion c;
  const Engine* engine = nullptr;
  std::optional<ApiError> bad_body;  // the body's own refusal, with OpenAI's param and code
  auto read = [&](const Engine& served, std::vector<v1::GenerateRequest>* requests) {
    engine = &served;
    bad_body = ReadCompletion(req, served, &c);
    if (bad_body) return absl::Status(static_cast<absl::StatusCode>(bad_body->code), bad_body->message);
    *requests = ToRequests(c);
    return absl::OkStatus();
  };
  std::vector<RequestPath::Admission> admitted;
  int refused = -1;
  if (absl::Status s = path_->Admit(read, caller, &admitted, &refused); !s.ok()) {
    return ReplyError(res, bad_body ? *bad_body : Refusal(s, refused, c.prompts.size()));
  }

  auto call = std::make_shared<Call>();
  call->path = path_;
  call->metrics = metrics_;
  call->tok = &engine->tokenizer();
  call->model = c.model;
  call->created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  call->echo = c.echo;
  call->logprobs = c.logprobs;
  call->include_usage = c.include_usage;
  LayOut(c, std::move(admitted), call.get());
  if (!c.stream) return ReplyUnary(*call, res);
  auto writer = std::make_shared<StreamWriter>(call, o.stream_write_timeout_seconds, metrics_);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream", [writer](size_t, httplib::DataSink& sink) { return writer->Poll(sink); },
      [writer](bool) { writer->Release(); });
}

}  // namespace relgen::server
