// Read-only, memory-mapped safetensors file. Every header field is checked against the file before
// any tensor is exposed: a malformed or truncated file is refused with a message, never read past.
// Thread-safety: immutable after Open; safe to share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace relgen {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

absl::string_view DTypeName(DType d);
int DTypeSize(DType d);

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping; not necessarily aligned
  size_t nbytes = 0;

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // The same checks over bytes in memory, which must outlive the result; `name` is used in errors.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(const std::string& name, const uint8_t* bytes,
                                                                     size_t size);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const TensorInfo* Find(absl::string_view name) const;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  absl::Status Index(const uint8_t* bytes, uint64_t size);
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorInfo> tensors_;
};

// Converts a floating-point tensor (F64, F32, F16, BF16) to float32.
absl::StatusOr<std::vector<float>> ToFloat32(const TensorInfo& t);

// IEEE half / bfloat16 bit patterns to float (exact).
float HalfToFloat(uint16_t h);
float BFloat16ToFloat(uint16_t b);

}  // namespace relgen
