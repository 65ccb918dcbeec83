// How weights and the K/V cache are stored, named the same on every device: the CPU kernels, the
// CUDA backend and the flags that choose them all speak these types.
#pragma once

#include <string>

namespace relgen {

enum class KvType { kF32, kBf16 };
const char* KvTypeName(KvType t);  // "f32", "bf16"
bool ParseKvType(const std::string& name, KvType* t);
int KvTypeBytes(KvType t);

enum class WeightType { kF32, kBf16, kInt8 };
const char* WeightTypeName(WeightType t);  // "f32", "bf16", "int8"
bool ParseWeightType(const std::string& name, WeightType* t);
int WeightTypeBytes(WeightType t);

// The CPU kernels and the code written against them spell these cpu::KvType and cpu::WeightType.
namespace cpu {
using ::relgen::KvType;
using ::relgen::KvTypeBytes;
using ::relgen::KvTypeName;
using ::relgen::ParseKvType;
using ::relgen::ParseWeightType;
using ::relgen::WeightType;
using ::relgen::WeightTypeBytes;
using ::relgen::WeightTypeName;
}  // namespace cpu

}  // namespace relgen
