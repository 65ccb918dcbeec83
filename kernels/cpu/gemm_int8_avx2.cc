// The int8 GEMM on AVX2 (vpsignb + vpmaddubsw + vpmaddwd); gemm_int8.cc calls it only where the CPU has it.
// The target is set after every header, as in attention_avx2.cc.
#include <cstdint>

#include <immintrin.h>

#include "kernels/cpu/gemm_int8.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define RELGEN_INT8_ISA avx2
#define RELGEN_INT8_DOT 1
#include "kernels/cpu/gemm_int8_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
