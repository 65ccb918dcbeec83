// relgen's SIMT emulator, the test-facing API: counters, configuration, faults. The emulator runs
// the CUDA kernels of kernels/cuda (compiled as C++ against tests/simt/include) on the CPU: each
// block's threads are fibers switching at __syncthreads and warp collectives (or, with
// RELGEN_SIMT_THREADS=1, one OS thread per CUDA thread, so TSan sees races inside a block).
//
// Environment (read at first use; the setters below override it):
//   RELGEN_SIMT_THREADS=1          one OS thread per CUDA thread instead of fibers
//   RELGEN_SIMT_REVERSE_BLOCKS=1   run each grid's blocks last to first
//   RELGEN_SIMT_MEMORY_BYTES=N     device memory (cudaMalloc fails past it; cudaMemGetInfo total)
//
// Thread-safety: every function may be called from any thread; kernel launches from different host
// threads are serialized.
#pragma once

#include <cstdint>
#include <string>

namespace simt {

inline constexpr const char* kDeviceName = "simt-emulator";

struct Counters {
  int64_t launches = 0;          // kernels launched (and run), a graph's once per replay
  int64_t host_launches = 0;     // what the host submitted to a stream: kernels and GEMMs issued
                                 // outside a capture, and graph launches (one each)
  int64_t graph_launches = 0;    // cudaGraphLaunch calls that ran
  int64_t captured = 0;          // kernels and GEMMs recorded into a stream capture
  int64_t launch_errors = 0;     // launches refused (configuration) or faulted
  int64_t blocks = 0;            // blocks run
  int64_t threads = 0;           // CUDA threads run
  int64_t syncthreads = 0;       // __syncthreads barriers completed (per block)
  int64_t warp_collectives = 0;  // warp shuffles / __syncwarp completed (per group of lanes)
  int64_t gemms = 0;             // cuBLAS GEMMs run (batched: one per batch entry)
  int64_t gemm_flops = 0;        // 2*m*n*k summed
  int64_t bytes_h2d = 0, bytes_d2h = 0, bytes_d2d = 0;
  int64_t copies_d2h = 0;            // device-to-host copies
  int64_t bytes_d2h_pageable = 0;    // of bytes_d2h, into host memory not from cudaMallocHost
  int64_t bytes_h2d_pageable = 0;    // of bytes_h2d, from host memory not from cudaMallocHost
  int64_t mallocs = 0, frees = 0;
  int64_t stream_hazards = 0;    // device memory read or written on one stream while another
                                 // stream's copy or GEMM into it is not ordered before (a fault)
  int64_t bytes_in_use = 0, peak_bytes_in_use = 0;
};

Counters GetCounters();
void ResetCounters();

// Device memory limit in bytes (default: RELGEN_SIMT_MEMORY_BYTES, else 4 GiB).
void SetMemoryLimit(int64_t bytes);
int64_t MemoryLimit();
void SetThreadMode(bool one_os_thread_per_cuda_thread);
bool ThreadMode();
void SetReverseBlocks(bool reverse);

// Stream order: a copy (cudaMemcpy runs on the legacy stream) or GEMM output into an allocation is
// "in flight on its stream" until that stream or the device is synchronized. A launch, GEMM or copy
// on another stream that touches the allocation before then, where CUDA does not order the two
// streams (a non-blocking stream and the legacy stream, or two created streams), is a stream
// hazard: on a device it would read or write data not yet there. The emulator runs everything at
// once, so it makes the hazard a fault. A kernel's touches are its pointer parameters (pointers
// inside struct parameters are not seen).

// Makes the n-th kernel launch from now (1: the next) fault as a device would asynchronously: the
// error is sticky until ResetDevice. RELGEN_SIMT_FAULT_AT_LAUNCH=n does the same from process start
// (for a whole server on the emulator). 0 cancels.
void FaultAtLaunch(int64_t n);

// The last kernel fault's description ("" when none), and clearing the sticky error it left.
std::string LastFault();
void ResetDevice();

}  // namespace simt
