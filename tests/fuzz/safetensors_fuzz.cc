// Safetensors parsing of arbitrary bytes: refused with a message, or every tensor it exposes lies
// inside the input and holds exactly numel x dtype-size bytes (and converts when it is a float).
#include <cstddef>
#include <cstdint>

#include "engine/model/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = relgen::SafetensorsFile::FromBuffer("fuzz.safetensors", data, size);
  if (!f.ok()) {
    FUZZ_CHECK(!f.status().message().empty());
    return 0;
  }
  for (const relgen::TensorInfo& t : (*f)->tensors()) {
    FUZZ_CHECK(t.nbytes == 0 || (t.data >= data && t.data + t.nbytes <= data + size));
    FUZZ_CHECK(static_cast<uint64_t>(t.numel()) * relgen::DTypeSize(t.dtype) == t.nbytes);
    FUZZ_CHECK((*f)->Find(t.name) != nullptr);
    const bool is_float = t.dtype == relgen::DType::kF32 || t.dtype == relgen::DType::kF64 ||
                          t.dtype == relgen::DType::kF16 || t.dtype == relgen::DType::kBF16;
    auto values = relgen::ToFloat32(t);
    FUZZ_CHECK(values.ok() == is_float);
    if (values.ok()) FUZZ_CHECK(static_cast<int64_t>(values->size()) == t.numel());
  }
  return 0;
}
