// Attention for CPUs with AVX-512 (F); attention.cc calls it only where the CPU has it.
// The target is set by pragma on the functions of attention_impl.h alone, after every header they
// use: inline functions of those headers (the standard library's among them) must not be compiled
// for AVX-512 here, or the linker could keep that copy for the baseline code too.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "kernels/cpu/attention.h"
#include "kernels/bf16.h"
#include "kernels/cpu/ops.h"
#include "kernels/relpos.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif

#define RELGEN_ATTENTION_ISA avx512
#define RELGEN_ATTENTION_VECTOR16 1
#include "kernels/cpu/attention_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
