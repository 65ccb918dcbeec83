// Trains a small SentencePiece model for the tokenizer tests (SentencePiece headers cannot share a
// translation unit with Abseil's).
#include <sentencepiece_trainer.h>

#include <string>

namespace relgen::testing {

bool TrainSentencePiece(const std::string& corpus_file, const std::string& model_prefix, int vocab,
                        std::string* error) {
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + corpus_file + " --model_prefix=" + model_prefix +
      " --vocab_size=" + std::to_string(vocab) +
      " --model_type=bpe --byte_fallback=true --character_coverage=1.0 --minloglevel=2");
  *error = status.ToString();
  return status.ok();
}

}  // namespace relgen::testing
