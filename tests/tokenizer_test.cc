// Tokenizers: exact byte round trips, streams that never split a UTF-8 character, invalid bytes
// replaced per maximal subpart (the cases below match Python's bytes.decode(errors="replace")),
// and SentencePiece streaming equal to whole decoding.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>

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
