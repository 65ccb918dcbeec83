#include "kernels/thread_pool.h"

#include <algorithm>

namespace relgen {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

namespace {
void Range(int n, int parts, int index, int* begin, int* end) {
  *begin = static_cast<int>(int64_t{n} * index / parts);
  *end = static_cast<int>(int64_t{n} * (index + 1) / parts);
}

// True once done() holds, after at most ~50 microseconds of polling (then the caller sleeps).
template <typename F>
bool SpinUntil(F done) {
  for (int i = 0; i < 4096; ++i) {
    if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  return done();
}
}  // namespace

void ThreadPool::ParallelFor(int n, const std::function<void(int, int)>& fn) {
  const int parts = std::min(num_threads(), n);
  if (parts <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  {
    // Under the lock, so a worker about to sleep either sees the new generation or is woken.
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();
  int begin, end;
  Range(n, num_threads(), 0, &begin, &end);
  if (begin < end) fn(begin, end);
  if (!SpinUntil([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  int seen = 0;
  while (true) {
    const auto moved = [&] {
      return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
    };
    if (!SpinUntil(moved)) {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, moved);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    const std::function<void(int, int)>* fn = fn_;
    const int n = n_;
    int begin, end;
    Range(n, num_threads(), index, &begin, &end);
    if (begin < end) (*fn)(begin, end);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);  // the caller checks pending_ under it before sleeping
      done_cv_.notify_one();
    }
  }
}

}  // namespace relgen
