#include "engine/tokenizers/sentencepiece_wrapper.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

#ifndef RELGEN_SPM_SHIM_PATH
#define RELGEN_SPM_SHIM_PATH "librelgen_spm.so"
#endif

namespace relgen {
namespace {

struct Shim {
  void* (*load)(const char*, char**);
  void (*free_model)(void*);
  int (*size)(void*);
  int* (*encode)(void*, const char*, size_t, int*);
  char* (*decode)(void*, const int*, int, size_t*);
  char* (*piece)(void*, int, size_t*);
  int (*special)(void*, int);
  void (*release)(void*);
};

// Next to the running binary first (installed layouts), then where the build put it.
const Shim* LoadShim(std::string* error) {
  static std::once_flag once;
  static Shim shim;
  static const Shim* loaded = nullptr;
  static std::string load_error;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
      std::string dir(exe, n);
      candidates.push_back(dir.substr(0, dir.rfind('/')) + "/librelgen_spm.so");
    }
    candidates.push_back(RELGEN_SPM_SHIM_PATH);
    void* h = nullptr;
    for (const std::string& path : candidates) {
#ifdef RELGEN_SANITIZER
      // Sanitizer runtimes refuse RTLD_DEEPBIND; sanitizer trees run SentencePiece without gRPC.
      h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
#else
      h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
#endif
      if (h != nullptr) break;
      load_error += std::string(dlerror()) + "; ";
    }
    if (h == nullptr) return;
    shim.load = reinterpret_cast<decltype(shim.load)>(dlsym(h, "relgen_spm_load"));
    shim.free_model = reinterpret_cast<decltype(shim.free_model)>(dlsym(h, "relgen_spm_free"));
    shim.size = reinterpret_cast<decltype(shim.size)>(dlsym(h, "relgen_spm_size"));
    shim.encode = reinterpret_cast<decltype(shim.encode)>(dlsym(h, "relgen_spm_encode"));
    shim.decode = reinterpret_cast<decltype(shim.decode)>(dlsym(h, "relgen_spm_decode"));
    shim.piece = reinterpret_cast<decltype(shim.piece)>(dlsym(h, "relgen_spm_piece"));
    shim.special = reinterpret_cast<decltype(shim.special)>(dlsym(h, "relgen_spm_special"));
    shim.release = reinterpret_cast<decltype(shim.release)>(dlsym(h, "relgen_spm_release"));
    if (shim.load && shim.free_model && shim.size && shim.encode && shim.decode && shim.piece && shim.special &&
        shim.release) {
      loaded = &shim;
    } else {
      load_error = "librelgen_spm.so lacks its entry points";
    }
  });
  if (loaded == nullptr) *error = "cannot load the SentencePiece support library: " + load_error;
  return loaded;
}

class Impl final : public SentencePieceModel {
 public:
  Impl(const Shim* shim, void* sp) : shim_(shim), sp_(sp) {}
  ~Impl() override { shim_->free_model(sp_); }
  std::vector<int> Encode(const std::string& text) const override {
    int count = 0;
    int* ids = shim_->encode(sp_, text.data(), text.size(), &count);
    std::vector<int> out(ids, ids + count);
    shim_->release(ids);
    return out;
  }
  std::string Decode(const std::vector<int>& ids) const override {
    size_t len = 0;
    char* s = shim_->decode(sp_, ids.data(), static_cast<int>(ids.size()), &len);
    std::string out(s, len);
    shim_->release(s);
    return out;
  }
  int size() const override { return shim_->size(sp_); }
  std::string Piece(int id) const override {
    size_t len = 0;
    char* s = shim_->piece(sp_, id, &len);
    std::string out(s, len);
    shim_->release(s);
    return out;
  }
  bool IsSpecial(int id) const override { return shim_->special(sp_, id) != 0; }

 private:
  const Shim* shim_;
  void* sp_;
};

}  // namespace

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path, std::string* error) {
  const Shim* shim = LoadShim(error);
  if (shim == nullptr) return nullptr;
  char* err = nullptr;
  void* sp = shim->load(path.c_str(), &err);
  if (sp == nullptr) {
    *error = err != nullptr ? err : "unknown error";
    shim->release(err);
    return nullptr;
  }
  error->clear();
  return std::make_unique<Impl>(shim, sp);
}

}  // namespace relgen
