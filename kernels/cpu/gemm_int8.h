// The int8 GEMM's pieces shared by its per-instruction-set files (gemm_int8_*.cc): one call
// computes panels [p_begin, p_end) of y for every row of a job.
#pragma once

#include <cstdint>

#include "kernels/cpu/gemm.h"

namespace relgen::cpu::int8 {

struct Job {
  const int8_t* q = nullptr;   // [rows][w->padded_k()] quantised input rows (this kernel's QuantizeRow)
  const float* x_scales = nullptr;  // [rows]
  int rows = 0;
  const PackedMatrix* w = nullptr;
  const float* bias = nullptr;  // [n] or null
  float* y = nullptr;           // [rows][n]
};

// Each kernel's QuantizeRow: one input row quantised: amax = max |x|; scale = amax / 127 and
// q[i] = round-to-nearest-even(x[i] * (127 / amax)) in [-127, 127]; q is zero-padded to `padded`.
// A zero row has scale 0; a row holding an infinity or NaN has scale NaN (its outputs are NaN).
// (A VNNI kernel stores q + 128.)
#define RELGEN_INT8_DECLARE(isa) \
  namespace isa {                \
  void Panels(const Job& job, int p_begin, int p_end); \
  float QuantizeRow(const float* x, int k, int padded, int8_t* q); \
  }
RELGEN_INT8_DECLARE(amx)
RELGEN_INT8_DECLARE(amx_emulated)
RELGEN_INT8_DECLARE(avx512vnni)
RELGEN_INT8_DECLARE(avxvnni)
RELGEN_INT8_DECLARE(avx2)
RELGEN_INT8_DECLARE(base)
#undef RELGEN_INT8_DECLARE

}  // namespace relgen::cpu::int8
