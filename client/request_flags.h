// relgen-client's command line: one flag per GenerateRequest field (and ScoreRequest field for the
// score command), parsed without globals so the mapping can be tested. Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "relgen/v1/generation.pb.h"

namespace relgen::client {

struct ClientOptions {
  std::string command;  // generate | score | info | health
  bool help = false;    // --help (where a flag may stand), or -h / help as the command: Usage(), exit 0
  std::string server = "localhost:50051";
  bool stream = false;
  bool json = false;
  double timeout_seconds = 0;  // 0: no deadline
  std::string tls_ca;          // PEM roots: connect with TLS
  bool prompt_given = false;   // --prompt, --token_ids or positional words (score: the context)
  // Chorale models (client/chorale_grid.h): the prompt from a MIDI file, the result written to one.
  std::string midi_in;
  std::string midi_out;
  bool harmonize = false;  // --midi_in's first voice is the soprano; the model fills the other three
  int midi_tempo = 80;     // beats per minute in --midi_out
  v1::GenerateRequest request;
  v1::ScoreRequest score;      // the score command's request
};

// Flag -> the GenerateRequest field it sets (field names as in the proto).
struct FieldFlag {
  const char* flag;
  const char* field;
  const char* help;
};
const std::vector<FieldFlag>& RequestFlags();
// The score command's flags -> ScoreRequest fields (--continuation and --continuation_token_ids both
// add to continuations).
const std::vector<FieldFlag>& ScoreFlags();

// Parses argv (without the program name). Positional words after the command form the prompt
// (score: the context).
// Returns an empty string on success, else what is wrong (for a usage message). --help where a flag
// may stand wins over the rest of the line, so `relgen-client generate --help` answers rather than
// generates; "help" after the command is a prompt word like any other.
std::string ParseArgs(const std::vector<std::string>& args, ClientOptions* out);

std::string Usage();

}  // namespace relgen::client
