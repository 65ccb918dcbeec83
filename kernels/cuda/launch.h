// Single-source kernel launches. Every launch in kernels/cuda goes through RELGEN_LAUNCH, so the
// same source text compiles two ways:
//   - by nvcc (__CUDACC__): RELGEN_LAUNCH(k, grid, block, smem, stream)(args...) is the
//   triple-chevron
//     launch k<<<grid, block, smem, stream>>>(args...);
//   - as C++ against relgen's SIMT emulator (tests/simt/include on the include path, test targets
//     only): the emulator's launcher, which runs the kernel's blocks on the CPU.
// RELGEN_DYNAMIC_SHARED(type, name) declares the block's dynamic shared memory (`extern __shared__
// type name[]` under nvcc, the emulator's per-block buffer otherwise).
// tests/simt/check_launches.cmake keeps every other file of the repository free of triple chevrons.
#pragma once

#if defined(__CUDACC__)

#define RELGEN_LAUNCH(kernel, grid, block, smem, stream) \
  kernel<<<(grid), (block), (smem), (stream)>>>
#define RELGEN_DYNAMIC_SHARED(type, name) extern __shared__ type name[]

#else

#include <cuda_runtime.h>

#if !defined(RELGEN_SIMT_EMULATOR)
#error \
    "kernels/cuda compiles with nvcc or, as C++, against the SIMT emulator (tests/simt/include), never against the real cuda_runtime.h"
#endif
#define RELGEN_LAUNCH(kernel, grid, block, smem, stream) \
  RELGEN_SIMT_LAUNCH(kernel, grid, block, smem, stream)
#define RELGEN_DYNAMIC_SHARED(type, name) RELGEN_SIMT_DYNAMIC_SHARED(type, name)

#endif
