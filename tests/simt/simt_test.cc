// The SIMT emulator's own behaviour: collectives and their mask checks, barriers, launch limits,
// block order, thread mode, device memory and cuBLAS argument checking.
#include "tests/simt/simt.h"

#include <cublas_v2.h>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cuda/launch.h"

namespace {

template <class T>
T* Upload(const std::vector<T>& v) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}
template <class T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// Expects the last launch to have faulted with a message containing `what`, then clears it.
void ExpectFault(const std::string& what) {
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);  // sticky
  EXPECT_NE(simt::LastFault().find(what), std::string::npos) << simt::LastFault();
  simt::ResetDevice();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

__global__ void ShuffleKernel(int* out) {
  const int t = threadIdx.x, n = blockDim.x;
  const int v = 100 * t;
  out[0 * n + t] = __shfl_xor_sync(0xffffffffu, v, 5);
  out[1 * n + t] = __shfl_down_sync(0xffffffffu, v, 3);
  out[2 * n + t] = __shfl_up_sync(0xffffffffu, v, 2);
  out[3 * n + t] = __shfl_sync(0xffffffffu, v, 7);
  out[4 * n + t] = __shfl_down_sync(0xffffffffu, v, 1, 8);
  out[5 * n + t] = __shfl_xor_sync(0xffffffffu, v, 4, 8);
  // Half-warp collectives with disjoint masks, in flight together.
  const unsigned half = (t & 16) ? 0xffff0000u : 0x0000ffffu;
  out[6 * n + t] = __shfl_sync(half, v, 1, 16);
  const double d = __shfl_xor_sync(0xffffffffu, 0.5 * t, 1);
  out[7 * n + t] = static_cast<int>(2 * d);
}

int Expected(int row, int t) {
  const int lane = t % 32, warp0 = t - lane;
  auto at = [&](int l) { return 100 * (warp0 + l); };
  switch (row) {
    case 0:
      return at(lane ^ 5);
    case 1:
      return lane + 3 < 32 ? at(lane + 3) : at(lane);
    case 2:
      return lane - 2 >= 0 ? at(lane - 2) : at(lane);
    case 3:
      return at(7);
    case 4:
      return (lane % 8) + 1 < 8 ? at(lane + 1) : at(lane);
    case 5:
      return at(lane ^ 4);
    case 6:
      return at((lane & 16) + 1);
    default:
      return warp0 + (lane ^ 1);  // a double, shuffled
  }
}

void CheckShuffles() {
  const int n = 64;
  int* d = Upload(std::vector<int>(8 * n, -1));
  RELGEN_LAUNCH(ShuffleKernel, 1, n, 0, nullptr)(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << simt::LastFault();
  const std::vector<int> got = Download(d, 8 * n);
  for (int row = 0; row < 8; ++row) {
    for (int t = 0; t < n; ++t)
      ASSERT_EQ(got[row * n + t], Expected(row, t)) << "row " << row << " thread " << t;
  }
  cudaFree(d);
}

TEST(SimtTest, Shuffles) { CheckShuffles(); }

TEST(SimtTest, ShufflesOnThreads) {
  simt::SetThreadMode(true);
  CheckShuffles();
  simt::SetThreadMode(false);
}

__global__ void LaneNotInMask(int* out) { out[threadIdx.x] = __shfl_sync(0x1u, 1, 0); }
__global__ void MaskNamesExited(int* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}
__global__ void MaskNamesMissingLane(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}
__global__ void DivergentBarrier(int* out) {
  if (threadIdx.x < 32) __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void BarrierInsideShuffle(int* out) {
  if (threadIdx.x == 3) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
  }
}
__global__ void ReadsLaneOutsideMask(int* out) {
  if (threadIdx.x < 2) out[threadIdx.x] = __shfl_sync(0x3u, 1, 5);
}

TEST(SimtTest, MaskAndBarrierFaults) {
  for (bool threads : {false, true}) {
    simt::SetThreadMode(threads);
    int* d = Upload(std::vector<int>(64, 0));
    RELGEN_LAUNCH(LaneNotInMask, 1, 32, 0, nullptr)(d);
    ExpectFault("does not name it");
    RELGEN_LAUNCH(MaskNamesExited, 1, 32, 0, nullptr)(d);
    ExpectFault("exit");
    RELGEN_LAUNCH(MaskNamesMissingLane, 1, 20, 0, nullptr)(d);
    ExpectFault("of a warp of 20 threads");
    RELGEN_LAUNCH(DivergentBarrier, 1, 64, 0, nullptr)(d);
    ExpectFault("__syncthreads");
    RELGEN_LAUNCH(BarrierInsideShuffle, 1, 32, 0, nullptr)(d);
    ExpectFault("__syncthreads");
    RELGEN_LAUNCH(ReadsLaneOutsideMask, 1, 32, 0, nullptr)(d);
    ExpectFault("reads lane 5");
    // After a reset the device works again.
    RELGEN_LAUNCH(MaskNamesMissingLane, 1, 32, 0, nullptr)(d);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    cudaFree(d);
  }
  simt::SetThreadMode(false);
}

__global__ void BlockOrder(int* counter, int* out) {
  if (threadIdx.x == 0) out[blockIdx.x + gridDim.x * blockIdx.y] = atomicAdd(counter, 1);
}

TEST(SimtTest, BlockOrderReversible) {
  for (bool reverse : {false, true}) {
    simt::SetReverseBlocks(reverse);
    int* counter = Upload(std::vector<int>{0});
    int* out = Upload(std::vector<int>(12, -1));
    RELGEN_LAUNCH(BlockOrder, dim3(4, 3), 32, 0, nullptr)(counter, out);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<int> got = Download(out, 12);
    for (int i = 0; i < 12; ++i) EXPECT_EQ(got[i], reverse ? 11 - i : i);
    cudaFree(counter);
    cudaFree(out);
  }
  simt::SetReverseBlocks(false);
}

__global__ void SharedPerBlock(float* out) {
  RELGEN_DYNAMIC_SHARED(float, buf);
  const float before = buf[threadIdx.x];  // uninitialized: the emulator fills it with NaN
  __syncthreads();
  buf[threadIdx.x] = blockIdx.x * 1000.f + threadIdx.x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] =
      std::isnan(before) ? buf[(threadIdx.x + 1) % blockDim.x] : -1.f;
}

TEST(SimtTest, DynamicSharedMemoryIsPerBlock) {
  float* out = Upload(std::vector<float>(3 * 40, 0.f));
  RELGEN_LAUNCH(SharedPerBlock, 3, 40, 40 * sizeof(float), nullptr)(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << simt::LastFault();
  const std::vector<float> got = Download(out, 3 * 40);
  for (int b = 0; b < 3; ++b) {
    for (int t = 0; t < 40; ++t) EXPECT_EQ(got[b * 40 + t], b * 1000.f + (t + 1) % 40);
  }
  cudaFree(out);
}

// Asynchronous copies land when their group is waited for, not before: each thread copies 16
// bytes in two groups, reads its buffers before and after each wait; the last 4 bytes of the
// second are zero-filled.
__global__ void AsyncCopies(const int* src, int* out) {
  RELGEN_DYNAMIC_SHARED(int, buf);  // 8 ints a thread, filled with 0xff by the emulator
  int* mine = buf + 8 * threadIdx.x;
  const int* from = src + 8 * threadIdx.x;
  __pipeline_memcpy_async(mine, from, 16);
  __pipeline_commit();
  __pipeline_memcpy_async(mine + 4, from + 4, 16, 4);
  __pipeline_commit();
  int* o = out + 16 * threadIdx.x;
  o[0] = mine[0];  // neither group waited for
  __pipeline_wait_prior(1);
  o[1] = mine[3];  // the first group's
  o[2] = mine[4];  // the second's: not yet
  __pipeline_wait_prior(0);
  for (int i = 0; i < 8; ++i) o[8 + i] = mine[i];
}
__global__ void AsyncCopyMisaligned(const int* src, int* out) {
  RELGEN_DYNAMIC_SHARED(int, buf);
  __pipeline_memcpy_async(buf + 1, src, 16);
  out[0] = 0;
}

TEST(SimtTest, AsyncCopiesLandWhenWaitedFor) {
  const int threads = 3;
  std::vector<int> src(8 * threads);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 100 + static_cast<int>(i);
  int* dsrc = Upload(src);
  int* out = Upload(std::vector<int>(16 * threads, 7));
  RELGEN_LAUNCH(AsyncCopies, 1, threads, 8 * threads * sizeof(int), nullptr)(dsrc, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << simt::LastFault();
  const std::vector<int> got = Download(out, 16 * threads);
  for (int t = 0; t < threads; ++t) {
    const int* o = got.data() + 16 * t;
    EXPECT_EQ(o[0], -1) << "a copy landed before its wait";
    EXPECT_EQ(o[1], src[8 * t + 3]);
    EXPECT_EQ(o[2], -1) << "the newest group landed under wait_prior(1)";
    for (int i = 0; i < 7; ++i) EXPECT_EQ(o[8 + i], src[8 * t + i]) << "thread " << t << " int " << i;
    EXPECT_EQ(o[15], 0) << "the zero fill";
  }
  RELGEN_LAUNCH(AsyncCopyMisaligned, 1, 1, 64, nullptr)(dsrc, out);
  ExpectFault("not aligned");
  cudaFree(dsrc);
  cudaFree(out);
}

TEST(SimtTest, LaunchLimits) {
  int* d = Upload(std::vector<int>(64, 0));
  const simt::Counters before = simt::GetCounters();
  RELGEN_LAUNCH(MaskNamesMissingLane, 1, 1025, 0, nullptr)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // not sticky
  RELGEN_LAUNCH(MaskNamesMissingLane, dim3(1, 65536), 32, 0, nullptr)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  RELGEN_LAUNCH(MaskNamesMissingLane, 0, 32, 0, nullptr)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  RELGEN_LAUNCH(SharedPerBlock, 1, 32, 228 * 1024, nullptr)(reinterpret_cast<float*>(d));
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  RELGEN_LAUNCH(SharedPerBlock, 1, 32, 49 * 1024, nullptr)
  (reinterpret_cast<float*>(d));  // no opt-in
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  RELGEN_LAUNCH(MaskNamesMissingLane, 1, 32, 0, reinterpret_cast<cudaStream_t>(d))(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(simt::GetCounters().launches, before.launches);
  EXPECT_EQ(simt::GetCounters().launch_errors, before.launch_errors + 6);
  cudaFree(d);
}

TEST(SimtTest, DeviceMemory) {
  const int64_t limit = simt::MemoryLimit();
  const int64_t in_use = simt::GetCounters().bytes_in_use;
  simt::SetMemoryLimit(in_use + (1 << 20));
  size_t free = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  EXPECT_EQ(total, static_cast<size_t>(in_use + (1 << 20)));
  EXPECT_EQ(free, size_t{1} << 20);
  void* a = nullptr;
  void* b = nullptr;
  EXPECT_EQ(cudaMalloc(&a, 600 << 10), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&b, 600 << 10), cudaErrorMemoryAllocation);
  EXPECT_EQ(b, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  EXPECT_EQ(free, size_t{(1 << 20) - (600 << 10)});
  std::vector<char> host(16);
  EXPECT_EQ(cudaMemcpy(host.data(), host.data() + 8, 8, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(a, host.data(), 16, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(
      cudaMemcpy(static_cast<char*>(a) + (600 << 10) - 8, host.data(), 16, cudaMemcpyHostToDevice),
      cudaErrorInvalidValue);  // runs past the allocation
  EXPECT_EQ(cudaFree(host.data()), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(a), cudaSuccess);
  EXPECT_EQ(cudaFree(a), cudaErrorInvalidValue);  // double free
  cudaGetLastError();
  simt::SetMemoryLimit(limit);
  EXPECT_EQ(simt::GetCounters().bytes_in_use, in_use);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorInvalidResourceHandle);
  cudaGetLastError();
  int count = 0;
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(cudaSetDevice(1), cudaErrorInvalidDevice);
  cudaGetLastError();
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_STREQ(prop.name, "simt-emulator");
}

// C = alpha op(A) op(B) + beta C, column-major, against a direct evaluation.
TEST(SimtTest, SgemmHonoursTransposesAndLeadingDimensions) {
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  const int m = 5, n = 4, k = 3;
  for (cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    for (cublasOperation_t tb : {CUBLAS_OP_N, CUBLAS_OP_T}) {
      const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
      const int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
      const int lda = ar + 2, ldb = br + 1, ldc = m + 3;
      std::vector<float> a(lda * ac), b(ldb * bc), c(ldc * n);
      for (size_t i = 0; i < a.size(); ++i) a[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
      for (size_t i = 0; i < b.size(); ++i) b[i] = 0.5f * static_cast<float>(i % 5) - 1.f;
      for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<float>(i);
      float* da = Upload(a);
      float* db = Upload(b);
      float* dc = Upload(c);
      const float alpha = 1.5f, beta = 0.5f;
      ASSERT_EQ(cublasSgemm(h, ta, tb, m, n, k, &alpha, da, lda, db, ldb, &beta, dc, ldc),
                CUBLAS_STATUS_SUCCESS);
      const std::vector<float> got = Download(dc, c.size());
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < ldc; ++i) {
          if (i >= m) {
            EXPECT_EQ(got[j * ldc + i], c[j * ldc + i]) << "padding written";
            continue;
          }
          double s = 0;
          for (int p = 0; p < k; ++p) {
            const float av = ta == CUBLAS_OP_N ? a[p * lda + i] : a[i * lda + p];
            const float bv = tb == CUBLAS_OP_N ? b[j * ldb + p] : b[p * ldb + j];
            s += double{av} * bv;
          }
          EXPECT_NEAR(got[j * ldc + i], alpha * s + beta * c[j * ldc + i], 1e-5)
              << ta << tb << " " << i << "," << j;
        }
      }
      // Leading dimensions below the rows they hold are refused, as cuBLAS does.
      EXPECT_EQ(cublasSgemm(h, ta, tb, m, n, k, &alpha, da, ar - 1, db, ldb, &beta, dc, ldc),
                CUBLAS_STATUS_INVALID_VALUE);
      EXPECT_EQ(cublasSgemm(h, ta, tb, m, n, k, &alpha, da, lda, db, br - 1, &beta, dc, ldc),
                CUBLAS_STATUS_INVALID_VALUE);
      EXPECT_EQ(cublasSgemm(h, ta, tb, m, n, k, &alpha, da, lda, db, ldb, &beta, dc, m - 1),
                CUBLAS_STATUS_INVALID_VALUE);
      EXPECT_EQ(cublasSgemm(h, ta, tb, -1, n, k, &alpha, da, lda, db, ldb, &beta, dc, ldc),
                CUBLAS_STATUS_INVALID_VALUE);
      cudaFree(da);
      cudaFree(db);
      cudaFree(dc);
    }
  }
  // A matrix running past its allocation is an illegal address (sticky).
  float* small = Upload(std::vector<float>(4, 1.f));
  float* dc = Upload(std::vector<float>(4, 0.f));
  const float one = 1.f, zero = 0.f;
  EXPECT_EQ(
      cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 4, &one, small, 2, small, 4, &zero, dc, 2),
      CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  simt::ResetDevice();
  cudaFree(small);
  cudaFree(dc);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, nullptr, 1, nullptr, 1, &zero,
                        nullptr, 1),
            CUBLAS_STATUS_NOT_INITIALIZED);
}

uint16_t Bf16Bits(float f) {  // nearest even (these test values are finite)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// GemmEx with bf16 A and B, float32 C and accumulation, strided batches: against a direct
// evaluation over the bf16 operands; the type combinations cuBLAS has no kernel for are refused.
TEST(SimtTest, GemmExMultipliesBf16IntoFloat) {
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  const int m = 6, n = 3, k = 5, batch = 2;
  for (cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    const int lda = ar + 1, ldb = k + 2, ldc = m + 1;
    const long long sa = int64_t{lda} * ac + 3, sb = 0, sc = int64_t{ldc} * n;
    std::vector<uint16_t> a(sa * batch), b(ldb * n);
    for (size_t i = 0; i < a.size(); ++i) a[i] = Bf16Bits(0.3f * static_cast<float>(i % 11) - 1.37f);
    for (size_t i = 0; i < b.size(); ++i) b[i] = Bf16Bits(0.71f * static_cast<float>(i % 7) - 2.1f);
    std::vector<float> c(sc * batch);
    for (size_t i = 0; i < c.size(); ++i) c[i] = 0.5f * static_cast<float>(i % 9);
    uint16_t* da = Upload(a);
    uint16_t* db = Upload(b);
    float* dc = Upload(c);
    const float alpha = 0.75f, beta = 1.f;
    ASSERT_EQ(cublasGemmStridedBatchedEx(h, ta, CUBLAS_OP_N, m, n, k, &alpha, da, CUDA_R_16BF, lda, sa, db,
                                         CUDA_R_16BF, ldb, sb, &beta, dc, CUDA_R_32F, ldc, sc, batch,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
    const std::vector<float> got = Download(dc, c.size());
    for (int e = 0; e < batch; ++e) {
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < m; ++i) {
          double s = 0;
          for (int p = 0; p < k; ++p) {
            const uint16_t av = ta == CUBLAS_OP_N ? a[e * sa + p * lda + i] : a[e * sa + i * lda + p];
            s += double{FromBf16(av)} * FromBf16(b[j * ldb + p]);
          }
          const size_t at = e * sc + j * ldc + i;
          EXPECT_NEAR(got[at], alpha * s + c[at], 1e-5) << ta << " " << e << " " << i << "," << j;
        }
      }
    }
    // Mixed operand types, a bf16 output, or a half-precision compute type: no kernel.
    EXPECT_EQ(cublasGemmEx(h, ta, CUBLAS_OP_N, m, n, k, &alpha, da, CUDA_R_16BF, lda, dc, CUDA_R_32F, ldb, &beta, dc,
                           CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(cublasGemmEx(h, ta, CUBLAS_OP_N, m, n, k, &alpha, da, CUDA_R_16BF, lda, db, CUDA_R_16BF, ldb, &beta, dc,
                           CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(cublasGemmEx(h, ta, CUBLAS_OP_N, m, n, k, &alpha, da, CUDA_R_16BF, lda, db, CUDA_R_16BF, ldb, &beta, dc,
                           CUDA_R_32F, ldc, CUBLAS_COMPUTE_16F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(cublasGemmEx(h, ta, CUBLAS_OP_N, m, n, k, &alpha, da, CUDA_R_16BF, ar - 1, db, CUDA_R_16BF, ldb, &beta,
                           dc, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_INVALID_VALUE);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
  }
  // B's bf16 span past its allocation is an illegal address (counted in 2-byte elements).
  uint16_t* small = Upload(std::vector<uint16_t>(4, Bf16Bits(1.f)));
  float* dc = Upload(std::vector<float>(4, 0.f));
  const float one = 1.f, zero = 0.f;
  EXPECT_EQ(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, small, CUDA_R_16BF, 2, small, CUDA_R_16BF, 2,
                         &zero, dc, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(Download(dc, 4), (std::vector<float>{2.f, 2.f, 2.f, 2.f}));
  EXPECT_EQ(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 4, &one, small, CUDA_R_16BF, 2, small, CUDA_R_16BF, 4,
                         &zero, dc, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  simt::ResetDevice();
  cudaFree(small);
  cudaFree(dc);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
}

__global__ void DoubleKernel(float* p, int n) {
  const int i = threadIdx.x;
  if (i < n) p[i] *= 2.f;
}

// Work on one stream touching memory another stream wrote, with nothing ordering the two, faults.
TEST(SimtTest, StreamOrder) {
  cudaStream_t work = nullptr, blocking = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  const std::vector<float> host(32, 1.f);
  float* d = Upload(host);  // cudaMemcpy: the legacy stream
  const int64_t hazards = simt::GetCounters().stream_hazards;

  // Legacy copy, then a kernel on a non-blocking stream: a hazard.
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, work)(d, 32);
  EXPECT_NE(simt::LastFault().find("stream hazard: kernel DoubleKernel on stream"), std::string::npos);
  ExpectFault("written on the legacy stream");
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards + 1);

  // Ordered: the legacy stream synchronized; a blocking stream; the same stream.
  ASSERT_EQ(cudaMemcpy(d, host.data(), 32 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, blocking)(d, 32);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, work)(d, 32);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d, host.data(), 32 * sizeof(float), cudaMemcpyHostToDevice, work), cudaSuccess);
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, work)(d, 32);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(work), cudaSuccess);
  EXPECT_EQ(Download(d, 32), std::vector<float>(32, 2.f));

  // A GEMM's output on the work stream, read on the legacy stream before the work stream is
  // synchronized.
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(h, work), CUBLAS_STATUS_SUCCESS);
  float* a = Upload(std::vector<float>(4, 1.f));
  float* c = Upload(std::vector<float>(4, 0.f));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const float one = 1.f, zero = 0.f;
  ASSERT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, a, 2, a, 2, &zero, c, 2), CUBLAS_STATUS_SUCCESS);
  std::vector<float> out(4);
  EXPECT_EQ(cudaMemcpy(out.data(), c, 4 * sizeof(float), cudaMemcpyDeviceToHost), cudaErrorLaunchFailure);
  ExpectFault("a copy on the legacy stream");
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards + 2);
  cublasDestroy(h);
  for (float* p : {a, c, d}) cudaFree(p);
  cudaStreamDestroy(work);
  cudaStreamDestroy(blocking);
}

// Page-locked staging: until a synchronize covers an asynchronous copy through it, the host must
// not reuse it, so a second asynchronous copy through the same allocation faults. An event
// synchronize covers the copies before its record only.
TEST(SimtTest, StagingIsReusedOnlyAfterItsCopyIsSynchronized) {
  cudaStream_t work = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t first = nullptr, second = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&first, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&second, cudaEventDisableTiming), cudaSuccess);
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cudaMallocHost(&a, 64), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&b, 64), cudaSuccess);
  float* d = Upload(std::vector<float>(16, 1.f));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const int64_t hazards = simt::GetCounters().stream_hazards;

  // Two slots alternate: a, then b, each waited for by its own event before its next use.
  ASSERT_EQ(cudaMemcpyAsync(d, a, 64, cudaMemcpyHostToDevice, work), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(first, work), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(b, d, 64, cudaMemcpyDeviceToHost, work), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(second, work), cudaSuccess);
  ASSERT_EQ(cudaEventSynchronize(first), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d, a, 64, cudaMemcpyHostToDevice, work), cudaSuccess);
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards);
  // b's copy came after `first`'s record: still in flight.
  EXPECT_EQ(cudaMemcpyAsync(b, d, 64, cudaMemcpyDeviceToHost, work), cudaErrorLaunchFailure);
  ExpectFault("through page-locked host memory");
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards + 1);

  // Synchronous copies and pageable memory are not staging.
  std::vector<float> pageable(16);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), d, 64, cudaMemcpyDeviceToHost, work), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), d, 64, cudaMemcpyDeviceToHost, work), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, d, 64, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, d, 64, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards + 1);
  ASSERT_EQ(cudaStreamSynchronize(work), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(b, d, 64, cudaMemcpyDeviceToHost, work), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(work), cudaSuccess);
  EXPECT_EQ(simt::GetCounters().stream_hazards, hazards + 1);

  EXPECT_EQ(cudaEventDestroy(first), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(second), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(second), cudaErrorInvalidResourceHandle);
  cudaFreeHost(a);
  cudaFreeHost(b);
  cudaFree(d);
  cudaStreamDestroy(work);
}

// Stream capture records, runs nothing; each graph launch replays the kernels and GEMMs in order
// on its stream (scalars as they were at capture); refused calls invalidate the capture.
TEST(SimtTest, GraphsCaptureAndReplay) {
  cudaStream_t work = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking), cudaSuccess);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(h, work), CUBLAS_STATUS_SUCCESS);
  float* d = Upload(std::vector<float>(32, 1.f));
  float* a = Upload(std::vector<float>{1.f, 2.f, 3.f, 4.f});
  float* c = Upload(std::vector<float>(4, 0.f));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  simt::ResetCounters();

  ASSERT_EQ(cudaStreamBeginCapture(work, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(cudaStreamBeginCapture(work, cudaStreamCaptureModeThreadLocal), cudaErrorIllegalState);
  cudaGetLastError();
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, work)(d, 32);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  RELGEN_LAUNCH(DoubleKernel, 1, 2048, 0, work)(d, 32);  // refused at capture, not recorded
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  float alpha = 2.f, zero = 0.f;
  // A GEMM captured on a handle without a workspace of its own is refused (cuBLAS would allocate
  // one, which the graph cannot hold), and not recorded.
  EXPECT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, a, 2, a, 2, &zero, c, 2),
            CUBLAS_STATUS_NOT_SUPPORTED);
  float* workspace = Upload(std::vector<float>(256, 0.f));
  EXPECT_EQ(cublasSetWorkspace(h, workspace, 2048), CUBLAS_STATUS_INVALID_VALUE) << "past its allocation";
  ASSERT_EQ(cublasSetWorkspace(h, workspace, 1024), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, a, 2, a, 2, &zero, c, 2), CUBLAS_STATUS_SUCCESS);
  alpha = 100.f;  // read at capture
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, work)(d, 32);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(work, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  simt::Counters n = simt::GetCounters();
  EXPECT_EQ(n.captured, 3);
  EXPECT_EQ(n.launches, 0);
  EXPECT_EQ(n.gemms, 0);
  EXPECT_EQ(n.host_launches, 0);
  EXPECT_EQ(Download(d, 32), std::vector<float>(32, 1.f)) << "capture ran a kernel";

  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, work), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, work), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(work), cudaSuccess);
  EXPECT_EQ(Download(d, 32), std::vector<float>(32, 16.f));
  // Column-major a = [[1, 3], [2, 4]]; 2 * a * a.
  EXPECT_EQ(Download(c, 4), (std::vector<float>{14.f, 20.f, 30.f, 44.f}));
  n = simt::GetCounters();
  EXPECT_EQ(n.launches, 4);
  EXPECT_EQ(n.gemms, 2);
  EXPECT_EQ(n.host_launches, 2);
  EXPECT_EQ(n.graph_launches, 2);
  // Direct work counts as submitted one by one.
  RELGEN_LAUNCH(DoubleKernel, 1, 32, 0, work)(d, 32);
  EXPECT_EQ(simt::GetCounters().host_launches, 3);

  // A fault inside a replay is sticky and ends it.
  simt::FaultAtLaunch(1);
  EXPECT_EQ(cudaGraphLaunch(exec, work), cudaErrorIllegalAddress);
  EXPECT_EQ(simt::GetCounters().gemms, 2) << "the replay went on after its fault";
  simt::ResetDevice();

  // Copies and synchronizes are refused while capturing and void the capture; so is the legacy
  // stream, and ending a capture never begun.
  ASSERT_EQ(cudaStreamBeginCapture(work, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const std::vector<float> host(32, 3.f);
  EXPECT_EQ(cudaMemcpyAsync(d, host.data(), 32 * sizeof(float), cudaMemcpyHostToDevice, work),
            cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamSynchronize(work), cudaErrorStreamCaptureUnsupported);
  cudaGraph_t voided = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(work, &voided), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(voided, nullptr);
  EXPECT_EQ(cudaStreamEndCapture(work, &voided), cudaErrorIllegalState);
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeThreadLocal), cudaErrorStreamCaptureUnsupported);
  cudaGetLastError();

  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  cudaGetLastError();
  cublasDestroy(h);
  for (float* p : {a, c, d, workspace}) cudaFree(p);
  cudaStreamDestroy(work);
}

TEST(SimtTest, Counters) {
  simt::ResetCounters();
  int* d = Upload(std::vector<int>(8 * 64, 0));
  RELGEN_LAUNCH(ShuffleKernel, 1, 64, 0, nullptr)(d);
  RELGEN_LAUNCH(SharedPerBlock, 2, 32, 32 * sizeof(float), nullptr)(reinterpret_cast<float*>(d));
  const simt::Counters c = simt::GetCounters();
  EXPECT_EQ(c.launches, 2);
  EXPECT_EQ(c.blocks, 3);
  EXPECT_EQ(c.threads, 128);
  EXPECT_EQ(c.syncthreads, 4);
  EXPECT_EQ(c.warp_collectives,
            2 * 7 + 2 * 2);  // 7 full-warp shuffles and 2 half-warp ones per warp
  EXPECT_EQ(c.bytes_h2d, 8 * 64 * 4);
  EXPECT_EQ(c.mallocs, 1);
  cudaGetLastError();
  cudaFree(d);
}

}  // namespace
