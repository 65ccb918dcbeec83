// The shared object that alone links libsentencepiece, behind a C interface. Debian's
// libsentencepiece carries its own copy of protobuf and exports it; loaded into the global symbol
// scope next to the system libprotobuf (as any gRPC process has), one copy's code runs on the
// other's data. SentencePieceModel (sentencepiece_wrapper.cc) loads this object with
// RTLD_LOCAL | RTLD_DEEPBIND so that each copy keeps to itself.
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

char* Copy(const std::string& s, size_t* len) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  *len = s.size();
  return out;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* relgen_spm_load(const char* path, char** error) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto status = sp->Load(path);
  if (!status.ok()) {
    size_t len;
    *error = Copy(status.ToString(), &len);
    delete sp;
    return nullptr;
  }
  return sp;
}

__attribute__((visibility("default"))) void relgen_spm_free(void* sp) {
  delete static_cast<sentencepiece::SentencePieceProcessor*>(sp);
}

__attribute__((visibility("default"))) int relgen_spm_size(void* sp) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(sp)->GetPieceSize();
}

// Returns malloc'd ids (release with relgen_spm_release) and their count.
__attribute__((visibility("default"))) int* relgen_spm_encode(void* sp, const char* text, size_t len, int* count) {
  std::vector<int> ids;
  if (!static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Encode(std::string(text, len), &ids).ok()) ids.clear();
  int* out = static_cast<int*>(std::malloc(sizeof(int) * (ids.size() + 1)));
  if (!ids.empty()) std::memcpy(out, ids.data(), sizeof(int) * ids.size());  // memcpy from null is undefined
  *count = static_cast<int>(ids.size());
  return out;
}

__attribute__((visibility("default"))) char* relgen_spm_decode(void* sp, const int* ids, int count, size_t* len) {
  std::string text;
  if (!static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Decode(std::vector<int>(ids, ids + count), &text).ok()) {
    text.clear();
  }
  return Copy(text, len);
}

__attribute__((visibility("default"))) char* relgen_spm_piece(void* sp, int id, size_t* len) {
  return Copy(static_cast<sentencepiece::SentencePieceProcessor*>(sp)->IdToPiece(id), len);
}

// Control pieces (<pad>, </s>) and the unknown piece: what T5's tokenizers drop from decoded text.
__attribute__((visibility("default"))) int relgen_spm_special(void* sp, int id) {
  const auto* p = static_cast<sentencepiece::SentencePieceProcessor*>(sp);
  return p->IsControl(id) || p->IsUnknown(id) ? 1 : 0;
}

__attribute__((visibility("default"))) void relgen_spm_release(void* p) { std::free(p); }

}  // extern "C"
