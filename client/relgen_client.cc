// relgen-client: generate text, score continuations or read model info from a relgen-server, from
// the shell.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <future>
#include <string>
#include <vector>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/chorale_grid.h"
#include "client/request_flags.h"
#include "relgen/v1/generation.grpc.pb.h"

namespace relgen::client {
namespace {

constexpr int kUsageExit = 64;

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(m, &out, opts).ok()) out = "{}";
  return out;
}

int Failed(const grpc::Status& s, const std::string& server) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::fprintf(stderr, "relgen-client: cannot reach relgen-server at %s: %s\n", server.c_str(), s.error_message().c_str());
  } else {
    std::fprintf(stderr, "relgen-client: %s (status %d)\n", s.error_message().c_str(), static_cast<int>(s.error_code()));
  }
  return static_cast<int>(s.error_code());
}

const char* FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH: return "length";
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_EOS: return "eos";
    default: return "unspecified";
  }
}

// "id 72 'H' -1.2345", the text quoted when known.
std::string TokenLine(int32_t id, float logprob, const std::string& text) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6f", logprob);
  return "id " + std::to_string(id) + (text.empty() ? "" : " '" + text + "'") + " " + buf;
}

// One line per token: its id and log-probability, then the alternatives when asked.
void PrintTokenInfos(const google::protobuf::RepeatedPtrField<v1::TokenInfo>& infos, const std::string& label,
                     int first_position) {
  for (int i = 0; i < infos.size(); ++i) {
    const v1::TokenInfo& t = infos[i];
    std::string text;  // the chosen token's text, when it is among the alternatives
    for (const auto& a : t.top_logprobs()) {
      if (a.token_id() == t.token_id()) text = a.text();
    }
    std::string line =
        "  " + label + " " + std::to_string(first_position + i) + ": " + TokenLine(t.token_id(), t.logprob(), text);
    if (t.top_logprobs_size() > 0) {
      line += "  [";
      for (int j = 0; j < t.top_logprobs_size(); ++j) {
        const auto& a = t.top_logprobs(j);
        line += (j > 0 ? ", " : "") + TokenLine(a.token_id(), a.logprob(), a.text());
      }
      line += "]";
    }
    std::printf("%s\n", line.c_str());
  }
}

void PrintPromptLogprobs(const google::protobuf::RepeatedPtrField<v1::TokenInfo>& infos) {
  if (infos.empty()) return;
  std::printf("prompt log-probabilities (position: token, log-probability):\n");
  PrintTokenInfos(infos, "prompt", 1);
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

// --midi_in: the prompt's grid (its four voices; --harmonize: its first voice alone, the melody).
absl::StatusOr<grid::Grid> PromptGrid(const ClientOptions& o) {
  std::string bytes;
  if (!ReadFile(o.midi_in, &bytes)) return absl::NotFoundError("cannot read --midi_in " + o.midi_in);
  absl::StatusOr<std::vector<grid::Voice>> voices = grid::ReadMidiVoices(bytes);
  if (!voices.ok()) return absl::InvalidArgumentError(o.midi_in + ": " + std::string(voices.status().message()));
  if (o.harmonize) {
    voices->resize(grid::kVoices);  // the melody, three empty voices
    for (int i = 1; i < grid::kVoices; ++i) (*voices)[i].clear();
  } else if (voices->size() > grid::kVoices) {
    std::fprintf(stderr, "relgen-client: %s has %zu voices; the first %d are the prompt\n", o.midi_in.c_str(),
                 voices->size(), grid::kVoices);
    voices->resize(grid::kVoices);
  }
  absl::StatusOr<grid::Grid> g = grid::GridOfVoices(*voices);
  if (!g.ok()) return absl::InvalidArgumentError(o.midi_in + ": " + std::string(g.status().message()));
  return g;
}

// The prompt and what followed it, as grid words -> --midi_out. (A prompt given as token ids has no
// words here: the file holds the continuation alone.)
int WriteMidiOut(const ClientOptions& o, const std::string& prompt, const std::string& continuation) {
  int filled = 0;
  absl::StatusOr<grid::Grid> g = grid::GridOfWords(prompt + " " + continuation, &filled);
  absl::StatusOr<grid::Grid> p = grid::GridOfWords(prompt);
  if (!g.ok() || !p.ok()) {
    if (g.ok()) g = p.status();
    std::fprintf(stderr, "relgen-client: --midi_out: %s (is this a chorale model?)\n",
                 std::string(g.status().message()).c_str());
    return kUsageExit;
  }
  std::ofstream out(o.midi_out, std::ios::binary);
  const std::string bytes = grid::WriteMidi(*g, o.midi_tempo);
  if (!out || !out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())) || !out.flush()) {
    std::fprintf(stderr, "relgen-client: cannot write --midi_out %s\n", o.midi_out.c_str());
    return kUsageExit;
  }
  std::fprintf(stderr, "[wrote %s: %zu steps of four voices, %zu from the prompt]\n", o.midi_out.c_str(), g->size(),
               p->size());
  if (filled > 0) {
    std::fprintf(stderr, "[%d times a step had no word for a voice; that voice went on as it was]\n", filled);
  }
  return 0;
}

std::unique_ptr<grpc::ClientContext> Context(const ClientOptions& o) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (o.timeout_seconds > 0) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::microseconds(static_cast<int64_t>(o.timeout_seconds * 1e6)));
  }
  return ctx;
}

// The ids of grid words, read from the server (the tokens Score reports for the words, scored after
// the model's BOS), so the client needs no copy of the model's vocabulary. Words that are not one
// token each mean this is no chorale model.
absl::StatusOr<std::vector<int32_t>> WordIds(const ClientOptions& o, v1::GenerationService::Stub* stub,
                                             const std::vector<std::string>& words) {
  auto failed = [](const grpc::Status& s) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  };
  v1::ModelInfo info;
  if (grpc::Status s = stub->GetModelInfo(Context(o).get(), v1::GetModelInfoRequest(), &info); !s.ok()) {
    return failed(s);
  }
  if (info.bos_token_id() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", info.name(), " has no BOS token; a chorale model (models/chorales) starts with one"));
  }
  v1::ScoreRequest request;
  request.mutable_token_ids()->add_ids(info.bos_token_id());
  request.add_continuations()->set_text(absl::StrJoin(words, " "));
  v1::ScoreResponse ids;
  if (grpc::Status s = stub->Score(Context(o).get(), request, &ids); !s.ok()) return failed(s);
  if (ids.scores_size() != 1 || ids.scores(0).logprobs_size() != static_cast<int>(words.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", info.name(), "'s tokenizer makes the ", words.size(), " grid words ",
        ids.scores_size() == 1 ? ids.scores(0).logprobs_size() : 0,
        " tokens; a chorale model (models/chorales) has one token per grid word"));
  }
  std::vector<int32_t> out;
  for (const auto& lp : ids.scores(0).logprobs()) out.push_back(lp.token_id());
  return out;
}

int WordIdsFailed(const absl::Status& s, const ClientOptions& o) {
  std::fprintf(stderr, "relgen-client: %s%s\n", s.code() == absl::StatusCode::kUnavailable ? "cannot reach relgen-server: " : "",
               std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? kUsageExit : static_cast<int>(s.code());
}

// --harmonize: for each step the melody's word is appended to the context, then the model samples
// the alto's word with only alto words allowed, then the tenor's, then the bass's.
int Harmonize(const ClientOptions& o, v1::GenerationService::Stub* stub, const grid::Grid& melody) {
  std::vector<std::vector<int32_t>> allowed(grid::kVoices);
  for (int v = 1; v < grid::kVoices; ++v) {
    absl::StatusOr<std::vector<int32_t>> ids = WordIds(o, stub, grid::VoiceWords(v));
    if (!ids.ok()) return WordIdsFailed(ids.status(), o);
    allowed[v] = *std::move(ids);
  }
  std::string context;  // after the model's BOS, which the server puts first
  for (size_t step = 0; step < melody.size(); ++step) {
    std::string words = grid::Word(0, melody[step][0]);
    context += (step == 0 ? "" : " ") + words;
    for (int v = 1; v < grid::kVoices; ++v) {
      v1::GenerateRequest r = o.request;
      r.set_text(context);
      r.set_max_new_tokens(1);
      r.set_ignore_eos(true);
      r.clear_allowed_token_ids();
      for (int32_t id : allowed[v]) r.add_allowed_token_ids(id);
      // Reproducible, and not the same draw at every place.
      if (o.request.has_seed()) r.set_seed(o.request.seed() + grid::kVoices * step + v);
      v1::GenerateResponse resp;
      if (grpc::Status s = stub->Generate(Context(o).get(), r, &resp); !s.ok()) return Failed(s, o.server);
      const std::string word(absl::StripAsciiWhitespace(resp.text()));
      if (resp.token_ids_size() != 1 || word.rfind(grid::Word(v, ""), 0) != 0) {
        std::fprintf(stderr, "relgen-client: --harmonize: step %zu: expected one %s word, got '%s'\n", step,
                     grid::Word(v, "").c_str(), resp.text().c_str());
        return kUsageExit;
      }
      context += " " + word;
      words += " " + word;
    }
    if (o.stream) {
      std::printf("%s\n", words.c_str());
      std::fflush(stdout);
    }
  }
  if (!o.stream) std::printf("%s\n", context.c_str());
  return o.midi_out.empty() ? 0 : WriteMidiOut(o, context, "");
}

int Main(int argc, char** argv) {
  ClientOptions o;
  const std::string error = ParseArgs(std::vector<std::string>(argv + 1, argv + argc), &o);
  if (!error.empty()) {
    std::fprintf(stderr, "relgen-client: %s\n\n%s", error.c_str(), Usage().c_str());
    return kUsageExit;
  }
  if (o.help) {
    std::fputs(Usage().c_str(), stdout);
    return 0;
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!o.tls_ca.empty()) {
    std::ifstream in(o.tls_ca);
    if (!in) {
      std::fprintf(stderr, "relgen-client: cannot read --tls_ca %s\n", o.tls_ca.c_str());
      return kUsageExit;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ss.str();
    creds = grpc::SslCredentials(ssl);
  }
  auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(o.server, creds));
  grpc::ClientContext ctx;
  if (o.timeout_seconds > 0) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::microseconds(static_cast<int64_t>(o.timeout_seconds * 1e6)));
  }

  if (o.command == "midi") {
    if (!o.midi_in.empty()) {
      o.harmonize = false;
      absl::StatusOr<grid::Grid> g = PromptGrid(o);
      if (!g.ok()) {
        std::fprintf(stderr, "relgen-client: %s\n", std::string(g.status().message()).c_str());
        return kUsageExit;
      }
      std::printf("%s\n", grid::PromptWords(*g).c_str());
      return 0;
    }
    if (!o.prompt_given) {
      std::stringstream ss;
      ss << std::cin.rdbuf();
      o.request.set_text(ss.str());
    }
    return WriteMidiOut(o, o.request.text(), "");
  }
  if (o.command == "health") {
    // grpc.health.v1.Health/Check for the whole server (an empty HealthCheckRequest: one empty
    // slice, since gRPC refuses a message with no slices). The reply's field 1 is the status
    // (1 SERVING, 2 NOT_SERVING; absent: UNKNOWN), read from the wire so no health stubs are needed.
    grpc::GenericStub generic(grpc::CreateChannel(o.server, creds));
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1), reply;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &reply,
                      [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status s = done.get_future().get();
    if (!s.ok()) return Failed(s, o.server);
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (reply.Dump(&slices).ok()) {
      for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
    const int status = bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
    const char* const kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
    std::printf("%s\n", status >= 0 && status <= 3 ? kNames[status] : "UNKNOWN");
    return status == 1 ? 0 : 1;
  }
  if (o.command == "info") {
    v1::ModelInfo info;
    const grpc::Status s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
    if (!s.ok()) return Failed(s, o.server);
    if (o.json) {
      std::printf("%s\n", Json(info).c_str());
    } else {
      std::printf("model %s: %s relative attention, %d layers, d_model %d, %d heads x %d, ffn %d, vocab %d, "
                  "context %d, %lld parameters (%s), tokenizer %s, on %s, KV cache %lld tokens; %s from %s%s\n",
                  info.name().c_str(), info.relative_attention().scheme().c_str(), info.n_layers(), info.d_model(),
                  info.n_heads(), info.head_dim(), info.ffn_dim(), info.vocab_size(), info.max_seq_len(),
                  static_cast<long long>(info.num_parameters()), info.weights_dtype().c_str(), info.tokenizer().c_str(),
                  info.device().c_str(), static_cast<long long>(info.kv_cache_tokens()), info.architecture().c_str(),
                  info.source().c_str(),
                  info.encoder_decoder()
                      ? ("; encoder-decoder, " + std::to_string(info.n_encoder_layers()) + " encoder layers").c_str()
                      : "");
    }
    return 0;
  }

  if (!o.midi_in.empty()) {
    absl::StatusOr<grid::Grid> g = PromptGrid(o);
    if (!g.ok()) {
      std::fprintf(stderr, "relgen-client: %s\n", std::string(g.status().message()).c_str());
      return kUsageExit;
    }
    if (o.harmonize) return Harmonize(o, stub.get(), *g);
    o.request.set_text(grid::PromptWords(*g));
  }
  if (!o.midi_out.empty() && o.request.allowed_token_ids_size() == 0) {
    // A piece's words only: BOS or PAD mid-piece would shift the voices; EOS may end it.
    std::vector<std::string> words = grid::StepWords();
    words.push_back("EOS");
    absl::StatusOr<std::vector<int32_t>> allowed = WordIds(o, stub.get(), words);
    if (!allowed.ok()) return WordIdsFailed(allowed.status(), o);
    for (int32_t id : *allowed) o.request.add_allowed_token_ids(id);
  }
  if (!o.prompt_given) {
    std::stringstream ss;
    ss << std::cin.rdbuf();
    (o.command == "score" ? o.score.mutable_text() : o.request.mutable_text())->assign(ss.str());
  }
  if (o.command == "score") {
    v1::ScoreResponse resp;
    const grpc::Status s = stub->Score(&ctx, o.score, &resp);
    if (!s.ok()) return Failed(s, o.server);
    if (o.json) {
      std::printf("%s\n", Json(resp).c_str());
      return 0;
    }
    for (int i = 0; i < resp.scores_size(); ++i) {
      const v1::ContinuationScore& c = resp.scores(i);
      const v1::Continuation& asked = o.score.continuations(i);
      std::printf("continuation %d%s: sum %.6f over %d tokens\n", i,
                  asked.has_text() ? (" '" + asked.text() + "'").c_str() : "", c.sum_logprob(), c.logprobs_size());
      PrintTokenInfos(c.logprobs(), "token", 0);
    }
    return 0;
  }
  const int n = o.request.has_n() ? o.request.n() : 1;
  if (!o.stream) {
    v1::GenerateResponse resp;
    const grpc::Status s = stub->Generate(&ctx, o.request, &resp);
    if (!s.ok()) return Failed(s, o.server);
    if (!o.midi_out.empty()) {
      const std::string text = resp.samples().empty() ? resp.text() : resp.samples(0).text();
      if (o.json) {
        std::printf("%s\n", Json(resp).c_str());
      } else {
        std::printf("%s\n", text.c_str());
      }
      return WriteMidiOut(o, o.request.text(), text);
    }
    if (o.json) {
      std::printf("%s\n", Json(resp).c_str());
    } else {
      PrintPromptLogprobs(resp.prompt_logprobs());
      if (resp.samples().empty()) {
        std::printf("%s\n", resp.text().c_str());
      } else {
        for (const v1::Sample& sample : resp.samples()) {
          std::printf("--- sample %d (%s, %d tokens%s)\n%s\n", sample.index(), FinishName(sample.finish_reason()),
                      sample.generated_tokens(),
                      o.request.num_beams() > 1 ? (", score " + std::to_string(sample.beam_score())).c_str() : "",
                      sample.text().c_str());
        }
      }
    }
    return 0;
  }
  auto reader = stub->GenerateStream(&ctx, o.request);
  v1::GenerateStreamResponse m;
  std::vector<std::string> texts(std::max(n, 1));  // n > 1: each sample's text until it is done
  std::string streamed;                           // --midi_out: the continuation so far
  while (reader->Read(&m)) {
    streamed += m.text_delta();
    if (o.json) {
      std::printf("%s\n", Json(m).c_str());
    } else {
      PrintPromptLogprobs(m.prompt_logprobs());
      const bool done = m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
      if (n <= 1) {
        std::fwrite(m.text_delta().data(), 1, m.text_delta().size(), stdout);
        if (done) std::printf("\n");
      } else if (m.sample_index() >= 0 && m.sample_index() < n) {
        // Interleaved samples would be unreadable: each is printed whole once it is done.
        std::string& text = texts[m.sample_index()];
        text += m.text_delta();
        if (done) {
          std::printf("--- sample %d (%s, %d tokens)\n%s\n", m.sample_index(), FinishName(m.finish_reason()),
                      m.usage().generated_tokens(), text.c_str());
          text.clear();
        }
      }
      if (done) {
        std::fprintf(stderr, "[%s%s: %d prompt + %d generated tokens, first token %.3f s, total %.3f s]\n",
                     n > 1 ? ("sample " + std::to_string(m.sample_index()) + " ").c_str() : "",
                     FinishName(m.finish_reason()), m.usage().prompt_tokens(), m.usage().generated_tokens(),
                     m.timing().time_to_first_token_seconds(), m.timing().total_seconds());
      }
    }
    std::fflush(stdout);
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) {
    std::printf("\n");
    return Failed(s, o.server);
  }
  if (!o.midi_out.empty()) return WriteMidiOut(o, o.request.text(), streamed);
  return 0;
}

}  // namespace
}  // namespace relgen::client

int main(int argc, char** argv) { return relgen::client::Main(argc, argv); }
