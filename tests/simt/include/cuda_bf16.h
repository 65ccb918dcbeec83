// The SIMT emulator's bfloat16: storage and the conversions relgen's kernels use.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  unsigned short __x;
};

// Round to nearest even; a NaN stays a quiet NaN (the device's __float2bfloat16_rn).
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.__x = static_cast<unsigned short>((u >> 16) | 0x40u);
  } else {
    h.__x = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16{bits}; }
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t{h.__x} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
