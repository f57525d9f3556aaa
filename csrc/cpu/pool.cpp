// 0. the kernels' thread pool: parallel_for over tasks claimed one at a time by whichever thread is free.
//
// Why not OpenMP (what the kernels used before): a decode step of a 1.7B model is ~190 short parallel regions,
// and an OpenMP region ends in a barrier every thread of the team must reach.  On an idle machine that costs a
// few microseconds a region; when another process holds a core, the barrier waits for the descheduled worker's
// next time slice (milliseconds), and a 2-thread decode step became ~10x slower than one thread (measured on
// this project's 2-core machine: 2.4 against 13 tok/s).  Here the calling thread claims tasks as well, and a
// region waits only for tasks a thread has claimed: a worker that has not woken up claims nothing, so on a busy
// machine the step degrades towards the single-thread speed instead of collapsing.  Workers spin for a short
// while (KVK_SPIN_US) after their last task, then sleep on a futex.  The same policy as llama.cpp's ggml
// threadpool (poll, then a condition wait), read, not copied.
//
// Results never depend on which thread runs a task: a task is a fixed range of the work.
#include "common.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

namespace kvk {

namespace {

constexpr int64_t GEN_BITS = 24, N_BITS = 20, IDX_BITS = 20;  // state = gen | tasks | next task
constexpr uint64_t N_MASK = (uint64_t(1) << N_BITS) - 1, IDX_MASK = (uint64_t(1) << IDX_BITS) - 1;
constexpr int64_t MAX_TASKS = int64_t(N_MASK);

int64_t spin_us() {
  static const int64_t us = [] {
    const char* s = std::getenv("KVK_SPIN_US");
    return s != nullptr ? std::max<int64_t>(0, std::atoll(s)) : int64_t(300);
  }();
  return us;
}

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, nullptr, nullptr, 0);
}

class Pool {
 public:
  // Runs fn(ctx, t) for t in [0, n) on the calling thread and up to threads-1 workers.
  void run(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx) {
    if (t_in_pool) {  // a task calls back: run here
      for (int64_t t = 0; t < n; ++t) fn(ctx, t);
      return;
    }
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) {  // another thread's region holds the pool: run here
      for (int64_t t = 0; t < n; ++t) fn(ctx, t);
      return;
    }
    grow(threads - 1);
    active_.store(threads - 1, std::memory_order_relaxed);
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & ((uint64_t(1) << GEN_BITS) - 1);
    state_.store((gen_ << (N_BITS + IDX_BITS)) | (uint64_t(n) << IDX_BITS), std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) futex(&wake_, FUTEX_WAKE_PRIVATE, INT32_MAX);
    t_in_pool = true;
    work(gen_);
    t_in_pool = false;
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096)
        _mm_pause();
      else
        sched_yield();  // a worker that claimed a task lost its core: let it run
    }
  }

  // Never destroyed: its threads are detached and may outlive static destructors.  A forked child has only
  // the forking thread, so it gets a new pool (the old one's memory leaks).
  static Pool*& get() {
    static Pool* p = new Pool();
    return p;
  }

 private:
  // Claims and runs tasks of generation g until none is left; returns after its last claimed task.
  void work(uint64_t g) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      int64_t idx;
      for (;;) {
        if ((s >> (N_BITS + IDX_BITS)) != g) return;
        idx = int64_t(s & IDX_MASK);
        if (idx >= int64_t((s >> IDX_BITS) & N_MASK)) return;
        if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) break;
      }
      fn_(ctx_, idx);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void grow(int want) {
    want = std::min(want, 255);
    while (nworkers_ < want) {
      const int id = nworkers_++;
      std::thread([this, id] { loop(id); }).detach();
    }
  }

  void loop(int id) {
    t_in_pool = true;
    uint32_t seen = wake_.load(std::memory_order_acquire);
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      uint32_t now;
      for (int spins = 0;; ++spins) {
        now = wake_.load(std::memory_order_acquire);
        if (now != seen) break;
        _mm_pause();
        if ((spins & 255) == 255 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us())) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          if (wake_.load(std::memory_order_acquire) == seen) futex(&wake_, FUTEX_WAIT_PRIVATE, seen);
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      seen = now;
      if (id >= active_.load(std::memory_order_relaxed)) continue;  // fewer threads asked for this region
      const uint64_t s = state_.load(std::memory_order_acquire);
      work(s >> (N_BITS + IDX_BITS));
    }
  }

  static thread_local bool t_in_pool;  // this thread is running a task (a worker, or a caller in its region)
  std::mutex mu_;
  int nworkers_ = 0;
  uint64_t gen_ = 0;
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> active_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
};

thread_local bool Pool::t_in_pool = false;

const bool registered = [] {
  pthread_atfork(nullptr, nullptr, [] { Pool::get() = new Pool(); });
  return true;
}();

}  // namespace

int pool_threads() { return std::max(1, at::get_num_threads()); }

void run_tasks(int64_t n, void (*fn)(void*, int64_t), void* ctx) {
  if (n <= 0) return;
  TORCH_CHECK(n <= MAX_TASKS, "kvk thread pool: ", n, " tasks, at most ", MAX_TASKS);
  const int threads = static_cast<int>(std::min<int64_t>(pool_threads(), n));
  if (threads <= 1) {
    for (int64_t t = 0; t < n; ++t) fn(ctx, t);
    return;
  }
  Pool::get()->run(n, threads, fn, ctx);
}

}  // namespace kvk
