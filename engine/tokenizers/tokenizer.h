// Tokenizers: byte-level (ids 0..255 are the bytes; ids above are special and decode to nothing),
// SentencePiece, byte-level BPE (Hugging Face tokenizer.json), and word-level (a vocabulary file of
// whitespace-free words; text is words separated by whitespace). Decoding never splits a UTF-8
// character: a stream holds bytes back until the character is complete, and replaces invalid or truncated sequences by U+FFFD (one per maximal
// invalid subpart, as the Unicode standard recommends).
// Thread-safety: a Tokenizer is immutable and shareable; a StreamDecoder belongs to one sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/model/config.h"

namespace relgen {

class StreamDecoder {
 public:
  virtual ~StreamDecoder() = default;
  // Adds one generated token; returns the text it completes (possibly empty).
  virtual std::string Push(int32_t id) = 0;
  // Ends the stream; returns what was held back (U+FFFD for an incomplete character).
  virtual std::string Finish() = 0;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> Encode(absl::string_view text) const = 0;
  // Whether Encode can represent `text` (INVALID_ARGUMENT naming what it cannot); every text is
  // encodable except by the word-level tokenizer, which has no unknown-word token.
  virtual absl::Status Check(absl::string_view text) const;
  virtual std::unique_ptr<StreamDecoder> NewStream() const = 0;
  // A stream that writes special tokens' text too, as transformers' skip_special_tokens=False
  // does (the byte-level tokenizer's special ids have no text: the same as NewStream()).
  virtual std::unique_ptr<StreamDecoder> NewStreamWithSpecials() const { return NewStream(); }
  // Text of a whole id sequence: the concatenation of a stream's outputs.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens = true) const;
  // A display string for one token (logprob alternatives), invalid UTF-8 escaped as \xNN.
  virtual std::string TokenText(int32_t id) const = 0;
};

std::unique_ptr<Tokenizer> NewByteTokenizer();
// `extra_ids` T5 sentinels <extra_id_N> sit right above the model's pieces (extra_id_0 highest);
// `append_eos` >= 0 ends every encoded text with that id.
absl::StatusOr<std::unique_ptr<Tokenizer>> NewSentencePieceTokenizer(const std::string& path,
                                                                     int vocab_size, int extra_ids = 0,
                                                                     int32_t append_eos = -1);
// A byte-level BPE tokenizer from a Hugging Face `tokenizer.json` (engine/tokenizers/bpe_tokenizer.cc).
// Invalid UTF-8 input is made valid first (see bpe_tokenizer.h for the contract).
absl::StatusOr<std::unique_ptr<Tokenizer>> NewBpeTokenizer(const std::string& path, int vocab_size);
// A word-level tokenizer: `path` holds one word per line, the line's number (from 0) its id; a word
// is non-empty and has no whitespace, and no word appears twice. Encode splits on ASCII whitespace;
// a stream writes the words separated by one space. `special_ids` (the model's BOS, EOS and PAD)
// decode to nothing unless specials are kept.
absl::StatusOr<std::unique_ptr<Tokenizer>> NewWordTokenizer(const std::string& path, int vocab_size,
                                                           std::vector<int32_t> special_ids);
// The tokenizer a model's config names (files relative to `model_dir`).
absl::StatusOr<std::unique_ptr<Tokenizer>> NewTokenizer(const ModelConfig& config,
                                                        const std::string& model_dir);

// Incremental UTF-8 validation: bytes in, complete characters (or U+FFFD) out.
class Utf8Assembler {
 public:
  std::string Push(uint8_t byte);
  std::string Finish();

 private:
  std::string pending_;
  int need_ = 0;  // continuation bytes still expected
  uint8_t lo_ = 0x80, hi_ = 0xBF;  // allowed range of the next continuation byte
};

}  // namespace relgen
