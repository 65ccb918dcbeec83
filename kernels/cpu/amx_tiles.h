// AMX tile plumbing shared by the int8 and bf16 AMX kernels: the 64-byte tile configuration, and
// for the emulated kernels (tests on CPUs without AMX) the tile registers and the instructions that
// move data, written in C++ as the ISA defines them. Each kernel adds its own dot product.
#pragma once

#include <cstdint>
#include <cstring>

// Internal linkage: each kernel file compiles its own copy, for its own target.
namespace relgen::cpu::tiles {
namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "the tile configuration is 64 bytes");

struct EmulatedTiles {
  TileConfig cfg;
  alignas(64) uint8_t t[8][16][64];
  void Configure(const TileConfig& c) { cfg = c; }
  template <int T> void Zero() { std::memset(t[T], 0, sizeof t[T]); }
  template <int T> void Load(const void* p, int stride) {
    for (int r = 0; r < cfg.rows[T]; ++r) std::memcpy(t[T][r], static_cast<const char*>(p) + r * stride, cfg.colsb[T]);
  }
  template <int T> void Store(void* p, int stride) const {
    for (int r = 0; r < cfg.rows[T]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, t[T][r], cfg.colsb[T]);
  }
};

}  // namespace
}  // namespace relgen::cpu::tiles
