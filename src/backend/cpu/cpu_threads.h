#pragma once
// The CPU backend's thread pool (Note [CPU threads] in cpu_threads.cpp).
#include <cstdint>
#include <functional>

namespace flame::backend::cpu {

// Work below this many elements runs on the calling thread: waking a worker costs a few
// microseconds, about what 32 K elements of a simple loop cost.
inline constexpr int64_t kParallelGrain = int64_t{1} << 15;

// The pool's thread count (the caller included); 1 means everything runs serially.
int pool_threads();

// Runs f(task) for every task in [0, tasks), spread over the pool (the caller takes tasks too),
// and returns when all have finished; the first exception a task throws is rethrown here. Runs
// serially when the pool has one thread, when called from inside a task, or while another thread
// uses the pool.
void parallel_tasks(int64_t tasks, const std::function<void(int64_t)>& f);

// Splits [0, n) into at most pool_threads() contiguous chunks of at least `grain` indices and runs
// f(begin, end) on each. Use it only where the result cannot depend on where the chunks split
// (elementwise work, or independent output rows): the chunking follows the thread count.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  const int64_t threads = pool_threads();
  if (n <= 0) return;
  int64_t chunks = grain > 0 ? (n + grain - 1) / grain : n;
  chunks = chunks < threads ? chunks : threads;
  if (chunks <= 1) {
    f(int64_t{0}, n);
    return;
  }
  parallel_tasks(chunks, [&](int64_t c) { f(n * c / chunks, n * (c + 1) / chunks); });
}

}  // namespace flame::backend::cpu
