// Host memory of a real-width checkpoint as stored (bf16, sharded; RELGEN_SHAPE_CKPT, made by
// tools/make_shape_checkpoint.py): loading and packing it peaks near its size, not at the float32
// widening's twice that, and (on the emulator) the CUDA backend keeps no host copy once the weights
// are up. Peak RSS is the kernel's VmHWM, reset through /proc/self/clear_refs before each case.
// Not run under the sanitizers, whose shadow memory is resident too.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "engine/backends/device.h"
#include "engine/model/model.h"
#if RELGEN_SIMT_EMULATOR
#include "tests/simt/simt.h"
#endif

namespace relgen {
namespace {

// VmRSS or VmHWM of this process, in bytes.
int64_t StatusBytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream in(line.substr(key.size() + 1));
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
  }
  return -1;
}

void ResetPeak() { std::ofstream("/proc/self/clear_refs") << "5"; }

std::string CheckpointDir() {
  const char* d = std::getenv("RELGEN_SHAPE_CKPT");
  return d == nullptr ? "" : d;
}

// The largest matrix as stored: what is resident of the checkpoint while one is being packed.
int64_t LargestMatrix(const Model& m) {
  int64_t largest = m.embed().bytes();
  const ModelConfig& c = m.config();
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layer(l);
    for (const StoredMatrix* x : {w.wq, w.wk, w.wv, w.wo, w.w_up, w.w_gate, w.w_down}) {
      if (x != nullptr) largest = std::max(largest, x->bytes() * (x->layout == StoredMatrix::Rows::kAll ? 1 : 3));
    }
  }
  return largest;
}

constexpr int64_t kMargin = int64_t{64} << 20;  // the process's own growth: allocator, buffers, threads

TEST(MemoryTest, CpuPeakIsTheStoredSizeNotItsFloat32Widening) {
  ASSERT_FALSE(CheckpointDir().empty()) << "RELGEN_SHAPE_CKPT is not set (the make_shape_checkpoint fixture)";
  ResetPeak();
  const int64_t before = StatusBytes("VmRSS");
  auto model = Model::Load(CheckpointDir());
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t stored = (*model)->stored_bytes();
  ASSERT_EQ((*model)->file_dtype(), DType::kBF16);
  ASSERT_GT(stored, int64_t{200} << 20) << "the case is a few hundred MB";
  // Loaded: the mapped files' pages were read for the finiteness check and let go.
  EXPECT_LE(StatusBytes("VmRSS") - before, (*model)->small_bytes() + kMargin);
  DeviceOptions o;
  o.device = "cpu";
  o.kv_cache_tokens = 4096;
  o.max_step_tokens = 64;
  auto backend = NewBackend(*model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Describe().weights_dtype, "bf16");
  const int64_t peak = StatusBytes("VmHWM") - before, now = StatusBytes("VmRSS") - before;
  std::printf("stored %.1f MiB, largest matrix %.1f MiB; peak RSS +%.1f MiB, after start +%.1f MiB\n", stored / 1048576.0,
              LargestMatrix(**model) / 1048576.0, peak / 1048576.0, now / 1048576.0);
  // The packed bf16 copy is the stored size (a tied head's too); while one matrix is packed its
  // stored pages are resident beside it. A float32 widening alone would be 2x the stored size.
  const int64_t packed = (*backend)->Describe().memory.weights - (*model)->embed().bytes() - (*model)->small_bytes();
  EXPECT_LE(peak, packed + LargestMatrix(**model) + (*model)->small_bytes() + kMargin);
  EXPECT_LE(peak, stored + LargestMatrix(**model) + kMargin);
  EXPECT_LT(peak, 2 * stored);
}

#if RELGEN_SIMT_EMULATOR
// The emulated device's memory is this process's, so its bytes are taken out: what is left is the
// CUDA backend's host side, which holds one chunk of one matrix at a time and nothing once started.
TEST(MemoryTest, CudaHostSideKeepsNoCopyOfTheWeights) {
  ASSERT_FALSE(CheckpointDir().empty()) << "RELGEN_SHAPE_CKPT is not set (the make_shape_checkpoint fixture)";
  ResetPeak();
  const int64_t before = StatusBytes("VmRSS");
  auto model = Model::Load(CheckpointDir());
  ASSERT_TRUE(model.ok()) << model.status();
  DeviceOptions o;
  o.device = "cuda";
  o.kv_cache_tokens = 4096;
  o.max_step_tokens = 64;
  o.max_step_seqs = 4;
  simt::ResetCounters();
  const int64_t device_before = simt::GetCounters().bytes_in_use;
  auto backend = NewBackend(*model, o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const simt::Counters n = simt::GetCounters();
  const int64_t device = n.peak_bytes_in_use - device_before;
  const int64_t peak = StatusBytes("VmHWM") - before, now = StatusBytes("VmRSS") - before;
  std::printf("device %.1f MiB (emulated, in this process); peak RSS +%.1f MiB, after start +%.1f MiB\n",
              device / 1048576.0, peak / 1048576.0, now / 1048576.0);
  EXPECT_LE(peak, device + LargestMatrix(**model) + (*model)->small_bytes() + kMargin);
  EXPECT_LE(now, device + (*model)->small_bytes() + kMargin);
}
#endif

}  // namespace
}  // namespace relgen
