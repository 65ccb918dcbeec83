// bfloat16 as relgen stores it on every device (the CPU's packed weights and K/V cache, the CUDA
// backend's uploaded weights and pool): the top 16 bits of a float32, rounded to nearest even.
// Widening back is exact. Device-neutral: the CPU kernels and both backends read the rule here, and
// kernels/cuda's device code implements the same rule on the bits (tested bit for bit against this).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace relgen {

// Round to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline float FromBf16(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The CPU kernels, and the backends and tests written against them, spell the rule cpu::ToBf16:
// the same functions under that name, so there is one rule whichever name a caller uses.
namespace cpu {
using ::relgen::FromBf16;
using ::relgen::ToBf16;
}  // namespace cpu

}  // namespace relgen
