// int8 x int8 projections: the inputs quantised per row, the kernel picked by the CPU's features.
#include "kernels/cpu/gemm_int8.h"

#include <cpuid.h>

#include <vector>

#include "kernels/cpu/gemm.h"

namespace relgen::cpu {

std::vector<Int8Isa> SupportedInt8Isas() {
  __builtin_cpu_init();
  std::vector<Int8Isa> isas;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni")) {
    if (AmxUsable(25)) isas.push_back(Int8Isa::kAmx);
    isas.push_back(Int8Isa::kAvx512Vnni);
  }
  // AVX-VNNI: CPUID leaf 7, subleaf 1, EAX bit 4 (not every compiler's __builtin_cpu_supports names it).
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (avx2 && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 4)) != 0) {
    isas.push_back(Int8Isa::kAvxVnni);
  }
  if (avx2) isas.push_back(Int8Isa::kAvx2);
  isas.push_back(Int8Isa::kBase);
  return isas;
}

const char* Int8IsaName(Int8Isa isa) {
  switch (isa) {
    case Int8Isa::kAmx: return "amx-int8";
    case Int8Isa::kAmxEmulated: return "amx-int8 (emulated)";
    case Int8Isa::kAvx512Vnni: return "avx512-vnni";
    case Int8Isa::kAvxVnni: return "avx-vnni";
    case Int8Isa::kAvx2: return "avx2";
    case Int8Isa::kBase: break;
  }
  return "base";
}

void LinearInt8(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool,
                Int8Isa isa) {
  if (rows == 0) return;
  const int k = w.k(), k4 = w.padded_k();
  // The caller's thread owns these while the pool works on them (ParallelFor returns when done).
  static thread_local std::vector<int8_t> q;
  static thread_local std::vector<float> scales;
  q.resize(static_cast<size_t>(rows) * k4);
  scales.resize(static_cast<size_t>(rows));
  // Pointers, not the names: a worker thread naming a thread_local would see its own.
  int8_t* const qd = q.data();
  float* const sd = scales.data();
  float (*quantize_row)(const float*, int, int, int8_t*) = int8::base::QuantizeRow;
  void (*panels)(const int8::Job&, int, int) = int8::base::Panels;
  switch (isa) {
    case Int8Isa::kAmx:
      quantize_row = int8::amx::QuantizeRow;
      panels = int8::amx::Panels;
      break;
    case Int8Isa::kAmxEmulated:
      quantize_row = int8::amx_emulated::QuantizeRow;
      panels = int8::amx_emulated::Panels;
      break;
    case Int8Isa::kAvx512Vnni:
      quantize_row = int8::avx512vnni::QuantizeRow;
      panels = int8::avx512vnni::Panels;
      break;
    case Int8Isa::kAvxVnni:
      quantize_row = int8::avxvnni::QuantizeRow;
      panels = int8::avxvnni::Panels;
      break;
    case Int8Isa::kAvx2:
      quantize_row = int8::avx2::QuantizeRow;
      panels = int8::avx2::Panels;
      break;
    case Int8Isa::kBase: break;
  }
  auto quantize = [=](int r0, int r1) {
    for (int r = r0; r < r1; ++r) sd[r] = quantize_row(x + static_cast<int64_t>(r) * k, k, k4, qd + static_cast<int64_t>(r) * k4);
  };
  int8::Job job;
  job.q = qd;
  job.x_scales = sd;
  job.rows = rows;
  job.w = &w;
  job.bias = bias;
  job.y = y;
  if (pool == nullptr) {
    quantize(0, rows);
    panels(job, 0, w.panels());
    return;
  }
  if (rows > 1) {
    pool->ParallelFor(rows, quantize);
  } else {
    quantize(0, 1);
  }
  pool->ParallelFor(w.panels(), [&](int begin, int end) { panels(job, begin, end); });
}

}  // namespace relgen::cpu

// The baseline kernel (any x86-64 CPU).
#define RELGEN_INT8_ISA base
#define RELGEN_INT8_DOT 0
#include "kernels/cpu/gemm_int8_impl.h"
