// Tokenizers on arbitrary bytes. Byte tokenizer: encoding is the bytes themselves; decoding any id
// stream (special ids included) is valid UTF-8, equals the input when that was valid UTF-8, and a
// stream decoder's pieces concatenate to Decode. SentencePiece (a small model trained at start):
// ids in range, decode of any in-range ids valid UTF-8.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "engine/tokenizer.h"
#include "tests/fuzz/fuzz_check.h"

namespace relgen::testing {
bool TrainSentencePiece(const std::string& corpus_file, const std::string& model_prefix, int vocab, std::string* error);
}

namespace {

constexpr int kSpVocab = 300;
std::unique_ptr<relgen::Tokenizer> byte_tok;
std::unique_ptr<relgen::Tokenizer> sp_tok;

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
  return 0;
}
