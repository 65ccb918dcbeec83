// bfloat16 as stored by the CPU kernels (packed weights, the K/V cache): the top 16 bits of a
// float32, rounded to nearest even. Widening back is exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace relgen::cpu {

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

}  // namespace relgen::cpu
