// The SIMT emulator's asynchronous copies to shared memory (cp.async through the pipeline
// primitives). A copy happens as late as CUDA allows: when __pipeline_wait_prior lets its group
// go, on the thread that issued it. A kernel that reads a stage before waiting for it reads what
// was there before, and one that skips the barrier after the wait races with the issuing thread
// (TSan's thread mode sees it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "simt/device.h"

inline void __pipeline_memcpy_async(void* dst_shared, const void* src_global, size_t size_and_align, size_t zfill = 0) {
  if (size_and_align != 4 && size_and_align != 8 && size_and_align != 16) {
    ::simt::detail::DeviceFault("__pipeline_memcpy_async copies 4, 8 or 16 bytes");
  }
  if (zfill > size_and_align) ::simt::detail::DeviceFault("__pipeline_memcpy_async fills more than it copies");
  if ((reinterpret_cast<uintptr_t>(dst_shared) | reinterpret_cast<uintptr_t>(src_global)) & (size_and_align - 1)) {
    ::simt::detail::DeviceFault("__pipeline_memcpy_async with an address not aligned to its size");
  }
  ::simt::detail::ThreadContext& c = *::simt::detail::current;
  c.copies.push_back({dst_shared, src_global, size_and_align, zfill, c.commits});
}

inline void __pipeline_commit() { ++::simt::detail::current->commits; }

// Completes every copy but those of the newest `prior` committed groups (and the uncommitted).
inline void __pipeline_wait_prior(size_t prior) {
  ::simt::detail::ThreadContext& c = *::simt::detail::current;
  size_t kept = 0;
  for (size_t i = 0; i < c.copies.size(); ++i) {
    ::simt::detail::AsyncCopy& a = c.copies[i];
    if (a.group < c.commits - static_cast<int64_t>(prior)) {
      std::memcpy(a.dst, a.src, a.bytes - a.fill);
      std::memset(static_cast<unsigned char*>(a.dst) + (a.bytes - a.fill), 0, a.fill);
    } else {
      c.copies[kept++] = a;
    }
  }
  c.copies.resize(kept);
}
