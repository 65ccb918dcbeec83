#include "engine/tokenizers/tokenizer.h"

#include <algorithm>
#include <fstream>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/tokenizers/sentencepiece_wrapper.h"

namespace relgen {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

bool ValidUtf8(absl::string_view s) {
  Utf8Assembler a;
  std::string out;
  for (char c : s) out += a.Push(static_cast<uint8_t>(c));
  out += a.Finish();
  return out == s;
}

std::string Escaped(absl::string_view s) {
  if (ValidUtf8(s)) return std::string(s);
  std::string out;
  for (char c : s) {
    const auto b = static_cast<uint8_t>(c);
    out += b < 0x80 ? std::string(1, c) : absl::StrFormat("\\x%02X", b);
  }
  return out;
}

class ByteStream final : public StreamDecoder {
 public:
  std::string Push(int32_t id) override {
    return id >= 0 && id < 256 ? utf8_.Push(static_cast<uint8_t>(id)) : std::string();
  }
  std::string Finish() override { return utf8_.Finish(); }

 private:
  Utf8Assembler utf8_;
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(absl::string_view text) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size());
    for (char c : text) ids.push_back(static_cast<uint8_t>(c));
    return ids;
  }
  std::unique_ptr<StreamDecoder> NewStream() const override { return std::make_unique<ByteStream>(); }
  std::string TokenText(int32_t id) const override {
    if (id >= 0 && id < 256) return Escaped(std::string(1, static_cast<char>(id)));
    return absl::StrCat("<", id, ">");
  }
};

// Streams SentencePiece text by decoding a short window of recent ids and emitting what it adds
// once it no longer ends in an incomplete character. SentencePiece drops all leading whitespace of
// what it decodes, so each window is decoded behind a fixed anchor piece and the anchor's text cut
// off; as T5's fast tokenizer does, only the first piece of the output loses its leading spaces.
// Control pieces and <unk> decode to nothing (transformers' skip_special_tokens), or, kept, to
// their piece's text as a sentinel does.
class SentencePieceStream final : public StreamDecoder {
 public:
  SentencePieceStream(const SentencePieceModel* sp, int extra_ids, int anchor, bool keep_special)
      : sp_(sp), extra_ids_(extra_ids), anchor_(anchor), keep_special_(keep_special) {}

  std::string Push(int32_t id) override {
    const int pieces = sp_->size();
    if (id < 0 || id >= pieces) {
      // A sentinel is text of its own (the window restarts after it); other ids above the model's
      // pieces (vocabulary padding) decode to nothing.
      if (id < pieces || id >= pieces + extra_ids_) return "";
      return Restart(absl::StrCat("<extra_id_", pieces + extra_ids_ - 1 - id, ">"));
    }
    if (sp_->IsSpecial(id)) return keep_special_ ? Restart(sp_->Piece(id)) : "";
    if (first_) {
      first_ = false;
      const std::string text = sp_->Piece(id);
      absl::string_view piece = text;
      while (absl::ConsumePrefix(&piece, kSpaceMark)) ++strip_;
    }
    ids_.push_back(id);
    const std::string prefix = DecodeRange(prefix_offset_, read_offset_);
    const std::string text = DecodeRange(prefix_offset_, ids_.size());
    if (text.size() <= prefix.size() || absl::EndsWith(text, kReplacement)) return "";
    prefix_offset_ = read_offset_;
    read_offset_ = ids_.size();
    return Emit(text.substr(prefix.size()));
  }
  std::string Finish() override {
    const std::string prefix = DecodeRange(prefix_offset_, read_offset_);
    const std::string text = DecodeRange(prefix_offset_, ids_.size());
    prefix_offset_ = read_offset_ = ids_.size();
    return text.size() > prefix.size() ? Emit(text.substr(prefix.size())) : "";
  }

 private:
  static constexpr char kSpaceMark[] = "\xE2\x96\x81";  // U+2581, SentencePiece's space

  // Text of its own (a sentinel, a kept special piece): what was held, the text, and a new window.
  std::string Restart(const std::string& text) {
    std::string out = Finish();
    ids_.clear();
    prefix_offset_ = read_offset_ = 0;
    first_ = false;
    strip_ = 0;
    return out + text;
  }
  std::string DecodeRange(size_t begin, size_t end) const {
    std::vector<int> window;
    if (anchor_ >= 0) window.push_back(anchor_);
    window.insert(window.end(), ids_.begin() + begin, ids_.begin() + end);
    return sp_->Decode(window);
  }
  std::string Emit(std::string text) {
    size_t cut = 0;
    while (strip_ > 0 && cut < text.size() && text[cut] == ' ') ++cut, --strip_;
    text.erase(0, cut);
    if (!text.empty()) strip_ = 0;
    return text;
  }

  const SentencePieceModel* sp_;
  int extra_ids_;
  int anchor_;
  bool keep_special_;
  std::vector<int> ids_;
  size_t prefix_offset_ = 0, read_offset_ = 0;
  bool first_ = true;  // no piece or sentinel seen yet
  int strip_ = 0;      // leading spaces of the first piece still to drop
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(absl::string_view text) const override {
    std::vector<int32_t> out;
    auto encode = [&](absl::string_view segment) {
      if (segment.empty()) return;
      for (int id : sp_->Encode(std::string(segment))) out.push_back(id);
    };
    // Sentinels <extra_id_N> are tokens of their own; the text between them is encoded piecewise.
    size_t from = 0;
    for (size_t at = text.find("<extra_id_"); extra_ids_ > 0 && at != absl::string_view::npos;
         at = text.find("<extra_id_", at + 1)) {
      const size_t close = text.find('>', at);
      int n = -1;
      if (close == absl::string_view::npos || close - at > 14 ||
          !absl::SimpleAtoi(text.substr(at + 10, close - at - 10), &n) || n < 0 || n >= extra_ids_ ||
          !absl::ascii_isdigit(text[at + 10])) {
        continue;
      }
      encode(text.substr(from, at - from));
      out.push_back(sp_->size() + extra_ids_ - 1 - n);
      from = close + 1;
    }
    encode(text.substr(from));
    if (append_eos_ >= 0) out.push_back(append_eos_);
    return out;
  }
  std::unique_ptr<StreamDecoder> NewStream() const override {
    return std::make_unique<SentencePieceStream>(sp_.get(), extra_ids_, anchor_, false);
  }
  std::unique_ptr<StreamDecoder> NewStreamWithSpecials() const override {
    return std::make_unique<SentencePieceStream>(sp_.get(), extra_ids_, anchor_, true);
  }
  std::string TokenText(int32_t id) const override {
    if (id >= sp_->size() && id < sp_->size() + extra_ids_) {
      return absl::StrCat("<extra_id_", sp_->size() + extra_ids_ - 1 - id, ">");
    }
    if (id < 0 || id >= sp_->size()) return absl::StrCat("<", id, ">");
    return Escaped(sp_->Piece(id));
  }

  std::unique_ptr<SentencePieceModel> sp_;
  int extra_ids_ = 0;
  int32_t append_eos_ = -1;
  int anchor_ = -1;  // a piece that decodes to itself with no space: see SentencePieceStream
};

// Words separated by one space; the first word a stream writes has none before it. Special ids
// (BOS, EOS, PAD) write nothing unless kept; an id outside the vocabulary writes nothing.
class WordStream final : public StreamDecoder {
 public:
  WordStream(const std::vector<std::string>* words, const std::vector<bool>* special, bool keep_special)
      : words_(words), special_(special), keep_special_(keep_special) {}
  std::string Push(int32_t id) override {
    if (id < 0 || id >= static_cast<int32_t>(words_->size())) return "";
    if ((*special_)[id] && !keep_special_) return "";
    std::string out = first_ ? (*words_)[id] : " " + (*words_)[id];
    first_ = false;
    return out;
  }
  std::string Finish() override { return ""; }

 private:
  const std::vector<std::string>* words_;
  const std::vector<bool>* special_;
  bool keep_special_;
  bool first_ = true;
};

class WordTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(absl::string_view text) const override {
    std::vector<int32_t> ids;
    for (absl::string_view w : absl::StrSplit(text, absl::ByAnyChar(" \t\n\r\f\v"), absl::SkipEmpty())) {
      auto it = ids_.find(w);
      if (it != ids_.end()) ids.push_back(it->second);  // Check() refuses the text otherwise
    }
    return ids;
  }
  absl::Status Check(absl::string_view text) const override {
    size_t n = 0;
    for (absl::string_view w : absl::StrSplit(text, absl::ByAnyChar(" \t\n\r\f\v"), absl::SkipEmpty())) {
      if (!ids_.contains(w)) {
        return absl::InvalidArgumentError(absl::StrCat("word ", n, " of the text, \"", Escaped(w.substr(0, 64)),
                                                       "\", is not in the model's vocabulary (", words_.size(),
                                                       " words, e.g. \"", words_.back(), "\")"));
      }
      ++n;
    }
    return absl::OkStatus();
  }
  std::unique_ptr<StreamDecoder> NewStream() const override {
    return std::make_unique<WordStream>(&words_, &special_, false);
  }
  std::unique_ptr<StreamDecoder> NewStreamWithSpecials() const override {
    return std::make_unique<WordStream>(&words_, &special_, true);
  }
  std::string TokenText(int32_t id) const override {
    if (id >= 0 && id < static_cast<int32_t>(words_.size())) return words_[id];
    return absl::StrCat("<", id, ">");
  }

  std::vector<std::string> words_;
  std::vector<bool> special_;
  absl::flat_hash_map<std::string, int32_t> ids_;
};

}  // namespace

std::string Utf8Assembler::Push(uint8_t b) {
  std::string out;
  if (need_ > 0) {
    if (b >= lo_ && b <= hi_) {
      pending_.push_back(static_cast<char>(b));
      lo_ = 0x80;
      hi_ = 0xBF;
      if (--need_ == 0) out.swap(pending_);
      return out;
    }
    // The sequence so far is a maximal invalid subpart; the byte starts afresh.
    out = kReplacement;
    pending_.clear();
    need_ = 0;
  }
  lo_ = 0x80;
  hi_ = 0xBF;
  if (b < 0x80) {
    out.push_back(static_cast<char>(b));
    return out;
  }
  if (b >= 0xC2 && b <= 0xDF) {
    need_ = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need_ = 2;
    if (b == 0xE0) lo_ = 0xA0;  // no overlong forms
    if (b == 0xED) hi_ = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need_ = 3;
    if (b == 0xF0) lo_ = 0x90;
    if (b == 0xF4) hi_ = 0x8F;  // nothing above U+10FFFF
  } else {
    return out + kReplacement;  // 0x80..0xC1, 0xF5..0xFF never start a character
  }
  pending_.push_back(static_cast<char>(b));
  return out;
}

std::string Utf8Assembler::Finish() {
  if (need_ == 0) return "";
  pending_.clear();
  need_ = 0;
  lo_ = 0x80;
  hi_ = 0xBF;
  return kReplacement;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  std::unique_ptr<StreamDecoder> s = skip_special_tokens ? NewStream() : NewStreamWithSpecials();
  std::string out;
  for (int32_t id : ids) out += s->Push(id);
  return out + s->Finish();
}

std::unique_ptr<Tokenizer> NewByteTokenizer() { return std::make_unique<ByteTokenizer>(); }

absl::StatusOr<std::unique_ptr<Tokenizer>> NewSentencePieceTokenizer(const std::string& path,
                                                                     int vocab_size, int extra_ids,
                                                                     int32_t append_eos) {
  auto t = std::make_unique<SentencePieceTokenizer>();
  t->append_eos_ = append_eos;
  std::string error;
  t->sp_ = SentencePieceModel::Load(path, &error);
  if (t->sp_ == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot load SentencePiece model ", path, ": ", error));
  }
  if (t->sp_->size() > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("SentencePiece model ", path, " has ",
                                                   t->sp_->size(),
                                                   " pieces, more than the config's vocab_size ",
                                                   vocab_size));
  }
  // A checkpoint's vocabulary may stop short of all sentinels (only those inside it exist).
  t->extra_ids_ = std::max(0, std::min(extra_ids, vocab_size - t->sp_->size()));
  for (int id = 0; id < t->sp_->size() && t->anchor_ < 0; ++id) {
    const std::string piece = t->sp_->Piece(id);
    if (!piece.empty() && !t->sp_->IsSpecial(id) && piece.find("\xE2\x96\x81") == std::string::npos &&
        t->sp_->Decode({id}) == piece) {
      t->anchor_ = id;
    }
  }
  return std::unique_ptr<Tokenizer>(std::move(t));
}

absl::Status Tokenizer::Check(absl::string_view) const { return absl::OkStatus(); }

absl::StatusOr<std::unique_ptr<Tokenizer>> NewWordTokenizer(const std::string& path, int vocab_size,
                                                           std::vector<int32_t> special_ids) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("word tokenizer: cannot open ", path));
  auto t = std::make_unique<WordTokenizer>();
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || std::any_of(line.begin(), line.end(), [](char c) { return absl::ascii_isspace(c); })) {
      return absl::InvalidArgumentError(absl::StrCat(path, " line ", number,
                                                     ": a word is non-empty and has no whitespace"));
    }
    if (!t->ids_.emplace(line, static_cast<int32_t>(t->words_.size())).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, " line ", number, ": \"", Escaped(line),
                                                     "\" appears twice (first on line ", t->ids_[line] + 1, ")"));
    }
    t->words_.push_back(line);
  }
  if (t->words_.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no words"));
  if (static_cast<int64_t>(t->words_.size()) > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, " has ", t->words_.size(), " words; the model's vocab_size is ",
                                                   vocab_size));
  }
  t->special_.assign(t->words_.size(), false);
  for (int32_t id : special_ids) {
    if (id >= 0 && id < static_cast<int32_t>(t->words_.size())) t->special_[id] = true;
  }
  return std::unique_ptr<Tokenizer>(std::move(t));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> NewTokenizer(const ModelConfig& config,
                                                        const std::string& model_dir) {
  if (config.tokenizer == TokenizerKind::kByte) return NewByteTokenizer();
  if (config.tokenizer == TokenizerKind::kWord) {
    return NewWordTokenizer(model_dir + "/" + config.tokenizer_file, config.vocab_size,
                            {config.bos_token_id, config.eos_token_id, config.pad_token_id});
  }
  if (config.tokenizer == TokenizerKind::kBpe) {
    return NewBpeTokenizer(model_dir + "/" + config.tokenizer_file, config.vocab_size);
  }
  return NewSentencePieceTokenizer(model_dir + "/" + config.tokenizer_file, config.vocab_size,
                                   config.tokenizer_extra_ids,
                                   config.tokenizer_append_eos ? config.eos_token_id : -1);
}

}  // namespace relgen
