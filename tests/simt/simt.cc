// relgen's SIMT emulator: the CUDA runtime and cuBLAS subset of include/, and the block scheduler.
//
// A launch runs its blocks one after another (last to first with RELGEN_SIMT_REVERSE_BLOCKS=1).
// Inside a block every CUDA thread is a fiber with its own stack (x86-64: a six-register switch;
// elsewhere ucontext), run until it reaches a collective; a collective completes when every thread
// it names has arrived, and is checked: a lane outside its own mask, a mask naming a lane that has
// exited, waits at __syncthreads or sits in a different collective, a barrier some threads skip,
// and a block where every thread waits (deadlock) are faults. With RELGEN_SIMT_THREADS=1 each CUDA
// thread is an OS thread instead and the rendezvous use a mutex per warp (shuffles) and one per
// block (barriers), so ThreadSanitizer sees exactly the ordering CUDA promises between warps.
#include "tests/simt/simt.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cublas_v2.h"
#include "cuda_runtime.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SIMT_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define SIMT_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define SIMT_TSAN 1
#endif
#if SIMT_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if SIMT_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// A captured graph: the work recorded on a stream, each node run on the stream the graph is
// launched on.
struct CUgraph_st {
  std::vector<std::function<void(cudaStream_t)>> nodes;
};
struct CUgraphExec_st {
  std::vector<std::function<void(cudaStream_t)>> nodes;
};
struct CUstream_st {
  unsigned flags = 0;
  std::unique_ptr<CUgraph_st> capture;  // between Begin and EndCapture
  bool capture_invalid = false;         // a refused call happened during the capture
};
struct CUevent_st {
  const CUstream_st* stream = nullptr;
  int64_t op = 0;  // the last asynchronous copy on `stream` when recorded (0: never recorded)
};
struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  void* workspace = nullptr;  // cublasSetWorkspace's (null: none set)
  size_t workspace_bytes = 0;
};

namespace simt {
namespace detail {
thread_local ThreadContext* current = nullptr;
}  // namespace detail

namespace {

constexpr size_t kMaxDynamicShared = 227 * 1024;
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // above it a kernel must opt in
constexpr size_t kPoisonUpTo = size_t{64}
                               << 20;  // fresh allocations up to this size are filled with 0xff

bool EnvFlag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

struct Runtime {
  std::mutex mu;  // everything below but launch_mu
  std::map<uintptr_t, size_t> allocations;
  std::map<uintptr_t, size_t> pinned;  // cudaMallocHost's
  // Allocation base -> the stream whose copy or GEMM into it is not yet synchronized (nullptr:
  // the legacy stream).
  std::map<uintptr_t, const CUstream_st*> in_flight;
  // Page-locked host allocation base -> the asynchronous copy to or from it not yet synchronized:
  // its stream and its number (ops counts those copies).
  struct Staged {
    const CUstream_st* stream;
    int64_t op;
  };
  std::map<uintptr_t, Staged> staging;
  int64_t ops = 0;
  std::set<const CUevent_st*> events;
  std::set<const CUstream_st*> streams;
  std::set<const cublasContext*> handles;
  std::set<const CUgraph_st*> graphs;
  std::set<const CUgraphExec_st*> execs;
  Counters counters;
  int64_t limit = int64_t{4} << 30;
  cudaError_t sticky = cudaSuccess;
  std::string fault;
  std::atomic<bool> thread_mode{false};
  std::atomic<bool> reverse{false};
  int64_t launch_attempts = 0;  // every launch that reached the device
  int64_t fault_at = 0;         // the launch attempt that faults (0: none)
  std::mutex launch_mu;  // one kernel at a time in the process (static __shared__ is per kernel)

  Runtime() {
    thread_mode = EnvFlag("RELGEN_SIMT_THREADS");
    reverse = EnvFlag("RELGEN_SIMT_REVERSE_BLOCKS");
    if (const char* m = std::getenv("RELGEN_SIMT_MEMORY_BYTES"); m != nullptr && *m != '\0') {
      limit = std::strtoll(m, nullptr, 10);
    }
    if (const char* f = std::getenv("RELGEN_SIMT_FAULT_AT_LAUNCH"); f != nullptr && *f != '\0') {
      fault_at = std::strtoll(f, nullptr, 10);
    }
  }
};

// Never destroyed: allocations stay reachable (no leak reports for buffers a test never frees) and
// usable from other static destructors.
Runtime& R() {
  static Runtime* r = new Runtime;
  return *r;
}

thread_local cudaError_t last_error = cudaSuccess;

cudaError_t Fail(cudaError_t e) {
  last_error = e;
  return e;
}

cudaError_t Sticky() {
  std::lock_guard<std::mutex> l(R().mu);
  return R().sticky;
}

void SetSticky(cudaError_t e, const std::string& what) {
  std::fprintf(stderr, "simt: %s\n", what.c_str());
  std::lock_guard<std::mutex> l(R().mu);
  if (R().sticky == cudaSuccess) {
    R().sticky = e;
    R().fault = what;
  }
  ++R().counters.launch_errors;
}

// The allocation holding [p, p + bytes), or false. Caller holds R().mu.
bool InDeviceMemoryLocked(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = R().allocations.upper_bound(a);
  if (it == R().allocations.begin()) return false;
  --it;
  return a >= it->first && a - it->first <= it->second && bytes <= it->second - (a - it->first) &&
         (bytes > 0 || a < it->first + std::max<size_t>(it->second, 1));
}

bool InDeviceMemory(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(R().mu);
  return InDeviceMemoryLocked(p, bytes);
}

// Base of the allocation holding p, or 0. Caller holds R().mu.
uintptr_t AllocationOfLocked(uintptr_t p) {
  auto it = R().allocations.upper_bound(p);
  if (it == R().allocations.begin()) return 0;
  --it;
  return p >= it->first && p < it->first + std::max<size_t>(it->second, 1) ? it->first : 0;
}

// Whether work on `reader` runs after earlier work on `writer` without a synchronization: the same
// stream, or the legacy stream and a blocking (cudaStreamDefault) one.
bool OrderedLocked(const CUstream_st* reader, const CUstream_st* writer) {
  if (reader == writer) return true;
  const auto blocking = [](const CUstream_st* s) { return s != nullptr && (s->flags & cudaStreamNonBlocking) == 0; };
  return (reader == nullptr && blocking(writer)) || (writer == nullptr && blocking(reader));
}

std::string StreamName(const CUstream_st* s) {
  if (s == nullptr) return "the legacy stream";
  char b[64];
  std::snprintf(b, sizeof(b), "stream %p (%s)", static_cast<const void*>(s),
                (s->flags & cudaStreamNonBlocking) != 0 ? "non-blocking" : "blocking");
  return b;
}

// Checks that `what` on `stream` may touch each of `pointers` (any word that is not a device
// address is ignored); on a hazard, counts it, makes it the sticky fault and returns false.
bool CheckStreamOrder(const std::string& what, cudaStream_t stream, const uintptr_t* words, size_t n) {
  std::string hazard;
  {
    std::lock_guard<std::mutex> l(R().mu);
    if (R().in_flight.empty()) return true;
    for (size_t i = 0; i < n && hazard.empty(); ++i) {
      const uintptr_t base = AllocationOfLocked(words[i]);
      if (base == 0) continue;
      auto it = R().in_flight.find(base);
      if (it == R().in_flight.end() || OrderedLocked(stream, it->second)) continue;
      hazard = what + " on " + StreamName(stream) + " touches device memory " +
               std::to_string(base) + " written on " + StreamName(it->second) +
               " with nothing ordering the two (synchronize, or use one stream)";
      ++R().counters.stream_hazards;
    }
  }
  if (hazard.empty()) return true;
  SetSticky(cudaErrorLaunchFailure, "stream hazard: " + hazard);
  return false;
}

// A write into `p`'s allocation on `stream` is in flight until a synchronization. Ignores host
// memory.
void MarkInFlight(const void* p, cudaStream_t stream) {
  std::lock_guard<std::mutex> l(R().mu);
  if (const uintptr_t base = AllocationOfLocked(reinterpret_cast<uintptr_t>(p)); base != 0) {
    R().in_flight[base] = stream;
  }
}

// Work on `stream` (or, with all, every stream) has finished.
// With `up_to` > 0, only the staging copies numbered up to it have (an event's synchronize; the
// device-side writes of the whole stream count as finished, more leniently).
void Synchronized(cudaStream_t stream, bool all, int64_t up_to = 0) {
  std::lock_guard<std::mutex> l(R().mu);
  for (auto it = R().in_flight.begin(); it != R().in_flight.end();) {
    it = all || it->second == stream ? R().in_flight.erase(it) : std::next(it);
  }
  for (auto it = R().staging.begin(); it != R().staging.end();) {
    const bool done = all || (it->second.stream == stream && (up_to == 0 || it->second.op <= up_to));
    it = done ? R().staging.erase(it) : std::next(it);
  }
}

bool StreamValid(cudaStream_t s) {
  if (s == nullptr) return true;
  std::lock_guard<std::mutex> l(R().mu);
  return R().streams.count(s) > 0;
}

bool Capturing(cudaStream_t s) {
  if (s == nullptr) return false;
  std::lock_guard<std::mutex> l(R().mu);
  return R().streams.count(s) > 0 && s->capture != nullptr;
}

// Records `node` into `s`'s capture. Caller has seen Capturing(s).
void Record(cudaStream_t s, std::function<void(cudaStream_t)> node) {
  std::lock_guard<std::mutex> l(R().mu);
  s->capture->nodes.push_back(std::move(node));
  ++R().counters.captured;
}

// A call CUDA does not allow on a capturing stream: refused, and the capture is invalidated.
bool RefuseIfCapturing(cudaStream_t s) {
  if (s == nullptr) return false;
  std::lock_guard<std::mutex> l(R().mu);
  if (R().streams.count(s) == 0 || s->capture == nullptr) return false;
  s->capture_invalid = true;
  return true;
}

// Work a graph replays is not the host's submission.
thread_local bool replaying = false;
void CountHostLaunch() {
  if (replaying) return;
  std::lock_guard<std::mutex> l(R().mu);
  ++R().counters.host_launches;
}

std::string Dim(uint3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// ---------------------------------------------------------------------------------------------
// Fibers.

#if defined(__x86_64__)
extern "C" void relgen_simt_switch(void** save_sp, void* next_sp);
asm(R"(
.text
.globl relgen_simt_switch
.type relgen_simt_switch,@function
relgen_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size relgen_simt_switch, .-relgen_simt_switch
.section .note.GNU-stack,"",@progbits
.text
)");
struct Context {
  void* sp = nullptr;
};
void SwitchContext(Context* from, Context* to) { relgen_simt_switch(&from->sp, to->sp); }
void MakeContext(Context* c, void* stack, size_t size, void (*fn)()) {
  auto top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<void**>(top - 64);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;  // r15 r14 r13 r12 rbx rbp
  sp[6] = reinterpret_cast<void*>(fn);          // return address: entered as if called
  sp[7] = nullptr;
  c->sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
void SwitchContext(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
void MakeContext(Context* c, void* stack, size_t size, void (*fn)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, fn, 0);
}
#endif

#if SIMT_ASAN || SIMT_TSAN
constexpr size_t kStackBytes = 512 * 1024;
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif

struct Fiber {
  void* mapping = nullptr;  // guard page + stack
  void* stack = nullptr;
  Context ctx;
#if SIMT_ASAN
  // The lowest address whose shadow may still be poisoned: frames live when the fiber last left
  // (its last kernel's exit, or a lane abandoned in a faulted block) never ran their epilogues, so
  // their redzones stay poisoned until the next use of the stack clears them. Only this far down
  // is cleared, a few KiB, not the whole stack: clearing all of it for every thread of every block
  // was most of the ASan tree's emulated suite (64 KiB of shadow a thread, several GB a test).
  char* dirty = nullptr;
#endif
#if SIMT_TSAN
  void* tsan = nullptr;
#endif
  Fiber() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    mapping = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapping == MAP_FAILED) {
      std::fprintf(stderr, "simt: cannot map a fiber stack\n");
      std::abort();
    }
    mprotect(mapping, page, PROT_NONE);  // overflow faults instead of corrupting the neighbour
    stack = static_cast<char*>(mapping) + page;
#if SIMT_ASAN
    dirty = static_cast<char*>(stack);  // a fresh mapping may reuse an old one's poisoned range
#endif
#if SIMT_TSAN
    tsan = __tsan_create_fiber(0);
#endif
  }
};

// Fibers are reused across blocks and launches (launches are serialized by launch_mu).
std::vector<std::unique_ptr<Fiber>>& FiberPool() {
  static auto* pool = new std::vector<std::unique_ptr<Fiber>>;
  return *pool;
}

// ---------------------------------------------------------------------------------------------
// Blocks.

enum class State { kRunning, kWarpWait, kBarrierWait, kDone };

struct Block;

struct Lane {
  detail::ThreadContext ctx{};
  Block* block = nullptr;
  int tid = 0, warp = 0, lane = 0;
  State state = State::kRunning;
  bool finished = false;  // the fiber/thread has left the kernel for good
  unsigned mask = 0;
  detail::ShuffleKind kind = detail::ShuffleKind::kSync;
  int param = 0, width = 32;
  uint64_t value = 0, result = 0;
  Fiber* fiber = nullptr;
};

// A warp collective some lanes have reached: the lanes it names, and how many are there.
struct Group {
  unsigned mask = 0;
  detail::ShuffleKind kind = detail::ShuffleKind::kSync;
  int arrived = 0;
};

struct Warp {
  std::mutex mu;
  std::condition_variable cv;
  int first = 0, size = 0;
  std::vector<Group> groups;  // pending, disjoint masks
};

struct FaultException {};

struct Block {
  const char* kernel = "";
  const detail::KernelBody* body = nullptr;
  bool threads = false;
  int n = 0;
  std::vector<Lane> lanes;
  std::unique_ptr<Warp[]> warps;
  int nwarps = 0;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0, exited = 0;
  std::atomic<bool> faulted{false};
  std::string fault;
  int64_t syncs = 0;                    // under mu
  std::atomic<int64_t> collectives{0};  // counted under different warp locks
  // Fiber mode: the scheduler's context.
  Context sched;
#if SIMT_ASAN
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
#if SIMT_TSAN
  void* sched_tsan = nullptr;
#endif

  std::string Where(const Lane& l) const {
    return std::string(kernel) + " block " + Dim(l.ctx.block_idx) + " thread " +
           Dim(l.ctx.thread_idx) + " (warp " + std::to_string(l.warp) + " lane " +
           std::to_string(l.lane) + ")";
  }
};

thread_local Block* running_block = nullptr;  // fiber mode: the block this OS thread schedules
thread_local Lane* running_lane = nullptr;

Lane& Me() { return *static_cast<Lane*>(detail::current->lane); }

// Records the block's first fault and wakes every waiter (they throw FaultException).
void RecordFault(Block& b, const std::string& what) {
  {
    std::lock_guard<std::mutex> l(b.mu);
    if (b.faulted) return;
    b.fault = what;
    b.faulted = true;
  }
  if (b.threads) {
    b.cv.notify_all();
    for (int w = 0; w < b.nwarps; ++w) {
      std::lock_guard<std::mutex> l(b.warps[w].mu);
      b.warps[w].cv.notify_all();
    }
  }
}

// Thread mode: the warp lock this thread holds, released before a fault wakes the warp's waiters.
thread_local std::unique_lock<std::mutex>* held_lock = nullptr;
struct HeldLock {
  explicit HeldLock(std::unique_lock<std::mutex>& l) { held_lock = &l; }
  ~HeldLock() { held_lock = nullptr; }
};

[[noreturn]] void Fault(Block& b, const std::string& what) {
  if (held_lock != nullptr && held_lock->owns_lock()) held_lock->unlock();
  RecordFault(b, what);
  throw FaultException{};
}

const char* KindName(detail::ShuffleKind k) {
  switch (k) {
    case detail::ShuffleKind::kIdx:
      return "__shfl_sync";
    case detail::ShuffleKind::kUp:
      return "__shfl_up_sync";
    case detail::ShuffleKind::kDown:
      return "__shfl_down_sync";
    case detail::ShuffleKind::kXor:
      return "__shfl_xor_sync";
    case detail::ShuffleKind::kSync:
      return "__syncwarp";
  }
  return "?";
}

std::string Hex(unsigned m) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", m);
  return buf;
}

// Fiber mode: back to the scheduler (the lane is waiting, or done for good when `exiting`).
void YieldToScheduler(Lane& l, bool exiting) {
  Block& b = *l.block;
#if SIMT_ASAN
  {
    // Every frame from here up may be left live; below this one, only the switch's own
    // (uninstrumented) frames, well inside the slack.
    constexpr ptrdiff_t kSwitchSlack = 4096;
    Fiber& f = *l.fiber;
    char* const base = static_cast<char*>(f.stack);
    char* const here = static_cast<char*>(__builtin_frame_address(0)) - kSwitchSlack;
    char* const low = here < base ? base : here;
    if (f.dirty == nullptr || low < f.dirty) f.dirty = low;
  }
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, b.sched_bottom, b.sched_size);
#else
  (void)exiting;
#endif
#if SIMT_TSAN
  __tsan_switch_to_fiber(b.sched_tsan, 0);
#endif
  SwitchContext(&l.fiber->ctx, &b.sched);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(fake, &b.sched_bottom, &b.sched_size);
#endif
}

// Waits (holding `lock` in thread mode) until the lane is released or the block faults.
void WaitReleased(Lane& me, std::unique_lock<std::mutex>& lock, std::condition_variable& cv) {
  Block& b = *me.block;
  if (b.threads) {
    cv.wait(lock, [&] { return me.state == State::kRunning || b.faulted.load(); });
  } else {
    while (me.state != State::kRunning && !b.faulted) YieldToScheduler(me, false);
  }
  if (b.faulted) throw FaultException{};
}

// Faults when a pending collective of `me`'s warp names `me`. Caller holds the warp lock.
void CheckNobodyWaitsFor(Lane& me, const char* doing) {
  Block& b = *me.block;
  for (const Group& g : b.warps[me.warp].groups) {
    if ((g.mask >> me.lane) & 1u) {
      Fault(b, b.Where(me) + " " + doing + " while " + std::to_string(g.arrived) +
                   " lanes of its warp wait for it in " + KindName(g.kind) + " with mask " +
                   Hex(g.mask));
    }
  }
}

std::unique_lock<std::mutex> MaybeLock(bool threads, std::mutex& mu) {
  return threads ? std::unique_lock<std::mutex>(mu) : std::unique_lock<std::mutex>();
}

void LaneExit(Lane& me) {
  Block& b = *me.block;
  {
    auto lock = MaybeLock(b.threads, b.warps[me.warp].mu);
    HeldLock held(lock);
    CheckNobodyWaitsFor(me, "exited");
    me.state = State::kDone;
  }
  auto lock = MaybeLock(b.threads, b.mu);
  ++b.exited;
  if (const int arrived = b.arrived; arrived > 0) {  // read under the lock: Fault needs it released
    if (lock.owns_lock()) lock.unlock();
    Fault(b,
          b.Where(me) + " exited while " + std::to_string(arrived) +
              " threads of its block wait at __syncthreads (a barrier not every thread reaches)");
  }
}

void RunLane(Lane& me) {
  detail::current = &me.ctx;
  try {
    (*me.block->body)();
    LaneExit(me);
  } catch (const FaultException&) {
    auto lock = MaybeLock(me.block->threads, me.block->warps[me.warp].mu);
    me.state = State::kDone;
  }
  detail::current = nullptr;
}

extern "C" void RelgenSimtFiberMain() {
  Lane& me = *running_lane;
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &me.block->sched_bottom, &me.block->sched_size);
#endif
  RunLane(me);
  me.finished = true;
  YieldToScheduler(me, true);
  __builtin_unreachable();
}

void ResumeLane(Block& b, Lane& l) {
  running_lane = &l;
  detail::current = &l.ctx;
#if SIMT_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, l.fiber->stack, kStackBytes);
#endif
#if SIMT_TSAN
  __tsan_switch_to_fiber(l.fiber->tsan, 0);
#endif
  SwitchContext(&b.sched, &l.fiber->ctx);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  detail::current = nullptr;
  running_lane = nullptr;
}

std::string DeadlockReport(const Block& b) {
  int at_barrier = 0, at_warp = 0, done = 0;
  const Lane* example = nullptr;
  for (const Lane& l : b.lanes) {
    if (l.state == State::kBarrierWait) ++at_barrier;
    if (l.state == State::kWarpWait) {
      ++at_warp;
      if (example == nullptr) example = &l;
    }
    if (l.state == State::kDone) ++done;
  }
  std::string s = std::string("deadlock in ") + b.kernel + " block " +
                  Dim(b.lanes[0].ctx.block_idx) + ": " + std::to_string(at_barrier) +
                  " threads wait at __syncthreads, " + std::to_string(at_warp) +
                  " in warp collectives, " + std::to_string(done) + " exited";
  if (example != nullptr) {
    s += "; e.g. " + b.Where(*example) + " in " + KindName(example->kind) + " with mask " +
         Hex(example->mask);
  }
  return s;
}

void RunBlockFibers(Block& b) {
  auto& pool = FiberPool();
  while (static_cast<int>(pool.size()) < b.n) pool.push_back(std::make_unique<Fiber>());
#if SIMT_TSAN
  b.sched_tsan = __tsan_get_current_fiber();
#endif
  for (int i = 0; i < b.n; ++i) {
    Lane& l = b.lanes[i];
    l.fiber = pool[i].get();
#if SIMT_ASAN
    if (char* const dirty = l.fiber->dirty; dirty != nullptr) {
      ASAN_UNPOISON_MEMORY_REGION(dirty, static_cast<char*>(l.fiber->stack) + kStackBytes - dirty);
      l.fiber->dirty = nullptr;
    }
#endif
    MakeContext(&l.fiber->ctx, l.fiber->stack, kStackBytes, &RelgenSimtFiberMain);
  }
  int finished = 0;
  while (finished < b.n) {
    bool progress = false;
    for (Lane& l : b.lanes) {
      if (l.finished || (l.state != State::kRunning && !b.faulted)) continue;
      ResumeLane(b, l);
      progress = true;
      if (l.finished) ++finished;
    }
    if (!progress && finished < b.n) RecordFault(b, DeadlockReport(b));
  }
}

// Thread mode: worker thread i runs thread i of every block (created once, reused by later blocks
// and launches, which launch_mu serializes).
class WorkerPool {
 public:
  void Run(Block& b) {
    std::unique_lock<std::mutex> l(mu_);
    while (static_cast<int>(workers_) < b.n) {
      std::thread([this, id = workers_, g = gen_] { Loop(id, g); }).detach();
      ++workers_;
    }
    block_ = &b;
    remaining_ = b.n;
    ++gen_;
    start_.notify_all();
    done_.wait(l, [&] { return remaining_ == 0; });
    block_ = nullptr;
  }

 private:
  void Loop(int id, uint64_t seen) {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      start_.wait(l, [&] { return gen_ != seen; });
      seen = gen_;
      Block* b = block_;  // null when this generation's block finished without this worker
      if (b == nullptr || id >= b->n) continue;
      l.unlock();
      RunLane(b->lanes[id]);
      b->lanes[id].finished = true;
      l.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable start_, done_;
  int workers_ = 0;
  uint64_t gen_ = 0;
  Block* block_ = nullptr;
  int remaining_ = 0;
};

void RunBlockThreads(Block& b) {
  static auto* pool = new WorkerPool;  // never destroyed: its threads wait for work until exit
  pool->Run(b);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Collectives (called from kernel code).

namespace detail {

[[noreturn]] void DeviceFault(const char* what) { Fault(*static_cast<Lane*>(current->lane)->block, what); }

uint64_t WarpCollective(unsigned mask, ShuffleKind kind, uint64_t value, int param, int width) {
  Lane& me = Me();
  Block& b = *me.block;
  Warp& w = b.warps[me.warp];
  auto lock = MaybeLock(b.threads, w.mu);
  HeldLock held(lock);
  if (b.faulted) throw FaultException{};
  if (((mask >> me.lane) & 1u) == 0) {
    Fault(b, b.Where(me) + " calls " + KindName(kind) + " with mask " + Hex(mask) +
                 ", which does not name it");
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    Fault(b, b.Where(me) + " calls " + KindName(kind) + " with width " + std::to_string(width) +
                 " (a power of two up to 32)");
  }
  me.mask = mask;
  me.kind = kind;
  me.param = param;
  me.width = width;
  me.value = value;
  me.state = State::kWarpWait;
  // Lanes meet in the collective of their mask; collectives of other masks may be pending beside it
  // (their lanes come here when those complete; the scheduler reports a cycle as a deadlock).
  Group* group = nullptr;
  for (Group& g : w.groups) {
    if (g.mask != mask) continue;
    if (g.kind != kind) {
      Fault(b, b.Where(me) + " calls " + KindName(kind) + " with mask " + Hex(mask) + " while " +
                   std::to_string(g.arrived) + " lanes of its warp wait in " + KindName(g.kind) +
                   " with that mask");
    }
    group = &g;
  }
  if (group == nullptr) {
    // First arrival: every lane named must exist and be able to arrive.
    for (int i = 0; i < 32; ++i) {
      if (((mask >> i) & 1u) == 0) continue;
      if (i >= w.size) {
        Fault(b, b.Where(me) + " calls " + KindName(kind) + " with mask " + Hex(mask) +
                     ", which names lane " + std::to_string(i) + " of a warp of " +
                     std::to_string(w.size) + " threads");
      }
      const Lane& o = b.lanes[w.first + i];
      if (o.state == State::kDone) {
        Fault(b, b.Where(me) + " calls " + KindName(kind) + " with mask " + Hex(mask) +
                     ", which names lane " + std::to_string(i) + " that has exited");
      }
      if (o.state == State::kBarrierWait) {
        Fault(b, b.Where(me) + " calls " + KindName(kind) + " with mask " + Hex(mask) +
                     " while lane " + std::to_string(i) + " waits at __syncthreads");
      }
    }
    w.groups.push_back(Group{mask, kind, 0});
    group = &w.groups.back();
  }
  if (++group->arrived < __builtin_popcount(mask)) {
    WaitReleased(me, lock, w.cv);
    return me.result;
  }
  w.groups.erase(w.groups.begin() + (group - w.groups.data()));
  // Every named lane is here: exchange.
  for (int i = 0; i < 32; ++i) {
    if (((mask >> i) & 1u) == 0) continue;
    Lane& o = b.lanes[w.first + i];
    const int base = (i / o.width) * o.width;
    int src = i;
    switch (kind) {
      case ShuffleKind::kIdx:
        src = base + ((o.param % o.width) + o.width) % o.width;
        break;
      case ShuffleKind::kUp:
        src = i - o.param >= base ? i - o.param : i;
        break;
      case ShuffleKind::kDown:
        src = i + o.param < base + o.width ? i + o.param : i;
        break;
      case ShuffleKind::kXor:
        src = (i ^ o.param) < base + o.width ? (i ^ o.param) : i;
        break;
      case ShuffleKind::kSync:
        break;
    }
    if (src < 0 || src >= 32 || ((mask >> src) & 1u) == 0) {
      Fault(b, b.Where(o) + " reads lane " + std::to_string(src) + " in " + KindName(kind) +
                   " with mask " + Hex(mask) +
                   ", which does not name that lane (its value is undefined)");
    }
    o.result = b.lanes[w.first + src].value;
  }
  for (int i = 0; i < 32; ++i) {
    if ((mask >> i) & 1u) b.lanes[w.first + i].state = State::kRunning;
  }
  ++b.collectives;
  if (b.threads) w.cv.notify_all();
  return me.result;
}

void SyncThreads() {
  Lane& me = Me();
  Block& b = *me.block;
  {
    auto lock = MaybeLock(b.threads, b.warps[me.warp].mu);
    HeldLock held(lock);
    if (b.faulted) throw FaultException{};
    CheckNobodyWaitsFor(me, "reached __syncthreads");
    me.state = State::kBarrierWait;
  }
  auto lock = MaybeLock(b.threads, b.mu);
  if (const int exited = b.exited; exited > 0) {  // read under the lock: Fault needs it released
    if (lock.owns_lock()) lock.unlock();
    Fault(b, b.Where(me) + " reached __syncthreads after " + std::to_string(exited) +
                 " threads of its block exited (a barrier not every thread reaches)");
  }
  if (++b.arrived < b.n) {
    WaitReleased(me, lock, b.cv);
    return;
  }
  b.arrived = 0;
  ++b.syncs;
  for (Lane& l : b.lanes) l.state = State::kRunning;
  if (b.threads) b.cv.notify_all();
}

void Launch(const char* name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            const KernelBody& body, const uintptr_t* pointers, size_t num_pointers) {
  if (const cudaError_t s = Sticky(); s != cudaSuccess) {
    Fail(s);
    return;
  }
  if (StreamValid(stream) && !Capturing(stream) &&
      !CheckStreamOrder(std::string("kernel ") + name, stream, pointers, num_pointers)) {
    Fail(cudaErrorLaunchFailure);
    return;
  }
  auto refuse = [&](cudaError_t e, const std::string& why) {
    std::fprintf(stderr, "simt: launch of %s refused: %s\n", name, why.c_str());
    {
      std::lock_guard<std::mutex> l(R().mu);
      ++R().counters.launch_errors;
    }
    Fail(e);
  };
  if (!StreamValid(stream)) return refuse(cudaErrorInvalidResourceHandle, "unknown stream");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 || block.y > 1024 ||
      block.z > 64 || threads > 1024) {
    return refuse(cudaErrorInvalidConfiguration,
                  "block " + Dim({block.x, block.y, block.z}) +
                      " (at most 1024 threads; x, y <= 1024, z <= 64)");
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535) {
    return refuse(cudaErrorInvalidConfiguration, "grid " + Dim({grid.x, grid.y, grid.z}) +
                                                     " (x < 2^31, y and z <= 65535, none 0)");
  }
  if (smem > kMaxDynamicShared) {
    return refuse(cudaErrorInvalidValue,
                  std::to_string(smem) + " bytes of dynamic shared memory (at most 227 KiB)");
  }
  if (smem > kDefaultDynamicShared) {
    return refuse(cudaErrorInvalidValue,
                  std::to_string(smem) +
                      " bytes of dynamic shared memory: above 48 KiB a kernel must opt in "
                      "with cudaFuncAttributeMaxDynamicSharedMemorySize");
  }
  if (Capturing(stream)) {
    // Checked like a launch now; stream order, faults and the run happen at each replay.
    Record(stream, [name, grid, block, smem, body, ptrs = std::vector<uintptr_t>(pointers, pointers + num_pointers)](
                       cudaStream_t s) { Launch(name, grid, block, smem, s, body, ptrs.data(), ptrs.size()); });
    return;
  }
  CountHostLaunch();
  {
    bool inject = false;
    {
      std::lock_guard<std::mutex> l(R().mu);
      inject = ++R().launch_attempts == R().fault_at;
    }
    if (inject) {
      SetSticky(cudaErrorIllegalAddress,
                std::string("kernel fault: ") + name + ": an illegal address (injected by FaultAtLaunch)");
      Fail(cudaErrorIllegalAddress);
      return;
    }
  }
  std::lock_guard<std::mutex> launch_lock(R().launch_mu);
  const bool thread_mode = R().thread_mode;
  const bool reverse = R().reverse;
  const uint64_t nblocks = uint64_t{grid.x} * grid.y * grid.z;
  int64_t syncs = 0, collectives = 0;
  std::string fault;
  for (uint64_t k = 0; k < nblocks && fault.empty(); ++k) {
    const uint64_t lin = reverse ? nblocks - 1 - k : k;
    const uint3 bidx{static_cast<unsigned>(lin % grid.x),
                     static_cast<unsigned>((lin / grid.x) % grid.y),
                     static_cast<unsigned>(lin / (uint64_t{grid.x} * grid.y))};
    Block b;
    b.kernel = name;
    b.body = &body;
    b.threads = thread_mode;
    b.n = static_cast<int>(threads);
    b.nwarps = (b.n + 31) / 32;
    b.warps = std::make_unique<Warp[]>(b.nwarps);
    for (int w = 0; w < b.nwarps; ++w) {
      b.warps[w].first = 32 * w;
      b.warps[w].size = std::min(32, b.n - 32 * w);
    }
    // Dynamic shared memory: exactly the bytes asked for (ASan sees overruns), filled with NaNs.
    std::unique_ptr<unsigned char[]> shared(new unsigned char[smem]);
    std::memset(shared.get(), 0xff, smem);
    b.lanes.resize(b.n);
    for (int t = 0; t < b.n; ++t) {
      Lane& l = b.lanes[t];
      l.block = &b;
      l.tid = t;
      l.warp = t / 32;
      l.lane = t % 32;
      l.ctx.thread_idx = {static_cast<unsigned>(t % block.x),
                          static_cast<unsigned>((t / block.x) % block.y),
                          static_cast<unsigned>(t / (block.x * block.y))};
      l.ctx.block_idx = bidx;
      l.ctx.block_dim = {block.x, block.y, block.z};
      l.ctx.grid_dim = {grid.x, grid.y, grid.z};
      l.ctx.dynamic_shared = shared.get();
      l.ctx.lane = &l;
    }
    Block* const outer = running_block;
    running_block = &b;
    if (thread_mode) {
      RunBlockThreads(b);
    } else {
      RunBlockFibers(b);
    }
    running_block = outer;
    syncs += b.syncs;
    collectives += b.collectives;
    if (b.faulted) fault = b.fault;
  }
  {
    std::lock_guard<std::mutex> l(R().mu);
    Counters& c = R().counters;
    ++c.launches;
    c.blocks += static_cast<int64_t>(nblocks);
    c.threads += static_cast<int64_t>(nblocks * threads);
    c.syncthreads += syncs;
    c.warp_collectives += collectives;
  }
  if (!fault.empty()) SetSticky(cudaErrorLaunchFailure, "kernel fault: " + fault);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Test API.

Counters GetCounters() {
  std::lock_guard<std::mutex> l(R().mu);
  return R().counters;
}
void ResetCounters() {
  std::lock_guard<std::mutex> l(R().mu);
  const int64_t in_use = R().counters.bytes_in_use;
  R().counters = Counters{};
  R().counters.bytes_in_use = R().counters.peak_bytes_in_use = in_use;
}
void SetMemoryLimit(int64_t bytes) {
  std::lock_guard<std::mutex> l(R().mu);
  R().limit = bytes;
}
int64_t MemoryLimit() {
  std::lock_guard<std::mutex> l(R().mu);
  return R().limit;
}
void FaultAtLaunch(int64_t n) {
  std::lock_guard<std::mutex> l(R().mu);
  R().fault_at = n <= 0 ? 0 : R().launch_attempts + n;
}
void SetThreadMode(bool on) { R().thread_mode = on; }
bool ThreadMode() { return R().thread_mode; }
void SetReverseBlocks(bool on) { R().reverse = on; }
std::string LastFault() {
  std::lock_guard<std::mutex> l(R().mu);
  return R().fault;
}
void ResetDevice() {
  std::lock_guard<std::mutex> l(R().mu);
  R().sticky = cudaSuccess;
  R().fault.clear();
  R().in_flight.clear();
  R().staging.clear();
  last_error = cudaSuccess;
}

}  // namespace simt

// -----------------------------------------------------------------------------------------------
// CUDA runtime.

using simt::Fail;
using simt::R;

#define SIMT_STICKY_RETURN()                                                       \
  do {                                                                             \
    if (const cudaError_t s_ = simt::Sticky(); s_ != cudaSuccess) return Fail(s_); \
  } while (0)

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : Fail(cudaErrorInvalidDevice);
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (p == nullptr) return Fail(cudaErrorInvalidValue);
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "%s", simt::kDeviceName);
  p->totalGlobalMem = static_cast<size_t>(simt::MemoryLimit());
  p->sharedMemPerBlock = simt::kDefaultDynamicShared;
  p->sharedMemPerBlockOptin = simt::kMaxDynamicShared;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->multiProcessorCount = 1;
  p->major = 9;
  p->minor = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  SIMT_STICKY_RETURN();
  simt::Synchronized(nullptr, true);
  return cudaSuccess;
}
cudaError_t cudaDeviceReset() {
  simt::ResetDevice();
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  if (const cudaError_t s = simt::Sticky(); s != cudaSuccess) return s;
  const cudaError_t e = simt::last_error;
  simt::last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  if (const cudaError_t s = simt::Sticky(); s != cudaSuccess) return s;
  return simt::last_error;
}
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
      return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources:
      return "cudaErrorLaunchOutOfResources";
    case cudaErrorIllegalInstruction:
      return "cudaErrorIllegalInstruction";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched:
      return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (simt: see simt::LastFault())";
    default:
      return cudaGetErrorName(e);
  }
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  SIMT_STICKY_RETURN();
  if (bytes == 0) return cudaSuccess;
  {
    std::lock_guard<std::mutex> l(R().mu);
    if (R().counters.bytes_in_use + static_cast<int64_t>(bytes) > R().limit)
      return Fail(cudaErrorMemoryAllocation);
  }
  void* p = std::malloc(bytes);
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation);
  if (bytes <= simt::kPoisonUpTo)
    std::memset(p, 0xff, bytes);  // never compute on zeros by accident
  std::lock_guard<std::mutex> l(R().mu);
  if (R().counters.bytes_in_use + static_cast<int64_t>(bytes) > R().limit) {
    std::free(p);
    return Fail(cudaErrorMemoryAllocation);
  }
  R().allocations[reinterpret_cast<uintptr_t>(p)] = bytes;
  simt::Counters& c = R().counters;
  ++c.mallocs;
  c.bytes_in_use += static_cast<int64_t>(bytes);
  c.peak_bytes_in_use = std::max(c.peak_bytes_in_use, c.bytes_in_use);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> l(R().mu);
  auto it = R().allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == R().allocations.end()) {
    std::fprintf(stderr, "simt: cudaFree(%p): not a live device allocation\n", ptr);
    simt::last_error = cudaErrorInvalidValue;
    return cudaErrorInvalidValue;
  }
  R().counters.bytes_in_use -= static_cast<int64_t>(it->second);
  ++R().counters.frees;
  R().in_flight.erase(it->first);
  std::free(ptr);
  R().allocations.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  void* p = std::malloc(std::max<size_t>(bytes, 1));
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> l(R().mu);
  R().pinned[reinterpret_cast<uintptr_t>(p)] = bytes;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> l(R().mu);
  if (R().pinned.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
    std::fprintf(stderr, "simt: cudaFreeHost(%p): not page-locked host memory\n", ptr);
    return Fail(cudaErrorInvalidValue);
  }
  R().staging.erase(reinterpret_cast<uintptr_t>(ptr));  // cudaFreeHost waits for the device
  std::free(ptr);
  return cudaSuccess;
}

namespace {
// Whether [p, p + bytes) lies in one cudaMallocHost allocation. Caller holds R().mu.
bool InPinnedLocked(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = R().pinned.upper_bound(a);
  if (it == R().pinned.begin()) return false;
  --it;
  return a >= it->first && a - it->first <= it->second && bytes <= it->second - (a - it->first);
}
// The page-locked allocation holding p (0: none). Caller holds R().mu.
uintptr_t PinnedBaseLocked(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = R().pinned.upper_bound(a);
  if (it == R().pinned.begin()) return 0;
  --it;
  return a - it->first < std::max<size_t>(it->second, 1) ? it->first : 0;
}
// An asynchronous copy to or from page-locked `host` on `stream`. Until a synchronize covers it, the
// host may neither rewrite nor read that memory: a second asynchronous copy through the same
// allocation before then means the host reused it too early (on a device, the data would be torn).
// Counts it as a stream hazard and makes it the sticky fault.
bool StageLocked(const void* host, cudaStream_t stream, std::string* hazard) {
  const uintptr_t base = PinnedBaseLocked(host);
  if (base == 0) return true;
  auto it = R().staging.find(base);
  if (it != R().staging.end()) {
    *hazard = "an asynchronous copy on " + simt::StreamName(stream) + " through page-locked host memory " +
              std::to_string(base) + " whose copy on " + simt::StreamName(it->second.stream) +
              " is not yet synchronized (double-buffer it, or synchronize first)";
    ++R().counters.stream_hazards;
    return false;
  }
  R().staging[base] = {stream, ++R().ops};
  return true;
}

cudaError_t Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                 cudaStream_t stream, bool async) {
  SIMT_STICKY_RETURN();
  if (!simt::StreamValid(stream)) return Fail(cudaErrorInvalidResourceHandle);
  // Not captured: relgen keeps copies outside its graphs (pageable host memory cannot be in one).
  if (simt::RefuseIfCapturing(stream)) return Fail(cudaErrorStreamCaptureUnsupported);
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  const bool dst_dev = simt::InDeviceMemory(dst, bytes), src_dev = simt::InDeviceMemory(src, bytes);
  if (kind == cudaMemcpyDefault) {
    kind = dst_dev ? (src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                   : (src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool want_dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault)
    return Fail(cudaErrorInvalidMemcpyDirection);
  if (want_dst_dev != dst_dev || want_src_dev != src_dev) {
    std::fprintf(stderr,
                 "simt: cudaMemcpy kind %d of %zu bytes: destination %p is %s, source %p is %s\n",
                 kind, bytes, dst, dst_dev ? "device memory" : "not (all) device memory", src,
                 src_dev ? "device memory" : "not (all) device memory");
    return Fail(cudaErrorInvalidValue);
  }
  const uintptr_t touched[] = {reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src)};
  if (!simt::CheckStreamOrder("a copy", stream, touched, 2)) return Fail(cudaErrorLaunchFailure);
  if (async && (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToHost)) {
    std::string hazard;
    bool ok;
    {
      std::lock_guard<std::mutex> l(R().mu);
      ok = StageLocked(kind == cudaMemcpyHostToDevice ? src : dst, stream, &hazard);
    }
    if (!ok) {
      simt::SetSticky(cudaErrorLaunchFailure, "stream hazard: " + hazard);
      return Fail(cudaErrorLaunchFailure);
    }
  }
  std::memmove(dst, src, bytes);
  simt::MarkInFlight(dst, stream);
  std::lock_guard<std::mutex> l(R().mu);
  simt::Counters& c = R().counters;
  (kind == cudaMemcpyHostToDevice   ? c.bytes_h2d
   : kind == cudaMemcpyDeviceToHost ? c.bytes_d2h
                                    : c.bytes_d2d) += static_cast<int64_t>(bytes);
  if (kind == cudaMemcpyDeviceToHost) {
    ++c.copies_d2h;
    if (!InPinnedLocked(dst, bytes)) c.bytes_d2h_pageable += static_cast<int64_t>(bytes);
  }
  if (kind == cudaMemcpyHostToDevice && !InPinnedLocked(src, bytes)) c.bytes_h2d_pageable += static_cast<int64_t>(bytes);
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return Copy(dst, src, bytes, kind, nullptr, false);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return Copy(dst, src, bytes, kind, stream, true);
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  SIMT_STICKY_RETURN();
  if (!simt::StreamValid(stream)) return Fail(cudaErrorInvalidResourceHandle);
  if (simt::RefuseIfCapturing(stream)) return Fail(cudaErrorStreamCaptureUnsupported);
  if (bytes == 0) return cudaSuccess;
  if (!simt::InDeviceMemory(ptr, bytes)) return Fail(cudaErrorInvalidValue);
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  return cudaMemsetAsync(ptr, value, bytes, nullptr);
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  SIMT_STICKY_RETURN();
  if (free == nullptr || total == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> l(R().mu);
  *total = static_cast<size_t>(R().limit);
  *free = static_cast<size_t>(std::max<int64_t>(0, R().limit - R().counters.bytes_in_use));
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr || flags > cudaStreamNonBlocking) return Fail(cudaErrorInvalidValue);
  SIMT_STICKY_RETURN();
  auto* s = new CUstream_st;
  s->flags = flags;
  std::lock_guard<std::mutex> l(R().mu);
  R().streams.insert(s);
  *stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  SIMT_STICKY_RETURN();
  if (!simt::StreamValid(stream)) return Fail(cudaErrorInvalidResourceHandle);
  if (simt::RefuseIfCapturing(stream)) return Fail(cudaErrorStreamCaptureUnsupported);
  simt::Synchronized(stream, false);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr || (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming)) != 0) return Fail(cudaErrorInvalidValue);
  auto* e = new CUevent_st;
  std::lock_guard<std::mutex> l(R().mu);
  R().events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  SIMT_STICKY_RETURN();
  if (!simt::StreamValid(stream)) return Fail(cudaErrorInvalidResourceHandle);
  if (simt::RefuseIfCapturing(stream)) return Fail(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::mutex> l(R().mu);
  if (R().events.count(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  event->stream = stream;
  event->op = std::max<int64_t>(R().ops, 1);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  SIMT_STICKY_RETURN();
  const CUstream_st* stream;
  int64_t op;
  {
    std::lock_guard<std::mutex> l(R().mu);
    if (R().events.count(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
    stream = event->stream;
    op = event->op;
  }
  if (op == 0) return cudaSuccess;  // never recorded: complete
  simt::Synchronized(const_cast<cudaStream_t>(stream), false, op);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> l(R().mu);
  if (R().events.erase(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  SIMT_STICKY_RETURN();
  if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed) return Fail(cudaErrorInvalidValue);
  if (stream == nullptr) return Fail(cudaErrorStreamCaptureUnsupported);  // the legacy stream
  std::lock_guard<std::mutex> l(R().mu);
  if (R().streams.count(stream) == 0) return Fail(cudaErrorInvalidResourceHandle);
  if (stream->capture != nullptr) return Fail(cudaErrorIllegalState);
  stream->capture = std::make_unique<CUgraph_st>();
  stream->capture_invalid = false;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr) return Fail(cudaErrorInvalidValue);
  *graph = nullptr;
  std::lock_guard<std::mutex> l(R().mu);
  if (stream == nullptr || R().streams.count(stream) == 0) return Fail(cudaErrorInvalidResourceHandle);
  if (stream->capture == nullptr) return Fail(cudaErrorIllegalState);
  std::unique_ptr<CUgraph_st> g = std::move(stream->capture);
  if (stream->capture_invalid) return Fail(cudaErrorStreamCaptureInvalidated);
  R().graphs.insert(g.get());
  *graph = g.release();
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  if (exec == nullptr || flags != 0) return Fail(cudaErrorInvalidValue);
  *exec = nullptr;
  SIMT_STICKY_RETURN();
  std::lock_guard<std::mutex> l(R().mu);
  if (R().graphs.count(graph) == 0) return Fail(cudaErrorInvalidValue);
  auto* e = new CUgraphExec_st{graph->nodes};
  R().execs.insert(e);
  *exec = e;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  SIMT_STICKY_RETURN();
  if (!simt::StreamValid(stream)) return Fail(cudaErrorInvalidResourceHandle);
  if (simt::RefuseIfCapturing(stream)) return Fail(cudaErrorStreamCaptureUnsupported);  // no child graphs
  std::vector<std::function<void(cudaStream_t)>> nodes;
  {
    std::lock_guard<std::mutex> l(R().mu);
    if (R().execs.count(exec) == 0) return Fail(cudaErrorInvalidValue);
    nodes = exec->nodes;
    ++R().counters.host_launches;
    ++R().counters.graph_launches;
  }
  // Each node as the launch or GEMM it recorded, on this stream; a fault is sticky and ends it.
  simt::replaying = true;
  for (const auto& node : nodes) {
    node(stream);
    if (simt::Sticky() != cudaSuccess) break;
  }
  simt::replaying = false;
  SIMT_STICKY_RETURN();
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard<std::mutex> l(R().mu);
  if (R().execs.erase(exec) == 0) return Fail(cudaErrorInvalidValue);
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::mutex> l(R().mu);
  if (R().graphs.erase(graph) == 0) return Fail(cudaErrorInvalidValue);
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> l(R().mu);
  if (stream == nullptr || R().streams.erase(stream) == 0)
    return Fail(cudaErrorInvalidResourceHandle);
  for (auto it = R().in_flight.begin(); it != R().in_flight.end();) {
    it = it->second == stream ? R().in_flight.erase(it) : std::next(it);
  }
  delete stream;
  return cudaSuccess;
}

// -----------------------------------------------------------------------------------------------
// cuBLAS.

namespace {
bool HandleValid(cublasHandle_t h) {
  std::lock_guard<std::mutex> l(R().mu);
  return h != nullptr && R().handles.count(h) > 0;
}

// Elements a column-major rows x cols matrix with leading dimension ld spans.
size_t Span(int rows, int cols, int ld) {
  return rows == 0 || cols == 0 ? 0 : static_cast<size_t>(cols - 1) * ld + rows;
}

bool Overlap(const void* a, size_t an, const void* b, size_t bn) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an > 0 && bn > 0 && x < y + bn && y < x + an;
}
// A and B are float32, or bf16 bits with `bf16`; C is float32.
cublasStatus_t Gemm(cudaStream_t stream, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al,
                    const void* A, int lda, long long sa, const void* B, int ldb, long long sb, float be, float* C,
                    int ldc, long long sc, int batch, bool bf16);
// The checks every GEMM entry point makes before it runs or is recorded: INVALID_VALUE as cuBLAS
// answers it, SUCCESS with *run false for an empty problem.
cublasStatus_t CheckGemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                         const void* alpha, int lda, int ldb, const void* beta, int ldc, int batch, bool* run) {
  *run = false;
  if (!HandleValid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  auto op_ok = [](cublasOperation_t o) {
    return o == CUBLAS_OP_N || o == CUBLAS_OP_T || o == CUBLAS_OP_C;
  };
  if (!op_ok(ta) || !op_ok(tb) || m < 0 || n < 0 || k < 0 || batch < 0)
    return CUBLAS_STATUS_INVALID_VALUE;
  const int a_rows = ta == CUBLAS_OP_N ? m : k;
  const int b_rows = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  if (simt::Sticky() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  *run = true;
  return CUBLAS_STATUS_SUCCESS;
}
// Runs the checked GEMM on the handle's stream, or records it into the stream's capture: there
// only on a handle with a workspace of its own (cuBLAS would allocate one, which no capture holds).
cublasStatus_t Submit(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al,
                      const void* A, int lda, long long sa, const void* B, int ldb, long long sb, float be, float* C,
                      int ldc, long long sc, int batch, bool bf16) {
  const cudaStream_t stream = handle->stream;
  if (simt::Capturing(stream)) {
    if (handle->workspace == nullptr) return CUBLAS_STATUS_NOT_SUPPORTED;
    simt::Record(stream, [=](cudaStream_t s) { Gemm(s, ta, tb, m, n, k, al, A, lda, sa, B, ldb, sb, be, C, ldc, sc, batch, bf16); });
    return CUBLAS_STATUS_SUCCESS;
  }
  simt::CountHostLaunch();
  return Gemm(stream, ta, tb, m, n, k, al, A, lda, sa, B, ldb, sb, be, C, ldc, sc, batch, bf16);
}
}  // namespace

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (simt::Sticky() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  auto* h = new cublasContext;
  std::lock_guard<std::mutex> l(R().mu);
  R().handles.insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  std::lock_guard<std::mutex> l(R().mu);
  if (handle == nullptr || R().handles.erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (!HandleValid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!simt::StreamValid(stream)) return CUBLAS_STATUS_INVALID_VALUE;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!HandleValid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode < CUBLAS_DEFAULT_MATH || mode > CUBLAS_TF32_TENSOR_OP_MATH)
    return CUBLAS_STATUS_INVALID_VALUE;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t workspace_bytes) {
  if (!HandleValid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (workspace == nullptr ? workspace_bytes != 0 : !simt::InDeviceMemory(workspace, workspace_bytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->workspace = workspace;
  handle->workspace_bytes = workspace_bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float* alpha, const float* A, int lda, long long sa,
                                         const float* B, int ldb, long long sb, const float* beta,
                                         float* C, int ldc, long long sc, int batch) {
  bool run = false;
  if (const cublasStatus_t st = CheckGemm(handle, ta, tb, m, n, k, alpha, lda, ldb, beta, ldc, batch, &run);
      st != CUBLAS_STATUS_SUCCESS || !run) {
    return st;
  }
  // Host pointer mode: alpha and beta are read now, as cuBLAS does.
  return Submit(handle, ta, tb, m, n, k, *alpha, A, lda, sa, B, ldb, sb, *beta, C, ldc, sc, batch, false);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m,
                                          int n, int k, const void* alpha, const void* A, cudaDataType at, int lda,
                                          long long sa, const void* B, cudaDataType bt, int ldb, long long sb,
                                          const void* beta, void* C, cudaDataType ct, int ldc, long long sc,
                                          int batch, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  bool run = false;
  if (const cublasStatus_t st = CheckGemm(handle, ta, tb, m, n, k, alpha, lda, ldb, beta, ldc, batch, &run);
      st != CUBLAS_STATUS_SUCCESS) {
    return st;
  }
  const bool bf16 = at == CUDA_R_16BF;
  const bool types = at == bt && (at == CUDA_R_32F || bf16) && ct == CUDA_R_32F &&
                     (compute == CUBLAS_COMPUTE_32F || (!bf16 && compute == CUBLAS_COMPUTE_32F_PEDANTIC));
  if (!types || (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (!run) return CUBLAS_STATUS_SUCCESS;
  // With a float32 compute type alpha and beta are floats.
  return Submit(handle, ta, tb, m, n, k, *static_cast<const float*>(alpha), A, lda, sa, B, ldb, sb,
                *static_cast<const float*>(beta), static_cast<float*>(C), ldc, sc, batch, bf16);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType at, int lda, const void* B, cudaDataType bt,
                            int ldb, const void* beta, void* C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
  return cublasGemmStridedBatchedEx(handle, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc,
                                    0, 1, compute, algo);
}

namespace {
// The reference GEMM on `stream`, arguments already checked.
cublasStatus_t Gemm(cudaStream_t stream, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al,
                    const void* A, int lda, long long sa, const void* B, int ldb, long long sb, float be, float* C,
                    int ldc, long long sc, int batch, bool bf16) {
  if (simt::Sticky() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
  const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
  const uintptr_t touched[] = {reinterpret_cast<uintptr_t>(A), reinterpret_cast<uintptr_t>(B),
                               reinterpret_cast<uintptr_t>(C)};
  const char* const name = bf16 ? "cublasGemmEx" : "cublasSgemm";
  const size_t esize = bf16 ? sizeof(uint16_t) : sizeof(float);
  // Element i of a matrix, widened (bf16 exactly) to float.
  auto at = [&](const void* base, size_t i) {
    if (!bf16) return static_cast<const float*>(base)[i];
    const uint32_t u = uint32_t{static_cast<const uint16_t*>(base)[i]} << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  if (!simt::CheckStreamOrder(name, stream, touched, 3)) {
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  for (int e = 0; e < batch; ++e) {
    const void* a = static_cast<const char*>(A) + e * sa * static_cast<long long>(esize);
    const void* b = static_cast<const char*>(B) + e * sb * static_cast<long long>(esize);
    float* c = C + e * sc;
    const bool reads_ab = k > 0 && al != 0.f;
    const size_t an = reads_ab ? Span(a_rows, a_cols, lda) : 0,
                 bn = reads_ab ? Span(b_rows, b_cols, ldb) : 0;
    const size_t cn = Span(m, n, ldc);
    std::string bad;
    if (an > 0 && !simt::InDeviceMemory(a, an * esize))
      bad = "A is not inside one device allocation";
    if (bn > 0 && !simt::InDeviceMemory(b, bn * esize))
      bad = "B is not inside one device allocation";
    if (!simt::InDeviceMemory(c, cn * sizeof(float))) bad = "C is not inside one device allocation";
    if (bad.empty() && (Overlap(c, cn * sizeof(float), a, an * esize) ||
                        Overlap(c, cn * sizeof(float), b, bn * esize))) {
      bad = "C overlaps A or B";
    }
    if (!bad.empty()) {
      simt::SetSticky(cudaErrorIllegalAddress,
                      std::string(name) + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                          " k=" + std::to_string(k) + " lda=" + std::to_string(lda) + " ldb=" +
                          std::to_string(ldb) + " ldc=" + std::to_string(ldc) + ": " + bad);
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        double s = 0;
        if (reads_ab) {
          for (int p = 0; p < k; ++p) {
            const float av = ta == CUBLAS_OP_N ? at(a, static_cast<size_t>(p) * lda + i)
                                               : at(a, static_cast<size_t>(i) * lda + p);
            const float bv = tb == CUBLAS_OP_N ? at(b, static_cast<size_t>(j) * ldb + p)
                                               : at(b, static_cast<size_t>(p) * ldb + j);
            s += static_cast<double>(av) * bv;
          }
        }
        float& out = c[static_cast<size_t>(j) * ldc + i];
        out = static_cast<float>(al * s + (be == 0.f ? 0.0 : static_cast<double>(be) * out));
      }
    }
  }
  simt::MarkInFlight(C, stream);
  std::lock_guard<std::mutex> l(R().mu);
  R().counters.gemms += batch;
  R().counters.gemm_flops += int64_t{2} * m * n * k * batch;
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float* alpha, const float* A, int lda,
                           const float* B, int ldb, const float* beta, float* C, int ldc) {
  return cublasSgemmStridedBatched(handle, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                                   ldc, 0, 1);
}
