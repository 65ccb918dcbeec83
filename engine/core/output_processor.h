// A generating sequence's text: its tokens through the detokeniser, held back while the text may
// still grow into a stop string, and the end of generation (a stop string, EOS, a stop token id,
// max_new_tokens). The engine feeds each drawn token in and delivers what comes back; nothing here
// touches the engine, so the rules can be tested on their own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/core/request.h"
#include "engine/tokenizers/tokenizer.h"

namespace relgen {

// What one token adds.
struct TextDelta {
  // Text the client may see now: earlier held-back text and this token's, less what is held back
  // because it may begin a stop string (and, at a stop string, cut before it).
  std::string text;
  // The detokeniser's output for this token (at the end, with what the detokeniser held back):
  // the text this token added, before any holdback or cut.
  std::string piece;
  FinishReason finish = FinishReason::kNone;  // kNone: generation goes on
};

class TextStream {
 public:
  // `min_tokens`: stop strings count from the min_tokens-th token on (before it a stop string may
  // appear in the text and is ignored; the sampler bans EOS and the stop ids there).
  // `eos_token_id` < 0: the model has none.
  TextStream(std::unique_ptr<StreamDecoder> detok, StopCriteria stop, int min_tokens, int32_t eos_token_id);

  // The next generated token. After a finish, no more tokens may be appended.
  TextDelta Append(int32_t token);
  // Ends the text without a token (every token was banned): everything held back, and what the
  // detokeniser held.
  std::string Flush();
  int tokens() const { return tokens_; }

 private:
  // The longest tail of held_ that could still grow into a stop string.
  size_t Holdback() const;

  std::unique_ptr<StreamDecoder> detok_;
  StopCriteria stop_;
  int min_tokens_;
  int32_t eos_;
  int tokens_ = 0;    // appended so far
  std::string held_;  // decoded text not yet released: it may begin a stop string
};

}  // namespace relgen
