// The int8 GEMM on AVX-512 VNNI with the AMX kernel's blocking, its tile instructions emulated in C++ (tests of that blocking on CPUs without AMX); gemm_int8.cc calls it only where the CPU has it.
// The target is set after every header, as in attention_avx2.cc.
#include <cstdint>

#include <immintrin.h>

#include "kernels/cpu/amx_tiles.h"
#include "kernels/cpu/gemm_int8.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
#endif

#define RELGEN_INT8_ISA amx_emulated
#define RELGEN_INT8_DOT 3
#define RELGEN_INT8_AMX 2
#include "kernels/cpu/gemm_int8_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
