// SentencePiece behind an interface free of Abseil types: the library's headers declare their own
// `absl::string_view`, which clashes with Abseil's, so only sentencepiece_wrapper.cc includes them.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace relgen {

class SentencePieceModel {
 public:
  // Empty error on success.
  static std::unique_ptr<SentencePieceModel> Load(const std::string& path, std::string* error);
  virtual ~SentencePieceModel() = default;
  virtual std::vector<int> Encode(const std::string& text) const = 0;
  virtual std::string Decode(const std::vector<int>& ids) const = 0;
  virtual int size() const = 0;
  virtual std::string Piece(int id) const = 0;
  // A control piece (<pad>, </s>) or the unknown piece.
  virtual bool IsSpecial(int id) const = 0;
};

}  // namespace relgen
