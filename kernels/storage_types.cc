#include "kernels/storage_types.h"

namespace relgen {

const char* KvTypeName(KvType t) { return t == KvType::kBf16 ? "bf16" : "f32"; }

bool ParseKvType(const std::string& name, KvType* t) {
  for (KvType c : {KvType::kF32, KvType::kBf16}) {
    if (name == KvTypeName(c)) {
      *t = c;
      return true;
    }
  }
  return false;
}

int KvTypeBytes(KvType t) { return t == KvType::kBf16 ? 2 : 4; }

const char* WeightTypeName(WeightType t) {
  switch (t) {
    case WeightType::kBf16: return "bf16";
    case WeightType::kInt8: return "int8";
    case WeightType::kF32: break;
  }
  return "f32";
}

bool ParseWeightType(const std::string& name, WeightType* t) {
  for (WeightType c : {WeightType::kF32, WeightType::kBf16, WeightType::kInt8}) {
    if (name == WeightTypeName(c)) {
      *t = c;
      return true;
    }
  }
  return false;
}

int WeightTypeBytes(WeightType t) {
  switch (t) {
    case WeightType::kBf16: return 2;
    case WeightType::kInt8: return 1;
    case WeightType::kF32: break;
  }
  return 4;
}

}  // namespace relgen
