#include "kernels/cpu/thread_pool.h"

#include <algorithm>

namespace relgen::cpu {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

namespace {
void Range(int n, int parts, int index, int* begin, int* end) {
  *begin = static_cast<int>(int64_t{n} * index / parts);
  *end = static_cast<int>(int64_t{n} * (index + 1) / parts);
}
}  // namespace

void ThreadPool::ParallelFor(int n, const std::function<void(int, int)>& fn) {
  const int parts = std::min(num_threads(), n);
  if (parts <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  int begin, end;
  Range(n, num_threads(), 0, &begin, &end);
  if (begin < end) fn(begin, end);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  int seen = 0;
  while (true) {
    const std::function<void(int, int)>* fn;
    int n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
    }
    int begin, end;
    Range(n, num_threads(), index, &begin, &end);
    if (begin < end) (*fn)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace relgen::cpu
