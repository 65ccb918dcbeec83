// Byte-level BPE (engine/tokenizers/bpe_tokenizer.cc) against the Hugging Face `tokenizers`
// library, whose outputs tools/make_bpe_cases.py records (CTest fixture, RELGEN_BPE_CASES):
// ids on every string of every family, decoding (whole and streamed, never splitting a
// character), the character classes and NFC on every code point, and refusals at load.
#include "engine/tokenizers/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizers/tokenizer.h"
#include "engine/tokenizers/unicode.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace relgen {
namespace {

using json = nlohmann::json;
constexpr int kBigVocab = 1 << 24;  // no limit from the model in the comparisons

std::string CasesDir() {
  const char* d = std::getenv("RELGEN_BPE_CASES");
  return d != nullptr ? d : "";
}

// The lines of a JSON-lines file; fails the test when it is missing or empty.
std::vector<json> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  EXPECT_FALSE(out.empty()) << path << " is missing or empty: run tools/make_bpe_cases.py";
  return out;
}

json ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path << " is missing: run tools/make_bpe_cases.py";
  if (!in.good()) return json();
  return json::parse(in);
}

std::string FromHex(const json& j) { return absl::HexStringToBytes(j.get<std::string>()); }

std::string Show(const std::string& s) { return absl::CHexEscape(s); }

std::string ShowIds(const std::vector<int32_t>& ids) {
  return absl::StrCat("[", absl::StrJoin(ids, ","), "]");
}

bool WholeCharacters(const std::string& s) { return unicode::ToValidUtf8(s) == s; }

bool IsSurrogate(uint32_t cp) { return cp >= 0xD800 && cp <= 0xDFFF; }

std::string Utf8(uint32_t cp) {
  std::string s;
  unicode::AppendUtf8(cp, &s);
  return s;
}

// Stream-decodes `ids` one at a time, checking that no piece splits a character.
std::string StreamDecode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool* whole, bool keep = false) {
  auto stream = keep ? tok.NewStreamWithSpecials() : tok.NewStream();
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = stream->Push(id);
    if (!WholeCharacters(piece)) *whole = false;
    out += piece;
  }
  const std::string rest = stream->Finish();
  if (!WholeCharacters(rest)) *whole = false;
  return out + rest;
}

class BpeFamilyTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = CasesDir() + "/" + GetParam();
    ASSERT_FALSE(CasesDir().empty()) << "RELGEN_BPE_CASES is not set (CTest sets it)";
    auto tok = NewBpeTokenizer(dir_ + "/tokenizer.json", kBigVocab);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = *std::move(tok);
  }
  std::string dir_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_P(BpeFamilyTest, IdsEqualTheLibrarysOnEveryString) {
  const std::vector<json> cases = ReadLines(dir_ + "/encode.jsonl");
  ASSERT_GE(cases.size(), 10000u);
  int failures = 0;
  size_t ids_compared = 0;
  for (const json& c : cases) {
    const std::string raw = FromHex(c["hex"]);
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok_->Encode(raw);
    ids_compared += want.size();
    if (got != want && ++failures <= 5) {
      ADD_FAILURE() << GetParam() << ": text \"" << Show(raw) << "\"\n  library " << ShowIds(want)
                    << "\n  relgen  " << ShowIds(got);
    }
  }
  EXPECT_EQ(failures, 0);
  std::printf("[%s] compared %zu strings, %zu ids\n", GetParam().c_str(), cases.size(),
              ids_compared);
}

TEST_P(BpeFamilyTest, DecodeEqualsTheLibrarysAndStreamsWhole) {
  std::vector<json> cases = ReadLines(dir_ + "/encode.jsonl");
  const std::vector<json> random = ReadLines(dir_ + "/decode.jsonl");
  ASSERT_GE(random.size(), 1000u);
  cases.insert(cases.end(), random.begin(), random.end());
  int failures = 0;
  for (const json& c : cases) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    const std::string want = FromHex(c["decoded"]);
    const std::string whole = tok_->Decode(ids);
    bool pieces_whole = true;
    const std::string streamed = StreamDecode(*tok_, ids, &pieces_whole);
    if ((whole != want || streamed != whole || !pieces_whole) && ++failures <= 5) {
      ADD_FAILURE() << GetParam() << ": ids " << ShowIds(ids) << "\n  library \"" << Show(want)
                    << "\"\n  relgen  \"" << Show(whole) << "\"\n  stream  \"" << Show(streamed)
                    << "\" (pieces whole: " << pieces_whole << ")";
    }
  }
  EXPECT_EQ(failures, 0);
  std::printf("[%s] compared %zu decodes (%zu random id sequences)\n", GetParam().c_str(),
              cases.size(), random.size());
}

// skip_special_tokens=False: special tokens' text joins the output as the library's decode writes
// it, whole and streamed.
TEST_P(BpeFamilyTest, DecodeKeepingSpecialsEqualsTheLibrarys) {
  const std::vector<json> cases = ReadLines(dir_ + "/decode.jsonl");
  ASSERT_GE(cases.size(), 1000u);
  int failures = 0, with_specials = 0;
  for (const json& c : cases) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    const std::string want = FromHex(c["decoded_keep"]);
    with_specials += want != FromHex(c["decoded"]) ? 1 : 0;
    const std::string whole = tok_->Decode(ids, /*skip_special_tokens=*/false);
    bool pieces_whole = true;
    const std::string streamed = StreamDecode(*tok_, ids, &pieces_whole, /*keep=*/true);
    if ((whole != want || streamed != whole || !pieces_whole) && ++failures <= 5) {
      ADD_FAILURE() << GetParam() << ": ids " << ShowIds(ids) << "\n  library \"" << Show(want)
                    << "\"\n  relgen  \"" << Show(whole) << "\"\n  stream  \"" << Show(streamed) << "\"";
    }
  }
  EXPECT_EQ(failures, 0);
  bool has_specials = false;
  const json config = ReadJsonFile(dir_ + "/tokenizer.json");
  for (const json& a : config.value("added_tokens", json::array())) has_specials |= a.value("special", false);
  if (has_specials) {
    EXPECT_GT(with_specials, 10) << "too few sequences hold a special token for the comparison to mean anything";
  } else {
    EXPECT_EQ(with_specials, 0) << "a family without special tokens decodes the same either way";
  }
}

// Streams every text as one token per byte (ByteLevel's single-byte tokens), so each multi-byte
// character arrives split at every byte.
TEST_P(BpeFamilyTest, StreamSplitAtEveryByteEqualsWholeDecode) {
  const json config = ReadJsonFile(dir_ + "/tokenizer.json");
  const json& vocab = config["model"]["vocab"];
  // The single-byte tokens: ByteLevel's character for each byte (printable Latin-1 for itself,
  // the rest U+0100.. in byte order).
  std::vector<int32_t> byte_id(256, -1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const std::string ch = Utf8(printable ? b : next++);
    if (vocab.contains(ch)) byte_id[b] = vocab[ch].get<int32_t>();
  }
  const std::vector<json> cases = ReadLines(dir_ + "/encode.jsonl");
  size_t compared = 0;
  int failures = 0;
  for (const json& c : cases) {
    const std::string text = unicode::ToValidUtf8(FromHex(c["hex"]));
    std::vector<int32_t> ids;
    for (char ch : text) ids.push_back(byte_id[static_cast<uint8_t>(ch)]);
    if (std::count(ids.begin(), ids.end(), -1) > 0) continue;  // a byte the alphabet lacks
    ++compared;
    bool pieces_whole = true;
    const std::string streamed = StreamDecode(*tok_, ids, &pieces_whole);
    if ((streamed != text || tok_->Decode(ids) != text || !pieces_whole) && ++failures <= 5) {
      ADD_FAILURE() << GetParam() << ": \"" << Show(text) << "\" streamed as \"" << Show(streamed)
                    << "\"";
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GE(compared, 1000u);  // families with a small alphabet lack some bytes
  std::printf("[%s] streamed %zu texts one byte per token\n", GetParam().c_str(), compared);
}

TEST_P(BpeFamilyTest, TokenTextShowsBytesOrEscapes) {
  const json config = ReadJsonFile(dir_ + "/tokenizer.json");
  for (const auto& [token, id_json] : config["model"]["vocab"].items()) {
    const int32_t id = id_json.get<int32_t>();
    const std::string text = tok_->TokenText(id);
    ASSERT_TRUE(WholeCharacters(text)) << id;
    const std::string bytes = tok_->Decode({id});
    if (!bytes.empty() && WholeCharacters(bytes) &&
        bytes.find("\xEF\xBF\xBD") == std::string::npos) {
      EXPECT_EQ(text, bytes) << id;
    }
  }
  EXPECT_EQ(tok_->TokenText(-1), "<-1>");
  EXPECT_EQ(tok_->TokenText(kBigVocab - 1), absl::StrCat("<", kBigVocab - 1, ">"));
  EXPECT_EQ(tok_->Decode({-5, kBigVocab - 1}), "");
}

// A tokenizer is shared by request threads: encoding concurrently gives the same ids.
TEST_P(BpeFamilyTest, ConcurrentEncodingAgrees) {
  const std::vector<json> cases = ReadLines(dir_ + "/encode.jsonl");
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < cases.size(); i += 7) {
        if (tok_->Encode(FromHex(cases[i]["hex"])) != cases[i]["ids"].get<std::vector<int32_t>>()) {
          ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int f : failures) EXPECT_EQ(f, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, BpeFamilyTest,
                         ::testing::Values("gpt2", "bloom", "nfc", "added", "template", "unk"),
                         [](const auto& info) { return info.param; });

// Boundaries (character offsets of piece ends) of a pre-tokenizer split.
std::string Ends(const std::vector<absl::string_view>& pieces) {
  std::vector<size_t> ends;
  size_t chars = 0;
  for (absl::string_view p : pieces) {
    for (char c : p) chars += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
    ends.push_back(chars);
  }
  return absl::StrJoin(ends, ",");
}

std::string Fill(const std::string& templ, uint32_t cp) {
  const std::string placeholder = Utf8(0xE000);
  std::string out;
  for (size_t i = 0; i < templ.size();) {
    if (templ.compare(i, placeholder.size(), placeholder) == 0) {
      out += Utf8(cp);
      i += placeholder.size();
    } else {
      out += templ[i++];
    }
  }
  return out;
}

// \p{L}, \p{N}, \s (Oniguruma) and BLOOM's class, through the splitters, on every code point.
TEST(BpeProbeTest, PreTokenizerClassesAgreeOnEveryCodePoint) {
  const json probe = ReadJsonFile(CasesDir() + "/probe_split.json");
  for (const char* name : {"gpt2", "bloom"}) {
    ASSERT_TRUE(probe.contains(name)) << name;
    const std::string templ = probe[name]["template"].get<std::string>();
    auto split = std::string(name) == "gpt2" ? bpe::SplitGpt2 : bpe::SplitBloom;
    size_t compared = 0;
    int failures = 0;
    for (const json& run : probe[name]["runs"]) {
      const auto lo = run[0].get<uint32_t>(), hi = run[1].get<uint32_t>();
      const std::string want = run[2].get<std::string>();
      for (uint32_t cp = lo; cp <= hi; ++cp) {
        if (IsSurrogate(cp)) continue;
        ++compared;
        const std::string got = Ends(split(Fill(templ, cp)));
        if (got != want && ++failures <= 5) {
          ADD_FAILURE() << name << " U+" << absl::StrCat(absl::Hex(cp)) << ": library ends " << want
                        << ", relgen " << got;
        }
      }
    }
    EXPECT_EQ(failures, 0);
    EXPECT_EQ(compared, 0x110000u - 0x800u) << name;
    std::printf("[%s split] compared %zu code points\n", name, compared);
  }
}

TEST(BpeProbeTest, NfcAgreesOnEveryCodePoint) {
  const json probe = ReadJsonFile(CasesDir() + "/probe_nfc.json");
  ASSERT_TRUE(probe.contains("templates"));
  size_t compared = 0;
  int failures = 0;
  auto check = [&](const std::string& in, const std::string& want) {
    ++compared;
    const std::string got = unicode::Nfc(in);
    if (got != want && ++failures <= 10) {
      ADD_FAILURE() << "NFC of \"" << Show(in) << "\": library \"" << Show(want) << "\", relgen \""
                    << Show(got) << "\"";
    }
  };
  for (const json& t : probe["templates"]) {
    const std::string templ = t["template"].get<std::string>();
    std::unordered_map<uint32_t, std::string> changed;
    for (const json& c : t["changed"]) changed[c[0].get<uint32_t>()] = c[1].get<std::string>();
    for (uint32_t cp = 0; cp < 0x110000; ++cp) {
      if (IsSurrogate(cp)) continue;
      const std::string in = Fill(templ, cp);
      auto it = changed.find(cp);
      check(in, it == changed.end() ? in : it->second);
    }
  }
  const size_t templated = compared;
  for (const json& s : probe["strings"]) check(s[0].get<std::string>(), s[1].get<std::string>());
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(templated, probe["templates"].size() * (0x110000u - 0x800u));
  EXPECT_GT(compared - templated, 50000u);
  std::printf("[nfc] compared %zu templated code points and %zu mark/composition strings\n",
              templated, compared - templated);
}

// The word characters of single_word, through a whole encode, on every code point.
TEST(BpeProbeTest, SingleWordAgreesOnEveryCodePoint) {
  const json probe = ReadJsonFile(CasesDir() + "/probe_word.json");
  const json config = ReadJsonFile(CasesDir() + "/added/tokenizer.json");
  ASSERT_TRUE(probe.contains("before_runs") && probe.contains("after_runs"));
  int32_t wid = -1;
  for (const json& t : config["added_tokens"]) {
    if (t["content"] == probe["token"]) {
      ASSERT_TRUE(t["single_word"].get<bool>());
      ASSERT_FALSE(t["normalized"].get<bool>());
      wid = t["id"].get<int32_t>();
    }
  }
  ASSERT_GE(wid, 0);
  auto tok = NewBpeTokenizer(CasesDir() + "/added/tokenizer.json", kBigVocab);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Each side as the library decides it on that side.
  auto word_of = [&](const char* side) {
    std::vector<bool> word(0x110000, false);
    for (const json& run : probe[side]) {
      for (uint32_t cp = run[0].get<uint32_t>(); cp <= run[1].get<uint32_t>(); ++cp) word[cp] = true;
    }
    return word;
  };
  const std::vector<bool> before = word_of("before_runs"), after = word_of("after_runs");
  size_t compared = 0;
  int failures = 0;
  const std::string token = probe["token"].get<std::string>();
  for (uint32_t cp = 0; cp < 0x110000; ++cp) {
    if (IsSurrogate(cp)) continue;
    ++compared;
    for (const bool token_first : {false, true}) {
      const std::string text = token_first ? token + Utf8(cp) : Utf8(cp) + token;
      const bool is_word = token_first ? after[cp] : before[cp];
      const std::vector<int32_t> ids = (*tok)->Encode(text);
      const bool matched = std::find(ids.begin(), ids.end(), wid) != ids.end();
      if (matched == is_word && ++failures <= 5) {
        ADD_FAILURE() << "single_word with U+" << absl::StrCat(absl::Hex(cp)) << (token_first ? " after" : " before")
                      << " the token: library " << (is_word ? "word" : "not word") << ", relgen disagrees";
      }
    }
  }
  EXPECT_EQ(failures, 0);
  std::printf("[single_word] compared %zu code points on both sides\n", compared);
}

// ---- refusals --------------------------------------------------------------------------

// A small valid tokenizer.json; each refusal case below replaces one part of it.
constexpr char kBase[] = R"({
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 5, "content": "<s>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġab": 4, "<s>": 5},
            "merges": [["a", "b"], "Ġ ab"]}
})";

struct Refusal {
  const char* pointer;                // JSON pointer of the part replaced
  const char* value;                  // its new JSON value
  std::vector<std::string> expected;  // substrings of the error
};

class BpeRefusalTest : public ::testing::TestWithParam<Refusal> {};

TEST(BpeLoadTest, BaseLoadsAndEncodes) {
  const std::string dir = testing::TempDir("bpe_base");
  testing::WriteFile(dir + "/tokenizer.json", kBase);
  auto tok = NewBpeTokenizer(dir + "/tokenizer.json", 6);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("ab ab<s>"), (std::vector<int32_t>{2, 4, 5}));
  EXPECT_EQ((*tok)->Decode({2, 4, 5, 3}), "ab ab ");
  EXPECT_EQ((*tok)->TokenText(5), "<s>");
  EXPECT_EQ((*tok)->TokenText(3), " ");
  // A model with more rows than the tokenizer has ids is fine (BLOOM pads its embeddings).
  EXPECT_TRUE(NewBpeTokenizer(dir + "/tokenizer.json", 250880).ok());
  // One with fewer is not: id 5 needs vocab_size 6.
  auto small = NewBpeTokenizer(dir + "/tokenizer.json", 5);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("vocab_size 5"), std::string::npos) << small.status();
  EXPECT_NE(small.status().message().find("largest token id is 5"), std::string::npos);
  // Missing file, not JSON.
  EXPECT_FALSE(NewBpeTokenizer(dir + "/absent.json", 6).ok());
  testing::WriteFile(dir + "/bad.json", "{\"model\": ");
  auto bad = NewBpeTokenizer(dir + "/bad.json", 6);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad.json"), std::string::npos);
}

TEST_P(BpeRefusalTest, NamesWhatIsUnsupported) {
  const Refusal& r = GetParam();
  json j = json::parse(kBase);
  j[json::json_pointer(r.pointer)] = json::parse(r.value);
  const std::string dir = testing::TempDir("bpe_refusal");
  const std::string path = dir + "/tokenizer.json";
  testing::WriteFile(path, j.dump());
  auto tok = NewBpeTokenizer(path, 1000);
  ASSERT_FALSE(tok.ok()) << r.pointer << " = " << r.value << " was accepted";
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(tok.status().message());
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("supported"), std::string::npos) << message;
  for (const std::string& part : r.expected) {
    EXPECT_NE(message.find(part), std::string::npos) << "\"" << part << "\" not in: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BpeRefusalTest,
    ::testing::Values(
        Refusal{"/normalizer", R"({"type": "NFKC"})", {"normalizer.type", "\"NFKC\"", "NFC"}},
        Refusal{"/normalizer",
                R"({"type": "Sequence", "normalizers": [{"type": "NFC"},
                {"type": "Lowercase"}]})",
                {"normalizer.normalizers[1].type", "Lowercase"}},
        Refusal{
            "/pre_tokenizer", R"({"type": "Whitespace"})", {"pre_tokenizer.type", "Whitespace"}},
        Refusal{"/pre_tokenizer", "null", {"pre_tokenizer", "null", "ByteLevel"}},
        Refusal{"/pre_tokenizer",
                R"({"type": "Split", "pattern": {"Regex": "\\s+"},
                "behavior": "Isolated", "invert": false})",
                {"pre_tokenizer.pattern", "\\\\s+"}},
        Refusal{"/pre_tokenizer",
                R"({"type": "Split", "pattern": {"String": " "},
                "behavior": "Isolated", "invert": false})",
                {"pre_tokenizer.pattern", "String"}},
        Refusal{"/pre_tokenizer",
                R"({"type": "Split", "pattern":
                {"Regex": " ?[^(\\s|[.,!?…。，、।۔،])]+"}, "behavior": "Removed", "invert": false})",
                {"pre_tokenizer.behavior", "Removed", "Isolated"}},
        Refusal{"/pre_tokenizer",
                R"({"type": "Split", "pattern":
                {"Regex": " ?[^(\\s|[.,!?…。，、।۔،])]+"}, "behavior": "Isolated", "invert": true})",
                {"pre_tokenizer.invert", "true"}},
        Refusal{"/pre_tokenizer",
                R"({"type": "Sequence", "pretokenizers": [{"type": "Metaspace",
                "replacement": "▁", "prepend_scheme": "always", "split": true}]})",
                {"pre_tokenizer.pretokenizers[0].type", "Metaspace"}},
        Refusal{"/pre_tokenizer",
                R"({"type": "ByteLevel", "trim_offsets": true})",
                {"pre_tokenizer.add_prefix_space", "missing"}},
        Refusal{"/model/type", R"("WordPiece")", {"model.type", "WordPiece", "BPE"}},
        Refusal{"/model/dropout", "0.1", {"model.dropout", "0.1"}},
        Refusal{"/model/continuing_subword_prefix",
                R"("##")",
                {"model.continuing_subword_prefix", "##"}},
        Refusal{"/model/end_of_word_suffix", R"("</w>")", {"model.end_of_word_suffix", "</w>"}},
        Refusal{"/model/byte_fallback", "true", {"model.byte_fallback", "true", "false"}},
        Refusal{"/model/unk_token", R"("<unk>")", {"model.unk_token", "<unk>"}},
        Refusal{"/model/merges", R"(["a b c"])", {"model.merges[0]", "a b c"}},
        Refusal{"/model/merges", R"([["b", "a"]])", {"model.merges[0]", "concatenation"}},
        Refusal{"/model/vocab", R"({"a": 0, "b": 0})", {"model.vocab", "one token per id"}},
        Refusal{"/model/vocab", R"({"a": -1})", {"model.vocab[\"a\"]", "-1"}},
        Refusal{"/model/cache_capacity", "10", {"model.cache_capacity", "unknown key"}},
        Refusal{"/added_tokens/0/content", R"("")", {"added_tokens[0].content"}},
        Refusal{"/added_tokens/0/lstrip", R"("yes")", {"added_tokens[0].lstrip", "true or false"}},
        Refusal{"/post_processor",
                R"({"type": "RobertaProcessing", "sep": ["</s>", 2],
                "cls": ["<s>", 0], "trim_offsets": true, "add_prefix_space": true})",
                {"post_processor.type", "RobertaProcessing", "TemplateProcessing"}},
        Refusal{"/post_processor",
                R"({"type": "Sequence", "processors": []})",
                {"post_processor.type", "Sequence"}},
        Refusal{"/post_processor",
                R"({"type": "TemplateProcessing", "single": [
                {"Sequence": {"id": "B", "type_id": 0}}], "pair": [], "special_tokens": {}})",
                {"post_processor.single[0]", "\"B\""}},
        Refusal{"/post_processor",
                R"({"type": "TemplateProcessing", "single": [
                {"SpecialToken": {"id": "<cls>", "type_id": 0}}, {"Sequence": {"id": "A",
                "type_id": 0}}], "pair": [], "special_tokens": {}})",
                {"post_processor.special_tokens[\"<cls>\"]"}},
        Refusal{"/decoder",
                R"({"type": "WordPiece", "prefix": "##", "cleanup": true})",
                {"decoder.type", "WordPiece", "ByteLevel"}},
        Refusal{"/decoder", "null", {"decoder", "ByteLevel"}},
        Refusal{"/truncation",
                R"({"direction": "Right", "max_length": 8, "strategy":
                "LongestFirst", "stride": 0})",
                {"truncation", "max_length"}},
        Refusal{"/padding",
                R"({"strategy": "BatchLongest", "direction": "Right"})",
                {"padding", "BatchLongest"}}));

// ---- behaviour spot checks ---------------------------------------------------------------

TEST(BpeSplitTest, Gpt2PatternPieces) {
  auto pieces = [](const std::string& s) {
    std::vector<std::string> out;
    for (absl::string_view p : bpe::SplitGpt2(s)) out.emplace_back(p);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("I'm  here\n\n x"), (V{"I", "'m", " ", " here", "\n\n", " x"}));
  EXPECT_EQ(pieces("a   "), (V{"a", "   "}));
  EXPECT_EQ(pieces("x\t!?'s 42"), (V{"x", "\t", "!?'", "s", " 42"}));
  EXPECT_EQ(pieces(""), V{});
}

TEST(BpeSplitTest, BloomPatternPieces) {
  auto pieces = [](const std::string& s) {
    std::vector<std::string> out;
    for (absl::string_view p : bpe::SplitBloom(s)) out.emplace_back(p);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello, world!"), (V{"Hello", ",", " world", "!"}));
  EXPECT_EQ(pieces("a  b(c)|d"), (V{"a", " ", " b", "(", "c", ")|", "d"}));
  EXPECT_EQ(pieces("日本。 x"), (V{"日本", "。", " x"}));
}

// Not a pass/fail timing: a few-KB prompt, for the log.
TEST(BpeSpeedTest, FewKilobytePrompt) {
  auto tok = NewBpeTokenizer(CasesDir() + "/gpt2/tokenizer.json", kBigVocab);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::string prompt;
  while (prompt.size() < 4096) {
    prompt +=
        "Relative attention biases logits by the distance between tokens; caf\xC3\xA9 "
        "\xE6\x97\xA5\xE6\x9C\xAC 1234 don't  \n";
  }
  const std::string spaces(100000, ' ');
  const std::string word(100000, 'q');
  for (const std::string* text : std::vector<const std::string*>{&prompt, &spaces, &word}) {
    const auto start = std::chrono::steady_clock::now();
    const int kReps = text == &prompt ? 200 : 3;
    size_t n = 0;
    for (int i = 0; i < kReps; ++i) n += (*tok)->Encode(*text).size();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count() /
        kReps;
    std::printf("[speed] %zu bytes -> %zu ids in %.1f us\n", text->size(), n / kReps, us);
    EXPECT_GT(n, 0u);
  }
}

}  // namespace
}  // namespace relgen
