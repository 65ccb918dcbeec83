// The int8 GEMM's panel loop, compiled once per instruction set (gemm_int8_<isa>.cc sets the target,
// RELGEN_INT8_ISA and RELGEN_INT8_DOT, then includes this). Every kernel sums the same int8 x int8
// products exactly in int32, so the order of the sums is free and every kernel gives the same bits.
#ifndef RELGEN_INT8_ISA
#error "define RELGEN_INT8_ISA before including gemm_int8_impl.h"
#endif

// RELGEN_INT8_DOT: 0 plain C++, 1 AVX2 (sign + maddubs + madd), 2 AVX-VNNI, 3 AVX-512 VNNI.
// RELGEN_INT8_AMX (with DOT 3): 1 AMX-INT8 tiles for whole 16-row blocks, 2 the same with the tile
// instructions emulated in C++ (tests).
#ifndef RELGEN_INT8_AMX
#define RELGEN_INT8_AMX 0
#endif
#if RELGEN_INT8_DOT == 2 || RELGEN_INT8_DOT == 3
#define RELGEN_INT8_UNSIGNED 1  // vpdpbusd takes unsigned inputs: q + 128, the offsets taken back
#else
#define RELGEN_INT8_UNSIGNED 0
#endif

#if RELGEN_INT8_AMX
#include "kernels/cpu/amx_tiles.h"
#endif

namespace relgen::cpu::int8::RELGEN_INT8_ISA {
namespace {

constexpr int kP = PackedMatrix::kPanel;
constexpr int kRowChunk = 64;  // rows per pass over a panel range (their inputs stay in cache)

inline int32_t Group(const int8_t* q) {
  int32_t g;
  __builtin_memcpy(&g, q, 4);
  return g;
}

// QuantizeRow (gemm.h), vectorised for this target; an unsigned kernel gets q + 128. The maximum
// runs on the bit patterns of |x| (ordered as the floats, infinity and NaN above every finite),
// and rounding to nearest even adds and takes away 1.5 * 2^23: both exact for |v| <= 127.
float Quantize(const float* x, int k, int padded, int8_t* q) {
  uint32_t most = 0;
  for (int i = 0; i < k; ++i) {
    uint32_t u;
    __builtin_memcpy(&u, x + i, 4);
    u &= 0x7fffffffu;
    most = u > most ? u : most;
  }
  constexpr int8_t kZero = RELGEN_INT8_UNSIGNED ? -128 : 0;  // 0 + 128 as a byte
  if (most == 0 || most >= 0x7f800000u) {
    for (int i = 0; i < padded; ++i) q[i] = kZero;
    return most == 0 ? 0.0f : __builtin_nanf("");
  }
  float amax;
  __builtin_memcpy(&amax, &most, 4);
  const float inv = 127.0f / amax;
  for (int i = 0; i < k; ++i) {
    float v = x[i] * inv;
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    v = (v + 12582912.0f) - 12582912.0f;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(v) ^ (RELGEN_INT8_UNSIGNED ? 0x80 : 0));
  }
  for (int i = k; i < padded; ++i) q[i] = kZero;
  return amax / 127.0f;
}

// Sums of R rows x P panels over all k: sums[r][p * 16 + c], for an unsigned kernel before the
// offsets are taken off.
template <int R, int P>
__attribute__((always_inline)) inline void Dots(const int8_t* q, int ldq, const int8_t* panel, int64_t pstride, int k4,
                                                int32_t* sums) {
#if RELGEN_INT8_DOT == 3
  __m512i acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_si512();
  }
  for (int g = 0; g < k4; g += 4) {
    __m512i w[P];
    for (int p = 0; p < P; ++p) w[p] = _mm512_loadu_si512(panel + p * pstride + g * kP);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(Group(q + r * ldq + g));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], xb, w[p]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) _mm512_storeu_si512(sums + r * P * kP + p * kP, acc[r][p]);
  }
#elif RELGEN_INT8_DOT == 1 || RELGEN_INT8_DOT == 2
  constexpr int L = 2 * P;  // 8 outputs x 4 inputs per 32-byte vector
  __m256i acc[R][L];
  for (int r = 0; r < R; ++r) {
    for (int l = 0; l < L; ++l) acc[r][l] = _mm256_setzero_si256();
  }
#if RELGEN_INT8_DOT == 1
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int g = 0; g < k4; g += 4) {
    __m256i w[L];
    for (int l = 0; l < L; ++l) {
      w[l] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (l / 2) * pstride + g * kP + (l % 2) * 32));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xb = _mm256_set1_epi32(Group(q + r * ldq + g));
#if RELGEN_INT8_DOT == 2
      for (int l = 0; l < L; ++l) acc[r][l] = _mm256_dpbusd_avx_epi32(acc[r][l], xb, w[l]);
#else
      // |x| times w with x's sign: each byte product as x * w, pairs summed in int16 (at most
      // 2 * 127 * 127, no saturation: neither operand is -128), then pairs of those in int32.
      const __m256i ax = _mm256_abs_epi8(xb);
      for (int l = 0; l < L; ++l) {
        const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[l], xb));
        acc[r][l] = _mm256_add_epi32(acc[r][l], _mm256_madd_epi16(pairs, ones));
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int l = 0; l < L; ++l) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * P * kP + l * 8), acc[r][l]);
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      int32_t acc[kP] = {};
      for (int g = 0; g < k4; g += 4) {
        const int8_t* x = q + r * ldq + g;
        const int8_t* wg = panel + p * pstride + g * kP;
        for (int c = 0; c < kP; ++c) {
          acc[c] += x[0] * wg[c * 4] + x[1] * wg[c * 4 + 1] + x[2] * wg[c * 4 + 2] + x[3] * wg[c * 4 + 3];
        }
      }
      for (int c = 0; c < kP; ++c) sums[r * P * kP + p * kP + c] = acc[c];
    }
  }
#endif
}

// Sums [R][P * 16] of rows r.. and panels p.. scaled into y.
template <int R, int P>
__attribute__((always_inline)) inline void Scale(const Job& j, int r, int p, const int32_t* sums) {
  const PackedMatrix& w = *j.w;
  const int n = w.n();
  const int c0 = p * kP;
  const int ncols = n - c0 < P * kP ? n - c0 : P * kP;
  const float* ws = w.scales() + c0;
  const int32_t* off = w.offsets() + c0;
  const float* b = j.bias != nullptr ? j.bias + c0 : nullptr;
  for (int i = 0; i < R; ++i) {
    float* yr = j.y + int64_t{r + i} * n + c0;
    const float xs = j.x_scales[r + i];
    const int32_t* si = sums + i * P * kP;
    int c = 0;
    // Int8Epilogue, 16 or 8 outputs at a time: the same roundings (a product, then one fused
    // multiply-add or a product).
#if RELGEN_INT8_DOT == 3
    for (; c + 16 <= ncols; c += 16) {
      __m512i sv = _mm512_loadu_si512(si + c);
#if RELGEN_INT8_UNSIGNED
      sv = _mm512_sub_epi32(sv, _mm512_loadu_si512(off + c));
#endif
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(xs), _mm512_loadu_ps(ws + c));
      const __m512 f = _mm512_cvtepi32_ps(sv);
      _mm512_storeu_ps(yr + c, b != nullptr ? _mm512_fmadd_ps(f, scale, _mm512_loadu_ps(b + c)) : _mm512_mul_ps(f, scale));
    }
#elif RELGEN_INT8_DOT == 1 || RELGEN_INT8_DOT == 2
    for (; c + 8 <= ncols; c += 8) {
      __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(si + c));
#if RELGEN_INT8_UNSIGNED
      sv = _mm256_sub_epi32(sv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(off + c)));
#endif
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(xs), _mm256_loadu_ps(ws + c));
      const __m256 f = _mm256_cvtepi32_ps(sv);
      _mm256_storeu_ps(yr + c, b != nullptr ? _mm256_fmadd_ps(f, scale, _mm256_loadu_ps(b + c)) : _mm256_mul_ps(f, scale));
    }
#endif
    for (; c < ncols; ++c) {
      int32_t s = si[c];
#if RELGEN_INT8_UNSIGNED
      s -= off[c];
#else
      (void)off;
#endif
      yr[c] = Int8Epilogue(s, xs, ws[c], b != nullptr ? b + c : nullptr);
    }
  }
}

// R rows x P panels from panel p, scaled into y.
template <int R, int P>
__attribute__((always_inline)) inline void Block(const Job& j, int r, int p) {
  const PackedMatrix& w = *j.w;
  const int k4 = w.padded_k();
  int32_t sums[R * P * kP];
  Dots<R, P>(j.q + int64_t{r} * k4, k4, static_cast<const int8_t*>(w.panel(p)), int64_t{k4} * kP, k4, sums);
  Scale<R, P>(j, r, p, sums);
}

template <int R>
__attribute__((always_inline)) inline void Tail(const Job& j, int left, int r, int p) {
  if constexpr (R > 0) {
    if (left == R) {
      Block<R, 1>(j, r, p);
    } else {
      Tail<R - 1>(j, left, r, p);
    }
  }
}

#if RELGEN_INT8_AMX
// AMX-INT8: tiles of 16 rows x 64 bytes. The int8 panels are already its B operand ([k/4][16][4],
// 64-byte rows), and tdpbusd takes the same unsigned inputs as vpdpbusd, so the sums (and the
// offsets taken back) are the VNNI kernel's exactly: rows outside whole 16-row blocks go to it.
using tiles::TileConfig;

#if RELGEN_INT8_AMX == 1
// The intrinsics name their tile registers by literal numbers (GCC's paste them into the
// instruction), hence macros rather than templates.
struct Tiles {
  void Configure(const TileConfig& c) { _tile_loadconfig(&c); }
  ~Tiles() { _tile_release(); }
};
#define RELGEN_TILE_ZERO(t, n) _tile_zero(n)
#define RELGEN_TILE_LOAD(t, n, p, stride) _tile_loadd(n, p, stride)
#define RELGEN_TILE_DOT(t, c, a, b) _tile_dpbusd(c, a, b)
#define RELGEN_TILE_STORE(t, n, p, stride) _tile_stored(n, p, stride)
#else
// The tile instructions written in C++, as the ISA defines them: the blocking below is tested on
// CPUs without AMX through these.
struct Tiles : tiles::EmulatedTiles {
  template <int C, int A, int B> void Dot() {
    for (int m = 0; m < cfg.rows[A]; ++m) {
      for (int n = 0; n < cfg.colsb[B] / 4; ++n) {
        int32_t acc;
        __builtin_memcpy(&acc, &t[C][m][4 * n], 4);
        for (int k = 0; k < cfg.colsb[A] / 4; ++k) {
          for (int i = 0; i < 4; ++i) {
            acc += int32_t{t[A][m][4 * k + i]} * int32_t{static_cast<int8_t>(t[B][k][4 * n + i])};
          }
        }
        __builtin_memcpy(&t[C][m][4 * n], &acc, 4);
      }
    }
  }
};
#define RELGEN_TILE_ZERO(t, n) t.Zero<n>()
#define RELGEN_TILE_LOAD(t, n, p, stride) t.Load<n>(p, stride)
#define RELGEN_TILE_DOT(t, c, a, b) t.Dot<c, a, b>()
#define RELGEN_TILE_STORE(t, n, p, stride) t.Store<n>(p, stride)
#endif

// Whole 16-row blocks of rows [r0, r1) over panels [p_begin, p_end), two panels at a time (tiles 0
// and 1 the sums, 2-4 a 64-byte step of inputs and weights, 5-7 the last step when k4 is not a
// multiple of 64). Returns the first row left.
int AmxRows(const Job& j, int r0, int r1, int p_begin, int p_end) {
  const int blocks = (r1 - r0) / 16;
  if (blocks == 0) return r0;
  const PackedMatrix& w = *j.w;
  const int k4 = w.padded_k(), tail = k4 % 64, main = k4 - tail;
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4}) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  if (tail > 0) {
    c.rows[5] = 16;
    c.colsb[5] = static_cast<uint16_t>(tail);
    c.rows[6] = c.rows[7] = static_cast<uint8_t>(tail / 4);
    c.colsb[6] = c.colsb[7] = 64;
  }
  Tiles t;
  t.Configure(c);
  alignas(64) int32_t sums[16 * 2 * kP];
  for (int p = p_begin; p < p_end; p += 2) {
    const bool two = p + 1 < p_end;
    const int8_t* b0 = static_cast<const int8_t*>(w.panel(p));
    const int8_t* b1 = two ? static_cast<const int8_t*>(w.panel(p + 1)) : b0;
    for (int blk = 0; blk < blocks; ++blk) {
      const int r = r0 + 16 * blk;
      const int8_t* a = j.q + int64_t{r} * k4;
      RELGEN_TILE_ZERO(t, 0);
      RELGEN_TILE_ZERO(t, 1);
      for (int kk = 0; kk < main; kk += 64) {
        RELGEN_TILE_LOAD(t, 2, a + kk, k4);
        RELGEN_TILE_LOAD(t, 3, b0 + int64_t{kk} * kP, 64);
        RELGEN_TILE_DOT(t, 0, 2, 3);
        if (two) {
          RELGEN_TILE_LOAD(t, 4, b1 + int64_t{kk} * kP, 64);
          RELGEN_TILE_DOT(t, 1, 2, 4);
        }
      }
      if (tail > 0) {
        RELGEN_TILE_LOAD(t, 5, a + main, k4);
        RELGEN_TILE_LOAD(t, 6, b0 + int64_t{main} * kP, 64);
        RELGEN_TILE_DOT(t, 0, 5, 6);
        if (two) {
          RELGEN_TILE_LOAD(t, 7, b1 + int64_t{main} * kP, 64);
          RELGEN_TILE_DOT(t, 1, 5, 7);
        }
      }
      if (two) {
        RELGEN_TILE_STORE(t, 0, sums, 2 * kP * 4);
        RELGEN_TILE_STORE(t, 1, sums + kP, 2 * kP * 4);
        Scale<16, 2>(j, r, p, sums);
      } else {
        RELGEN_TILE_STORE(t, 0, sums, kP * 4);
        Scale<16, 1>(j, r, p, sums);
      }
    }
  }
  return r0 + 16 * blocks;
}
#endif

#if RELGEN_INT8_DOT == 3
constexpr int kRows = 8, kDecodePanels = 4, kPanels = 2;
#elif RELGEN_INT8_DOT == 1 || RELGEN_INT8_DOT == 2
constexpr int kRows = 4, kDecodePanels = 2, kPanels = 1;
#else
constexpr int kRows = 2, kDecodePanels = 1, kPanels = 1;
#endif

}  // namespace

void Panels(const Job& j, int p_begin, int p_end) {
  const int n = j.w->n();
  for (int chunk = 0; chunk < j.rows; chunk += kRowChunk) {
    const int r1 = j.rows < chunk + kRowChunk ? j.rows : chunk + kRowChunk;
#if RELGEN_INT8_AMX
    const int r0 = AmxRows(j, chunk, r1, p_begin, p_end);
    if (r0 == r1) continue;
#else
    const int r0 = chunk;
#endif
    int p = p_begin;
    if (r1 - r0 == 1) {
      // One row (decode at batch 1): several whole panels per pass, for independent chains.
      for (; p + kDecodePanels <= p_end && (p + kDecodePanels) * kP <= n; p += kDecodePanels) {
        Block<1, kDecodePanels>(j, r0, p);
      }
    }
    for (; p < p_end; ++p) {
      int r = r0;
      if (kPanels > 1 && p + kPanels <= p_end && (p + kPanels) * kP <= n) {
        for (; r + kRows <= r1; r += kRows) Block<kRows, kPanels>(j, r, p);
        for (int pp = p; pp < p + kPanels; ++pp) Tail<kRows - 1>(j, r1 - r, r, pp);
        p += kPanels - 1;
        continue;
      }
      for (; r + kRows <= r1; r += kRows) Block<kRows, 1>(j, r, p);
      Tail<kRows - 1>(j, r1 - r, r, p);
    }
  }
}

float QuantizeRow(const float* x, int k, int padded, int8_t* q) { return Quantize(x, k, padded, q); }

}  // namespace relgen::cpu::int8::RELGEN_INT8_ISA

#undef RELGEN_INT8_UNSIGNED
#undef RELGEN_INT8_AMX
#undef RELGEN_TILE_ZERO
#undef RELGEN_TILE_LOAD
#undef RELGEN_TILE_DOT
#undef RELGEN_TILE_STORE
