// The bf16 x bf16 GEMM on AMX-BF16 tiles (tdpbf16ps), included by gemm_bf16_amx.cc (the tile
// instructions) and gemm_bf16_amx_emulated.cc (the same blocking with the instructions written in
// C++ from the ISA's definition, so that it is tested on CPUs without AMX).
//
// Every row goes through the tiles, a partial 16-row block on tiles of fewer rows: float sums depend
// on their order, so a row may not take another instruction's order because of the rows beside it
// (batch invariance); a tile computes each of its rows alone. k is padded with zeros to whole
// 32-value steps; a zero pair adds +0.
//
// Before including: RELGEN_BF16_AMX_NS (the namespace), RELGEN_BF16_AMX (1 the instructions,
// 2 emulated).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/amx_tiles.h"
#include "kernels/bf16.h"
#include "kernels/cpu/gemm.h"

namespace relgen::cpu::RELGEN_BF16_AMX_NS {
namespace {

constexpr int kP = PackedMatrix::kPanel;  // outputs per panel: a tile's 16 float32 columns
constexpr int kStep = 32;                 // k values per tile step: 16 pairs, a 64-byte tile row
constexpr int kRowChunk = 128;
constexpr int kAhead = 4096;  // bytes of a panel prefetched ahead of its tile loads

using tiles::TileConfig;

#if RELGEN_BF16_AMX == 1
// The intrinsics name their tile registers by literal numbers, hence macros.
struct Tiles {
  void Configure(const TileConfig& c) { _tile_loadconfig(&c); }
  ~Tiles() { _tile_release(); }
};
#define RELGEN_TILE_ZERO(t, n) _tile_zero(n)
#define RELGEN_TILE_LOAD(t, n, p, stride) _tile_loadd(n, p, stride)
#define RELGEN_TILE_DOT(t, c, a, b) _tile_dpbf16ps(c, a, b)
#define RELGEN_TILE_STORE(t, n, p, stride) _tile_stored(n, p, stride)
#else
inline float Widen(uint16_t h) { return FromBf16(h); }
// Denormals in and out are zero (the instruction's DAZ and FTZ).
inline float Ftz(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f; }
// tdpbf16ps as the ISA writes it: per output, the even and the odd products each in a float32
// FMA chain over the tile's k pairs, the two chains added, the result added to the accumulator.
struct Tiles : tiles::EmulatedTiles {
  uint16_t Half(int tile, int row, int i) const {
    uint16_t h;
    std::memcpy(&h, &t[tile][row][2 * i], 2);
    return h;
  }
  template <int C, int A, int B> void Dot() {
    for (int m = 0; m < cfg.rows[C]; ++m) {
      float chain[2][16] = {};
      for (int k = 0; k < cfg.colsb[A] / 4; ++k) {
        for (int n = 0; n < cfg.colsb[C] / 4; ++n) {
          for (int e = 0; e < 2; ++e) {
            const float a = Ftz(Widen(Half(A, m, 2 * k + e))), b = Ftz(Widen(Half(B, k, 2 * n + e)));
            chain[e][n] = Ftz(std::fma(a, b, chain[e][n]));
          }
        }
      }
      for (int n = 0; n < cfg.colsb[C] / 4; ++n) {
        float acc;
        std::memcpy(&acc, &t[C][m][4 * n], 4);
        acc = Ftz(acc + Ftz(chain[0][n] + chain[1][n]));
        std::memcpy(&t[C][m][4 * n], &acc, 4);
      }
    }
  }
};
#define RELGEN_TILE_ZERO(t, n) t.Zero<n>()
#define RELGEN_TILE_LOAD(t, n, p, stride) t.Load<n>(p, stride)
#define RELGEN_TILE_DOT(t, c, a, b) t.Dot<c, a, b>()
#define RELGEN_TILE_STORE(t, n, p, stride) t.Store<n>(p, stride)
#endif

}  // namespace

// Panels [p_begin, p_end) of y for every row, two panels at a time: tiles 0 and 1 their sums, 2 a
// step of 16 input rows, 3 and 4 the step's weights, loaded in place (the panels' pairs layout,
// zero-padded to whole steps, is the [16 pairs][16 outputs][2] the instruction reads).
void Panels(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, int p_begin, int p_end) {
  const int k = w.k(), n = w.n();
  const int kp = w.padded_k();  // a multiple of kStep
  TileConfig c;
  for (int i : {0, 1, 2, 3, 4}) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  Tiles t;
  int shaped = 0;  // the rows of the configured sum and input tiles
  auto shape = [&](int m) {
    if (m == shaped) return;
    c.rows[0] = c.rows[1] = c.rows[2] = static_cast<uint8_t>(m);
    t.Configure(c);
    shaped = m;
  };
  static thread_local std::vector<uint16_t> staged;
  alignas(64) float sums[16 * 2 * kP];
  for (int r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int r1 = rows < r0 + kRowChunk ? rows : r0 + kRowChunk;
    const int blocks = (r1 - r0 + 15) / 16;
    staged.assign(static_cast<size_t>(r1 - r0) * kp, 0);
    for (int r = r0; r < r1; ++r) {
      for (int i = 0; i < k; ++i) staged[static_cast<size_t>(r - r0) * kp + i] = ToBf16(x[static_cast<int64_t>(r) * k + i]);
    }
    for (int p = p_begin; p < p_end; p += 2) {
      const bool two = p + 1 < p_end;
      const uint16_t* b0 = static_cast<const uint16_t*>(w.panel(p));
      const uint16_t* b1 = two ? static_cast<const uint16_t*>(w.panel(p + 1)) : b0;
      for (int blk = 0; blk < blocks; ++blk) {
        const uint16_t* a = staged.data() + static_cast<size_t>(blk) * 16 * kp;
        const int rb = r0 + 16 * blk, re = rb + 16 < r1 ? rb + 16 : r1;
        shape(re - rb);
        RELGEN_TILE_ZERO(t, 0);
        RELGEN_TILE_ZERO(t, 1);
        for (int ks = 0; ks < kp; ks += kStep) {
          if (blk == 0) {
            // The first block streams the panels from memory: ask for the weights kAhead bytes on
            // (tile loads alone leave a batch-1 step below the read bandwidth).
            for (int line = 0; line < 16; ++line) {
              __builtin_prefetch(reinterpret_cast<const char*>(b0 + ks * kP) + kAhead + 64 * line);
              if (two) __builtin_prefetch(reinterpret_cast<const char*>(b1 + ks * kP) + kAhead + 64 * line);
            }
          }
          RELGEN_TILE_LOAD(t, 2, a + ks, kp * 2);
          RELGEN_TILE_LOAD(t, 3, b0 + ks * kP, 64);
          RELGEN_TILE_DOT(t, 0, 2, 3);
          if (two) {
            RELGEN_TILE_LOAD(t, 4, b1 + ks * kP, 64);
            RELGEN_TILE_DOT(t, 1, 2, 4);
          }
        }
        RELGEN_TILE_STORE(t, 0, sums, 2 * kP * 4);
        if (two) RELGEN_TILE_STORE(t, 1, sums + kP, 2 * kP * 4);
        const int c1 = n < (p + (two ? 2 : 1)) * kP ? n : (p + (two ? 2 : 1)) * kP;
        for (int r = rb; r < re; ++r) {
          float* yr = y + static_cast<int64_t>(r) * n;
          const float* s = sums + (r - rb) * 2 * kP;
          for (int col = p * kP; col < c1; ++col) {
            yr[col] = bias != nullptr ? s[col - p * kP] + bias[col] : s[col - p * kP];
          }
        }
      }
    }
  }
}

}  // namespace relgen::cpu::RELGEN_BF16_AMX_NS

#undef RELGEN_TILE_ZERO
#undef RELGEN_TILE_LOAD
#undef RELGEN_TILE_DOT
#undef RELGEN_TILE_STORE
#undef RELGEN_BF16_AMX
#undef RELGEN_BF16_AMX_NS
