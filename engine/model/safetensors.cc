#include "engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace relgen {
namespace {

using json = nlohmann::json;

// The format's own bound on the header size.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

struct DTypeEntry {
  absl::string_view name;
  DType dtype;
  int size;
};
constexpr DTypeEntry kDTypes[] = {
    {"F64", DType::kF64, 8}, {"F32", DType::kF32, 4}, {"F16", DType::kF16, 2},
    {"BF16", DType::kBF16, 2}, {"I64", DType::kI64, 8}, {"I32", DType::kI32, 4},
    {"I16", DType::kI16, 2}, {"I8", DType::kI8, 1}, {"U8", DType::kU8, 1},
    {"BOOL", DType::kBool, 1}};

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

}  // namespace

absl::string_view DTypeName(DType d) {
  for (const auto& e : kDTypes) {
    if (e.dtype == d) return e.name;
  }
  return "?";
}

int DTypeSize(DType d) {
  for (const auto& e : kDTypes) {
    if (e.dtype == d) return e.size;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return Bad(path, absl::StrCat("truncated: ", size, " bytes, shorter than the 8-byte header length"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return absl::InternalError(absl::StrCat("cannot mmap ", path));

  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = map;
  f->map_size_ = size;
  absl::Status s = f->Index(static_cast<const uint8_t*>(map), size);
  if (!s.ok()) return s;
  return f;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(const std::string& name,
                                                                             const uint8_t* bytes, size_t size) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = name;
  if (size < 8) return Bad(name, absl::StrCat("truncated: ", size, " bytes, shorter than the 8-byte header length"));
  absl::Status s = f->Index(bytes, size);
  if (!s.ok()) return s;
  return f;
}

absl::Status SafetensorsFile::Index(const uint8_t* bytes, uint64_t size) {
  const std::string& path = path_;
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > kMaxHeaderBytes) {
    return Bad(path, absl::StrCat("header length ", header_len, " is absurd (limit ", kMaxHeaderBytes,
                                  " bytes); not a safetensors file?"));
  }
  if (header_len > size - 8) {
    return Bad(path, absl::StrCat("truncated: header length ", header_len, " but only ", size - 8,
                                  " bytes follow"));
  }
  const absl::string_view header(reinterpret_cast<const char*>(bytes + 8), header_len);
  json j = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad(path, "header is not a JSON object");

  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  try {
    for (const auto& [name, entry] : j.items()) {
      if (name == "__metadata__") continue;
      const std::string where = absl::StrCat("tensor '", name, "'");
      if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
          !entry.contains("data_offsets")) {
        return Bad(path, absl::StrCat(where, ": entry needs dtype, shape and data_offsets"));
      }
      TensorInfo t;
      t.name = name;
      const json& dt = entry["dtype"];
      const DTypeEntry* found = nullptr;
      for (const auto& e : kDTypes) {
        if (dt.is_string() && dt.get<std::string>() == e.name) found = &e;
      }
      if (found == nullptr) return Bad(path, absl::StrCat(where, ": unknown dtype ", dt.dump()));
      t.dtype = found->dtype;
      const json& shape = entry["shape"];
      if (!shape.is_array()) return Bad(path, absl::StrCat(where, ": shape must be an array"));
      uint64_t numel = 1;
      for (const json& d : shape) {
        if (!d.is_number_unsigned()) {
          return Bad(path, absl::StrCat(where, ": shape entries must be non-negative integers"));
        }
        const uint64_t v = d.get<uint64_t>();
        if (v != 0 && numel > (uint64_t{1} << 62) / v) {
          return Bad(path, absl::StrCat(where, ": shape overflows"));
        }
        numel *= v;
        t.shape.push_back(static_cast<int64_t>(v));
      }
      const json& off = entry["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
          !off[1].is_number_unsigned()) {
        return Bad(path, absl::StrCat(where, ": data_offsets must be [begin, end]"));
      }
      const uint64_t begin = off[0].get<uint64_t>();
      const uint64_t end = off[1].get<uint64_t>();
      if (begin > end || end > data_size) {
        return Bad(path, absl::StrCat(where, ": data_offsets [", begin, ", ", end,
                                      ") lie past the end of the data (", data_size,
                                      " bytes): truncated or corrupt file"));
      }
      if (numel > data_size / found->size || end - begin != numel * found->size) {
        return Bad(path, absl::StrCat(where, ": ", end - begin, " bytes for ", numel, " x ",
                                      found->name, " (expected ", numel * found->size, ")"));
      }
      t.data = data + begin;
      t.nbytes = end - begin;
      tensors_.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    return Bad(path, absl::StrCat("malformed header: ", e.what()));
  }
  // Tensors may not overlap.
  std::vector<const TensorInfo*> sorted;
  for (const auto& t : tensors_) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i - 1]->data + sorted[i - 1]->nbytes > sorted[i]->data) {
      return Bad(path, absl::StrCat("tensors '", sorted[i - 1]->name, "' and '", sorted[i]->name,
                                    "' overlap"));
    }
  }
  return absl::OkStatus();
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

absl::StatusOr<std::vector<float>> ToFloat32(const TensorInfo& t) {
  const int64_t n = t.numel();
  std::vector<float> out(n);
  const bool is_float = t.dtype == DType::kF32 || t.dtype == DType::kF64 || t.dtype == DType::kF16 ||
                        t.dtype == DType::kBF16;
  if (n == 0 && is_float) return out;  // nothing to copy (and memcpy from null is undefined)
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(out.data(), t.data, n * sizeof(float));
      break;
    case DType::kF64:
      for (int64_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, t.data + i * 8, 8);
        out[i] = static_cast<float>(v);
      }
      break;
    case DType::kF16:
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + i * 2, 2);
        out[i] = t.dtype == DType::kF16 ? HalfToFloat(v) : BFloat16ToFloat(v);
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' has dtype ", DTypeName(t.dtype), ", not a float type"));
  }
  return out;
}

}  // namespace relgen
