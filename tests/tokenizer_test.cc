// Tokenizers: exact byte round trips, streams that never split a UTF-8 character, invalid bytes
// replaced per maximal subpart (the cases below match Python's bytes.decode(errors="replace")),
// and SentencePiece streaming equal to whole decoding.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/tokenizers/tokenizer.h"
#include "tests/test_util.h"

namespace relgen {
namespace testing {
bool TrainSentencePiece(const std::string& corpus_file, const std::string& model_prefix, int vocab,
                        std::string* error);
}  // namespace testing
namespace {

std::string Utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | cp >> 6);
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | cp >> 12);
    s += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | cp >> 18);
    s += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
    s += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Whole characters only: each piece is valid UTF-8 on its own.
bool WholeCharacters(const std::string& piece) { return NewByteTokenizer()->Decode(NewByteTokenizer()->Encode(piece)) == piece; }

TEST(ByteTokenizerTest, RoundTripAndStreamOfRandomUtf8) {
  auto tok = NewByteTokenizer();
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    for (int i = 0; i < 40; ++i) {
      uint32_t cp;
      do {
        const int kind = rng() % 4;
        cp = kind == 0 ? rng() % 0x80 : kind == 1 ? 0x80 + rng() % 0x780 : kind == 2 ? 0x800 + rng() % 0xF800 : 0x10000 + rng() % 0x100000;
      } while (cp >= 0xD800 && cp <= 0xDFFF);
      text += Utf8(cp);
    }
    const std::vector<int32_t> ids = tok->Encode(text);
    ASSERT_EQ(ids.size(), text.size());
    ASSERT_EQ(tok->Decode(ids), text);
    auto stream = tok->NewStream();
    std::string streamed;
    for (int32_t id : ids) {
      const std::string piece = stream->Push(id);
      ASSERT_TRUE(WholeCharacters(piece));
      streamed += piece;
    }
    streamed += stream->Finish();
    ASSERT_EQ(streamed, text);
  }
}

TEST(ByteTokenizerTest, InvalidBytesBecomeReplacementCharacters) {
  auto tok = NewByteTokenizer();
  const std::string r = "\xEF\xBF\xBD";
  auto decode = [&](const std::string& bytes) { return tok->Decode(tok->Encode(bytes)); };
  EXPECT_EQ(decode("a\xC3"), "a" + r);                    // truncated 2-byte character
  EXPECT_EQ(decode("\xE2\x82" "A"), r + "A");             // interrupted 3-byte character
  EXPECT_EQ(decode("\xED\xA0\x80"), r + r + r);           // surrogate: ED is a subpart alone
  EXPECT_EQ(decode("\xF0\x9F\x98"), r);                   // truncated 4-byte character
  EXPECT_EQ(decode("\xC0\xAF"), r + r);                   // overlong
  EXPECT_EQ(decode("\xF4\x90\x80\x80"), r + r + r + r);   // above U+10FFFF
  EXPECT_EQ(decode("\x80x\xFF"), r + "x" + r);            // stray continuation, invalid byte
  EXPECT_EQ(decode("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
}

TEST(ByteTokenizerTest, SpecialIdsDecodeToNothing) {
  auto tok = NewByteTokenizer();
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{104, 256, 105, 257}), "hi");
  // A special token inside a character does not break it.
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{0xC3, 258, 0xA9}), "\xC3\xA9");
  EXPECT_EQ(tok->TokenText(65), "A");
  EXPECT_EQ(tok->TokenText(0xC3), "\\xC3");
  EXPECT_EQ(tok->TokenText(257), "<257>");
}

std::string WriteVocab(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir("word_vocab") + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The word-level tokenizer on random sequences of a random vocabulary: ids are line numbers, text
// is the words joined by single spaces (any whitespace in), specials write nothing unless kept,
// an unknown word is refused naming it.
TEST(WordTokenizerTest, LineNumbersAreIdsAndTextIsSpaceSeparatedWords) {
  std::mt19937 rng(7);
  std::vector<std::string> words = {"PAD", "BOS", "EOS"};
  std::string file = "PAD\nBOS\nEOS\n";
  while (words.size() < 60) {
    std::string w;
    for (int n = 1 + rng() % 4; n > 0; --n) w += "abcdefgHP0123456789_-"[rng() % 21];
    if (std::find(words.begin(), words.end(), w) != words.end()) continue;
    words.push_back(w);
    file += w + (rng() % 2 ? "\n" : "\r\n");
  }
  auto tok = NewWordTokenizer(WriteVocab("v.txt", file), 64, {1, 2, 0});
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int32_t> ids;
    std::string text, spaced;
    for (int n = 1 + rng() % 30; n > 0; --n) {
      const int32_t id = 3 + rng() % (words.size() - 3);
      ids.push_back(id);
      text += (text.empty() ? "" : " ") + words[id];
      spaced += std::string(1 + rng() % 3, " \t\n"[rng() % 3]) + words[id];
    }
    EXPECT_EQ((*tok)->Encode(spaced), ids);
    EXPECT_TRUE((*tok)->Check(spaced).ok());
    EXPECT_EQ((*tok)->Decode(ids), text);
    std::vector<int32_t> framed = {1};
    framed.insert(framed.end(), ids.begin(), ids.end());
    framed.push_back(2);
    EXPECT_EQ((*tok)->Decode(framed), text);
    EXPECT_EQ((*tok)->Decode(framed, /*skip_special_tokens=*/false), "BOS " + text + " EOS");
  }
  EXPECT_EQ((*tok)->TokenText(5), words[5]);
  EXPECT_EQ((*tok)->TokenText(63), "<63>");  // inside vocab_size, past the file's words
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{3, 63, 4}), words[3] + " " + words[4]);
  const absl::Status unknown = (*tok)->Check(words[3] + " NOT_A_WORD " + words[4]);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("word 1 of the text, \"NOT_A_WORD\", is not in the model's vocabulary (60 words"),
            std::string::npos)
      << unknown.message();
}

TEST(WordTokenizerTest, BadVocabularyFilesAreRefusedNamingTheLine) {
  for (const auto& [text, vocab, message] : std::vector<std::tuple<std::string, int, std::string>>{
           {"a\nb\na\n", 10, "line 3: \"a\" appears twice (first on line 1)"},
           {"a\n\nb\n", 10, "line 2: a word is non-empty and has no whitespace"},
           {"a\nb c\n", 10, "line 2: a word is non-empty and has no whitespace"},
           {"a\nb\nc\n", 2, "has 3 words; the model's vocab_size is 2"},
           {"", 10, "no words"}}) {
    auto tok = NewWordTokenizer(WriteVocab("bad.txt", text), vocab, {});
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(tok.status().message().find(message), std::string::npos) << tok.status().message();
  }
  EXPECT_EQ(NewWordTokenizer("/nonexistent/vocab.txt", 10, {}).status().code(), absl::StatusCode::kNotFound);
}

TEST(SentencePieceTokenizerTest, StreamEqualsWholeDecode) {
  const std::string dir = testing::TempDir("sp");
  std::string corpus;
  const char* lines[] = {"The quick brown fox jumps over the lazy dog.",
                         "Relative attention biases logits by the distance between tokens.",
                         "Music Transformer skews the relative logits; T5 buckets them.",
                         "Caf\xC3\xA9 na\xC3\xAFve r\xC3\xA9sum\xC3\xA9 \xE2\x80\x94 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"};
  for (int i = 0; i < 200; ++i) corpus += std::string(lines[i % 4]) + "\n";
  testing::WriteFile(dir + "/corpus.txt", corpus);
  std::string error;
  ASSERT_TRUE(testing::TrainSentencePiece(dir + "/corpus.txt", dir + "/sp", 300, &error)) << error;
  ASSERT_FALSE(NewSentencePieceTokenizer(dir + "/sp.model", 100).ok());  // more pieces than vocab
  auto tok = NewSentencePieceTokenizer(dir + "/sp.model", 300);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Unseen characters go through byte fallback and must still stream whole.
  const std::string text = "The lazy fox skews \xF0\x9F\x8E\xB5 music; caf\xC3\xA9 \xE6\x97\xA5 tokens.";
  const std::vector<int32_t> ids = (*tok)->Encode(text);
  ASSERT_GT(ids.size(), 5u);
  EXPECT_EQ((*tok)->Decode(ids), text);
  auto stream = (*tok)->NewStream();
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = stream->Push(id);
    EXPECT_TRUE(WholeCharacters(piece)) << piece;
    streamed += piece;
  }
  streamed += stream->Finish();
  EXPECT_EQ(streamed, text);
}

}  // namespace
}  // namespace relgen
