// Attention for any x86-64 CPU (baseline instruction set).
#define RELGEN_ATTENTION_ISA base
#include "kernels/cpu/attention_impl.h"
