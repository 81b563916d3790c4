// The CPU backend's thread pool.
//
// Note [CPU threads]
// One persistent pool of pool_threads() - 1 workers plus the calling thread. Its size defaults
// to the hardware threads, FLAME_CPU_THREADS=n in the environment overrides it, and
// flame::cpu::set_num_threads(n) changes it at run time. Workers sleep on a condition variable
// between jobs (no spinning: on a 2-core machine a spinning worker takes the core the caller
// needs). Who uses it:
//   - convolutions (cpu_conv.cpp): im2col/col2im and the per-chunk GEMMs, over chunks of images;
//     the filter gradient sums one partial per fixed chunk of images in chunk order, so it does
//     not depend on the thread count;
//   - contiguous elementwise ops (copy, fill, unary, binary) over contiguous element ranges, and
//     the group norm forward/backward over independent (image, group) rows, above
//     kParallelGrain elements. Each element is computed by the same code as the serial loop, so
//     results are bit-identical for any thread count; the group norm's weight/bias gradients sum
//     per-(image, channel) partials over images in a fixed order.
//   - the GEMMs of CpuBackend::matmul (cpu_matmul.cpp), split over batch entries or over row
//     blocks of the output (each output element is one BLAS dot product either way).
// OpenBLAS (the pthread build) has its own workers, which spin in sched_yield after each call:
// with both pools active on 2 cores, the OpenBLAS workers steal the core from the FLAME worker
// running the non-GEMM work. And its threaded GEMM does not always give the bits of its
// single-threaded one (on Zen cores the products differ in the last place), which would make
// results depend on the thread count. So FLAME runs BLAS single-threaded
// (openblas_set_num_threads(1)) for every pool size and splits GEMMs itself: with one thread
// (FLAME_CPU_THREADS=1 or set_num_threads(1)) a GEMM runs on one core. Nested use runs serially:
// a task that calls parallel_tasks again runs the inner loop on its own thread, and a second
// thread calling into the pool while it is busy (a data-loader thread, say) runs its work
// serially instead of waiting.
// Where the OS refuses a worker thread (a container's thread limit, many processes at once), the
// pool keeps the workers that started and says so on stderr once per resize; results do not
// depend on the count.
// A child forked from a process with workers has none of them (fork copies only the calling
// thread), and the pool's mutexes may have been held by a parent thread at that instant: a
// pthread_atfork handler gives the child a fresh pool of one thread (the parent's workers are
// abandoned, never joined), so a forked child's ops run serially until set_num_threads.
#include "src/backend/cpu/cpu_threads.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "flame/cpu.h"
#include "flame/error.h"

#include <pthread.h>

#ifdef FLAME_WITH_CBLAS
#include <cblas.h>
#endif

namespace flame::backend::cpu {
namespace {

thread_local bool tl_in_task = false;

int default_threads() {
  if (const char* env = std::getenv("FLAME_CPU_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    FLAME_CHECK(end != nullptr && *end == '\0' && v >= 1 && v <= 1024, "FLAME_CPU_THREADS",
                "expected a thread count from 1 to 1024, got '", env,
                "': unset it to use every hardware thread, or give a positive integer");
    return static_cast<int>(v);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

#if defined(FLAME_WITH_CBLAS) && defined(OPENBLAS_VERSION)
void set_blas_threads() { openblas_set_num_threads(1); }
#else
void set_blas_threads() {}
#endif

class Pool {
 public:
  Pool() {
    instance_ = this;
    static const int registered = pthread_atfork(nullptr, nullptr, [] {
      if (instance_ != nullptr) instance_->reset_in_forked_child();
    });
    (void)registered;
    resize(default_threads());
  }
  ~Pool() {
    stop();
    instance_ = nullptr;
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void resize(int n) {
    std::lock_guard<std::mutex> run(run_mutex_);
    stop();
    set_blas_threads();
    stopping_ = false;
    for (int i = 1; i < n; ++i) {
      try {
        workers_.emplace_back([this] { worker(); });
      } catch (const std::system_error& e) {  // the process's thread limit (EAGAIN)
        std::fprintf(stderr,
                     "flame: the CPU thread pool started %zu of %d threads (%s); it runs with those. Set "
                     "FLAME_CPU_THREADS (or cpu::set_num_threads) to a count the machine allows.\n",
                     workers_.size() + 1, n, e.what());
        break;
      }
    }
    threads_.store(static_cast<int>(workers_.size()) + 1, std::memory_order_relaxed);
  }

  void run(int64_t tasks, const std::function<void(int64_t)>& f) {
    std::unique_lock<std::mutex> run(run_mutex_, std::try_to_lock);
    if (!run.owns_lock() || workers_.empty()) return serial(tasks, f);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &f;
      tasks_ = tasks;
      next_.store(0, std::memory_order_relaxed);
      busy_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    take_tasks();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  static void serial(int64_t tasks, const std::function<void(int64_t)>& f) {
    for (int64_t t = 0; t < tasks; ++t) f(t);
  }

  // Takes tasks until none is left; records the first exception.
  void take_tasks() {
    tl_in_task = true;
    for (;;) {
      const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
      if (t >= tasks_) break;
      try {
        (*job_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    tl_in_task = false;
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      take_tasks();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  // In the child of fork(): the workers do not exist there and the locks may be held by parent
  // threads that do not exist either. Re-create the locks, abandon the thread handles (joining or
  // destroying them would wait for, or terminate on, threads of the parent).
  void reset_in_forked_child() {
    new (&run_mutex_) std::mutex();
    new (&mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    new (&done_) std::condition_variable();
    new std::vector<std::thread>(std::move(workers_));  // never destroyed
    workers_.clear();
    threads_.store(1, std::memory_order_relaxed);
    job_ = nullptr;
    busy_ = 0;
    stopping_ = false;
    error_ = nullptr;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  std::atomic<int> threads_{1};
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  static inline Pool* instance_ = nullptr;
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

int pool_threads() { return tl_in_task ? 1 : pool().threads(); }

void parallel_tasks(int64_t tasks, const std::function<void(int64_t)>& f) {
  if (tasks <= 0) return;
  if (tasks == 1 || tl_in_task) {
    for (int64_t t = 0; t < tasks; ++t) f(t);
    return;
  }
  pool().run(tasks, f);
}

}  // namespace flame::backend::cpu

namespace flame::cpu {

void set_num_threads(int n) {
  FLAME_CHECK(n >= 1 && n <= 1024, "cpu::set_num_threads", "expected a thread count from 1 to 1024, got ", n);
  FLAME_CHECK(!backend::cpu::tl_in_task, "cpu::set_num_threads",
              "called from inside a CPU kernel's parallel task; call it between ops");
  backend::cpu::pool().resize(n);
}

int num_threads() { return backend::cpu::pool().threads(); }

}  // namespace flame::cpu
