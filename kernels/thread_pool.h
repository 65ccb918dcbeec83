// A fixed set of worker threads for data-parallel loops. ParallelFor splits [0, n) into one
// contiguous range per thread (the caller runs one); it returns when every range is done.
// Workers and the caller spin briefly before sleeping: a decode step makes dozens of calls a
// few microseconds apart, and a futex wake-up per call costs as much as the work.
// Thread-safety: ParallelFor may be called from one thread at a time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace relgen {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);  // total threads including the caller; >= 1
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int n, const std::function<void(int begin, int end)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(int, int)>* fn_ = nullptr;  // written before generation_ moves
  int n_ = 0;
  std::atomic<int> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

// The CPU kernels spell it cpu::ThreadPool; the CUDA backend uses it to convert weights for upload.
namespace cpu {
using ::relgen::ThreadPool;
}  // namespace cpu

}  // namespace relgen
