// The int8 GEMM on AMX-INT8 (tdpbusd on 16-row tiles; the rows left over on AVX-512 VNNI); gemm_int8.cc calls it only where the CPU has it.
// The target is set after every header, as in attention_avx2.cc.
#include <cstdint>

#include <immintrin.h>

#include "kernels/cpu/amx_tiles.h"
#include "kernels/cpu/gemm_int8.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")
#endif

#define RELGEN_INT8_ISA amx
#define RELGEN_INT8_DOT 3
#define RELGEN_INT8_AMX 1
#include "kernels/cpu/gemm_int8_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
