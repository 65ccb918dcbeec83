// The bf16 x bf16 GEMM on AMX-BF16 (tdpbf16ps); gemm.cc calls it only where the CPU has it and Linux
// lets the process use the tiles. The target is set after every header, as in attention_avx2.cc.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "kernels/cpu/amx_tiles.h"
#include "kernels/bf16.h"
#include "kernels/cpu/gemm.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#endif

#define RELGEN_BF16_AMX_NS bf16amx
#define RELGEN_BF16_AMX 1
#include "kernels/cpu/gemm_bf16_amx_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
