// The AMX-BF16 GEMM's blocking with its tile instructions written in C++ (tests, on any CPU).
#define RELGEN_BF16_AMX_NS bf16amx_emulated
#define RELGEN_BF16_AMX 2
#include "kernels/cpu/gemm_bf16_amx_impl.h"
