// Device side of relgen's SIMT emulator: what a .cu file sees when it is compiled as C++ against
// tests/simt/include instead of by nvcc. Execution spaces are empty macros, the built-in indices
// read the current emulated thread, and the collectives (__syncthreads, warp shuffles) rendezvous
// with the other emulated threads of the block or warp, checking their masks.
//
// Not for production: this header is reachable only through the emulator's include directory,
// which only test targets (tests/simt) add.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#define RELGEN_SIMT_EMULATOR 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Static shared memory: one object per kernel for the whole process. The emulator runs one block
// at a time (blocks of every launch are serialized), so that is one object per running block.
#define __shared__ static
#define __constant__ static

struct uint3 {
  unsigned int x = 0, y = 0, z = 0;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

typedef struct CUstream_st* cudaStream_t;

namespace simt::detail {

// The emulated thread now running on this OS thread (set by the block scheduler).
// An asynchronous copy to shared memory (cp.async) not yet waited for: `fill` zero bytes end it.
struct AsyncCopy {
  void* dst;
  const void* src;
  size_t bytes, fill;
  int64_t group;  // the commits before it
};
struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  uint3 block_dim;
  uint3 grid_dim;
  unsigned char* dynamic_shared;
  void* lane;  // scheduler state
  std::vector<AsyncCopy> copies;  // issued, not yet waited for, oldest first
  int64_t commits = 0;
};
extern thread_local ThreadContext* current;
inline const ThreadContext& Ctx() { return *current; }

enum class ShuffleKind : int { kIdx = 0, kUp = 1, kDown = 2, kXor = 3, kSync = 4 };
uint64_t WarpCollective(unsigned mask, ShuffleKind kind, uint64_t value, int param, int width);
void SyncThreads();

template <class T>
T Shuffle(unsigned mask, T v, ShuffleKind kind, int param, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = WarpCollective(mask, kind, bits, param, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// Ends the running block with a fault (a kernel's misuse of an intrinsic).
[[noreturn]] void DeviceFault(const char* what);

using KernelBody = std::function<void()>;
// Runs `body` once per thread of every block; errors go to the runtime's last/sticky error.
// `pointers` are the kernel's pointer parameters, for the stream-order check (simt.h).
void Launch(const char* name, dim3 grid, dim3 block, size_t dynamic_shared, cudaStream_t stream,
            const KernelBody& body, const uintptr_t* pointers, size_t num_pointers);

template <class T>
void AddIfPointer(std::vector<uintptr_t>* out, const T& v) {
  if constexpr (std::is_pointer_v<T>) out->push_back(reinterpret_cast<uintptr_t>(v));
}

template <class... P>
struct Launcher {
  const char* name;
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <class... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P),
                  "kernel launched with the wrong number of arguments");
    // Kernel parameters are copied once at launch, as the driver does, and each thread gets its
    // own.
    const std::tuple<std::decay_t<P>...> params(
        static_cast<std::decay_t<P>>(std::forward<A>(args))...);
    auto* k = kernel;
    // Pointer parameters only: a struct's padding may hold stale pointers.
    std::vector<uintptr_t> pointers;
    std::apply([&pointers](const auto&... p) { (AddIfPointer(&pointers, p), ...); }, params);
    // The body owns its copy: a graph being captured keeps it past this call.
    Launch(name, grid, block, smem, stream, [params, k] { std::apply(k, params); }, pointers.data(),
           pointers.size());
  }
};
template <class... P>
Launcher<P...> MakeLauncher(const char* name, void (*kernel)(P...), dim3 grid, dim3 block,
                            size_t smem, cudaStream_t stream) {
  return Launcher<P...>{name, kernel, grid, block, smem, stream};
}

}  // namespace simt::detail

#define threadIdx (::simt::detail::Ctx().thread_idx)
#define blockIdx (::simt::detail::Ctx().block_idx)
#define blockDim (::simt::detail::Ctx().block_dim)
#define gridDim (::simt::detail::Ctx().grid_dim)
inline constexpr int warpSize = 32;

// Used by kernels/cuda/launch.h.
#define RELGEN_SIMT_LAUNCH(kernel, grid, block, smem, stream) \
  ::simt::detail::MakeLauncher(#kernel, kernel, (grid), (block), (smem), (stream))
#define RELGEN_SIMT_DYNAMIC_SHARED(type, name) \
  type* const name = reinterpret_cast<type*>(::simt::detail::Ctx().dynamic_shared)

inline void __syncthreads() { ::simt::detail::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::simt::detail::WarpCollective(mask, ::simt::detail::ShuffleKind::kSync, 0, 0, 32);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return ::simt::detail::Shuffle(mask, v, ::simt::detail::ShuffleKind::kIdx, src_lane, width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::simt::detail::Shuffle(mask, v, ::simt::detail::ShuffleKind::kUp, static_cast<int>(delta),
                                 width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::simt::detail::Shuffle(mask, v, ::simt::detail::ShuffleKind::kDown,
                                 static_cast<int>(delta), width);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::simt::detail::Shuffle(mask, v, ::simt::detail::ShuffleKind::kXor, lane_mask, width);
}

// Atomics (relaxed read-modify-write, as on the device).
template <class T>
T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}
template <class T>
T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load(std::memory_order_relaxed);
  while (old < v && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
  }
  return old;
}

// Memory ordering between blocks: a launch runs its blocks one after another, so a fence has
// nothing left to order (inside a block, the barriers order; TSan sees those).
inline void __threadfence() {}
// Loads that bypass L1 (another block's writes in the same launch): plain loads here.
template <class T>
T __ldcg(const T* p) {
  return *p;
}

// Device math: the fast intrinsics are the accurate functions here (the device's are within a few
// ulp).
inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Each rounded on its own, never contracted into an FMA (the sampler's definitions).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
