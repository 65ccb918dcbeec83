// Tokenizers on arbitrary bytes. Byte tokenizer: encoding is the bytes themselves; decoding any id
// stream (special ids included) is valid UTF-8, equals the input when that was valid UTF-8, and a
// stream decoder's pieces concatenate to Decode. SentencePiece (a small model trained at start):
// ids in range, decode of any in-range ids valid UTF-8. Byte-level BPE (two tokenizer.json files
// written at start): ids in range, decode valid UTF-8 and equal to its stream, and for the one
// without a normalizer, stripping or special tokens, decode(encode(x)) == x made valid; the
// pre-tokenizer splits cover their input; NFC is idempotent.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "engine/tokenizers/bpe_tokenizer.h"
#include "engine/tokenizers/tokenizer.h"
#include "engine/tokenizers/unicode.h"
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_check.h"

namespace relgen::testing {
bool TrainSentencePiece(const std::string& corpus_file, const std::string& model_prefix, int vocab, std::string* error);
}

namespace {

constexpr int kSpVocab = 300;
constexpr int kBpeVocab = 1000;
std::unique_ptr<relgen::Tokenizer> byte_tok;
std::unique_ptr<relgen::Tokenizer> sp_tok;
std::unique_ptr<relgen::Tokenizer> bpe_plain;  // GPT-2 style, round-trips
std::unique_ptr<relgen::Tokenizer> bpe_full;   // NFC, BLOOM split, stripping, specials, template

// A tokenizer.json: ByteLevel's 256 characters, merges that build a few words (with and without
// a leading space), the given added tokens and pipeline.
std::string BpeJson(const nlohmann::json& added, const nlohmann::json& normalizer,
                    const nlohmann::json& pre_tokenizer, const nlohmann::json& post_processor) {
  using json = nlohmann::json;
  json vocab = json::object();
  std::vector<std::string> byte_char(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    relgen::unicode::AppendUtf8(printable ? b : next++, &byte_char[b]);
    vocab[byte_char[b]] = b;
  }
  json merges = json::array();
  for (std::string word : {"the", "tokens", "relative", "attention", "caf\xC3\xA9", "\xE6\x97\xA5\xE6\x9C\xAC",
                           "  ", "\n\n", "123", "'s"}) {
    for (const std::string& w : {word, " " + word}) {
      std::string left = byte_char[static_cast<uint8_t>(w[0])];
      for (size_t i = 1; i < w.size(); ++i) {
        const std::string right = byte_char[static_cast<uint8_t>(w[i])];
        if (!vocab.contains(left + right)) {
          merges.push_back(json::array({left, right}));
          vocab[left + right] = static_cast<int>(vocab.size());
        }
        left += right;
      }
    }
  }
  for (const json& t : added) {
    if (!vocab.contains(t["content"])) vocab[t["content"].get<std::string>()] = t["id"];
  }
  json j = {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
            {"added_tokens", added}, {"normalizer", normalizer}, {"pre_tokenizer", pre_tokenizer},
            {"post_processor", post_processor},
            {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true},
                         {"trim_offsets", true}, {"use_regex", true}}},
            {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                       {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                       {"vocab", vocab}, {"merges", merges}}}};
  return j.dump();
}

nlohmann::json Added(int id, const std::string& content, bool special, bool single_word,
                     bool lstrip, bool rstrip, bool normalized) {
  return {{"id", id}, {"content", content}, {"special", special}, {"single_word", single_word},
          {"lstrip", lstrip}, {"rstrip", rstrip}, {"normalized", normalized}};
}

std::unique_ptr<relgen::Tokenizer> LoadBpe(const std::string& dir, const std::string& name,
                                           const std::string& text) {
  const std::string path = dir + "/" + name;
  {
    std::ofstream out(path);
    out << text;
  }
  auto tok = relgen::NewBpeTokenizer(path, kBpeVocab);
  if (!tok.ok()) {
    std::fprintf(stderr, "loading %s failed: %s\n", path.c_str(), tok.status().ToString().c_str());
    std::abort();
  }
  return *std::move(tok);
}

std::string StreamDecode(const relgen::Tokenizer& tok, const std::vector<int32_t>& ids) {
  auto stream = tok.NewStream();
  std::string out;
  for (int32_t id : ids) out += stream->Push(id);
  return out + stream->Finish();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  byte_tok = relgen::NewByteTokenizer();
  char dir[] = "/tmp/relgen-fuzz-spXXXXXX";
  if (mkdtemp(dir) == nullptr) std::abort();
  const std::string corpus = std::string(dir) + "/corpus.txt";
  {
    std::ofstream out(corpus);
    const char* lines[] = {"The quick brown fox jumps over the lazy dog.",
                           "Relative attention biases logits by the distance between tokens.",
                           "Music Transformer skews the relative logits; T5 buckets them.",
                           "Caf\xC3\xA9 na\xC3\xAFve r\xC3\xA9sum\xC3\xA9 \xE2\x80\x94 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"};
    for (int i = 0; i < 200; ++i) out << lines[i % 4] << "\n";
  }
  std::string error;
  if (!relgen::testing::TrainSentencePiece(corpus, std::string(dir) + "/sp", kSpVocab, &error)) {
    std::fprintf(stderr, "training the SentencePiece model failed: %s\n", error.c_str());
    std::abort();
  }
  auto sp = relgen::NewSentencePieceTokenizer(std::string(dir) + "/sp.model", kSpVocab);
  FUZZ_CHECK(sp.ok());
  sp_tok = *std::move(sp);

  using json = nlohmann::json;
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                           {"trim_offsets", true}, {"use_regex", true}};
  bpe_plain = LoadBpe(dir, "plain.json",
                      BpeJson(json::array({Added(900, "<w>", false, true, false, false, false),
                                           Added(901, "a b", false, false, false, false, true),
                                           Added(902, "[[", false, false, false, false, false)}),
                              nullptr, byte_level, nullptr));
  const json bloom_split = {{"type", "Split"},
                            {"pattern", {{"Regex", " ?[^(\\s|[.,!?\xE2\x80\xA6\xE3\x80\x82\xEF\xBC\x8C\xE3\x80\x81\xE0\xA5\xA4\xDB\x94\xD8\x8C])]+"}}},
                            {"behavior", "Isolated"}, {"invert", false}};
  const json prefix_level = {{"type", "ByteLevel"}, {"add_prefix_space", true},
                             {"trim_offsets", true}, {"use_regex", true}};
  const json template_processing = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
      {"pair", json::array()},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {910}}, {"tokens", {"<s>"}}}}}}};
  bpe_full = LoadBpe(
      dir, "full.json",
      BpeJson(json::array({Added(910, "<s>", true, false, false, false, false),
                           Added(911, "<mask>", true, false, true, true, false),
                           Added(912, "  ", false, false, false, false, true),
                           Added(913, "cafe\xCC\x81", false, true, true, false, true),
                           Added(914, "\xE2\x84\xA6", false, false, false, true, false)}),
              {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}})}},
              {{"type", "Sequence"}, {"pretokenizers", json::array({bloom_split, prefix_level})}},
              template_processing));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);

  const std::vector<int32_t> bytes = byte_tok->Encode(text);
  FUZZ_CHECK(bytes.size() == size);
  for (size_t i = 0; i < size; ++i) FUZZ_CHECK(bytes[i] == data[i]);
  const std::string decoded = byte_tok->Decode(bytes);
  FUZZ_CHECK(relgen::fuzz::IsUtf8(decoded));
  if (relgen::fuzz::IsUtf8(text)) FUZZ_CHECK(decoded == text);
  FUZZ_CHECK(StreamDecode(*byte_tok, bytes) == decoded);

  // The same bytes read as 16-bit ids: special ids (>= 256) and bytes interleaved.
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) ids.push_back((data[i] | (data[i + 1] << 8)) % 300);
  const std::string mixed = StreamDecode(*byte_tok, ids);
  FUZZ_CHECK(relgen::fuzz::IsUtf8(mixed));
  FUZZ_CHECK(mixed == byte_tok->Decode(ids));
  for (int32_t id : ids) FUZZ_CHECK(relgen::fuzz::IsUtf8(byte_tok->TokenText(id)));

  const std::vector<int32_t> pieces = sp_tok->Encode(text);
  for (int32_t id : pieces) FUZZ_CHECK(id >= 0 && id < kSpVocab);
  FUZZ_CHECK(relgen::fuzz::IsUtf8(StreamDecode(*sp_tok, pieces)));
  std::vector<int32_t> sp_ids;
  for (int32_t id : ids) sp_ids.push_back(id % kSpVocab);
  const std::string sp_text = StreamDecode(*sp_tok, sp_ids);
  FUZZ_CHECK(relgen::fuzz::IsUtf8(sp_text));
  FUZZ_CHECK(sp_text == sp_tok->Decode(sp_ids));

  // Byte-level BPE.
  const std::string valid = relgen::unicode::ToValidUtf8(text);
  FUZZ_CHECK(relgen::fuzz::IsUtf8(valid));
  if (relgen::fuzz::IsUtf8(text)) FUZZ_CHECK(valid == text);
  for (auto split : {relgen::bpe::SplitGpt2, relgen::bpe::SplitBloom}) {
    std::string joined;
    for (absl::string_view piece : split(valid)) {
      FUZZ_CHECK(!piece.empty());
      joined.append(piece.data(), piece.size());
    }
    FUZZ_CHECK(joined == valid);
  }
  const std::string nfc = relgen::unicode::Nfc(valid);
  FUZZ_CHECK(relgen::fuzz::IsUtf8(nfc));
  FUZZ_CHECK(relgen::unicode::Nfc(nfc) == nfc);
  for (const relgen::Tokenizer* tok : {bpe_plain.get(), bpe_full.get()}) {
    const std::vector<int32_t> encoded = tok->Encode(text);
    for (int32_t id : encoded) FUZZ_CHECK(id >= 0 && id < kBpeVocab);
    FUZZ_CHECK(tok->Encode(valid) == encoded);
    const std::string decoded = tok->Decode(encoded);
    FUZZ_CHECK(relgen::fuzz::IsUtf8(decoded));
    FUZZ_CHECK(StreamDecode(*tok, encoded) == decoded);
    if (tok == bpe_plain.get()) FUZZ_CHECK(decoded == valid);
    std::vector<int32_t> bpe_ids;
    for (int32_t id : ids) bpe_ids.push_back(id * 4 - 100);  // negative and unknown ids too
    const std::string bpe_text = StreamDecode(*tok, bpe_ids);
    FUZZ_CHECK(relgen::fuzz::IsUtf8(bpe_text));
    FUZZ_CHECK(bpe_text == tok->Decode(bpe_ids));
    for (int32_t id : bpe_ids) FUZZ_CHECK(relgen::fuzz::IsUtf8(tok->TokenText(id)));
  }
  return 0;
}
