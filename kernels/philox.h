// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, so a draw is a pure function of (key, counter) and host and device
// compute the same bits. Sampling keys it with the request's seed and counts with the token index.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RELGEN_PHILOX_HD __host__ __device__ __forceinline__
#else
#define RELGEN_PHILOX_HD inline
#endif

namespace relgen::philox {

struct U32x4 {
  uint32_t v[4];
};

RELGEN_PHILOX_HD U32x4 Philox4x32_10(U32x4 ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t{0xD2511F53u} * ctr.v[0];
    const uint64_t p1 = uint64_t{0xCD9E8D57u} * ctr.v[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = U32x4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
  }
  return ctr;
}

// A uniform double in [0, 1) with 53 random bits, for draw `index` of the stream keyed by `seed`.
RELGEN_PHILOX_HD double Uniform(uint64_t seed, uint64_t index) {
  const U32x4 r = Philox4x32_10(U32x4{{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), 0u, 0u}},
                                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (uint64_t{r.v[0]} << 32 | r.v[1]) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

}  // namespace relgen::philox
