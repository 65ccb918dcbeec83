#include "engine/sentencepiece_wrapper.h"

#include <sentencepiece_processor.h>

namespace relgen {
namespace {

class Impl final : public SentencePieceModel {
 public:
  std::vector<int> Encode(const std::string& text) const override {
    std::vector<int> ids;
    if (!sp.Encode(text, &ids).ok()) ids.clear();
    return ids;
  }
  std::string Decode(const std::vector<int>& ids) const override {
    std::string out;
    if (!sp.Decode(ids, &out).ok()) out.clear();
    return out;
  }
  int size() const override { return sp.GetPieceSize(); }
  std::string Piece(int id) const override { return sp.IdToPiece(id); }

  sentencepiece::SentencePieceProcessor sp;
};

}  // namespace

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path, std::string* error) {
  auto m = std::make_unique<Impl>();
  const auto status = m->sp.Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  error->clear();
  return m;
}

}  // namespace relgen
