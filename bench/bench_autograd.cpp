// Host cost of autograd per op: a chain of `y = y * c + d` (2 ops per step) on small tensors,
// timed three ways: forward without recording (c, d frozen), forward with recording, and forward
// plus backward. Per-op figures divide by the number of ops in the chain (2 * steps); the
// backward share is (forward+backward) - (forward, recording). Runs on the CPU backend, or on
// CUDA with --cuda (then each timed region ends with a device synchronise). On the CPU the figure
// is the thread's CPU time (a shared, loaded build machine makes wall time mostly scheduling
// noise); on CUDA it is wall time.
//
// Output: one line per figure, "BENCH {json}" like bench_ops.
//   BENCH {"name": "chain_fwd_norecord", "device": "cpu", "us_per_op": 0.51}
//
// Usage: bench_autograd [--cuda] [--steps N] [--numel N] [--reps N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "flame/flame.h"

namespace {

using flame::Device;
using flame::Tensor;

struct Args {
  bool cuda = false;
  int steps = 500;  // 1000 ops
  int64_t numel = 1024;
  int reps = 30;
};

void sync(const Args& a) {
  if (a.cuda) flame::cuda::synchronize();
}

double now_us(const Args& a) {
  if (a.cuda) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

// Median time of fn over reps calls, in microseconds (after two warm-up calls).
double median_us(const Args& a, const std::function<void()>& fn) {
  fn();
  fn();
  sync(a);
  std::vector<double> t;
  for (int r = 0; r < a.reps; ++r) {
    const double t0 = now_us(a);
    fn();
    sync(a);
    t.push_back(now_us(a) - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(const Args& a, const char* name, double us_per_op) {
  std::printf("BENCH {\"name\": \"%s\", \"device\": \"%s\", \"numel\": %lld, \"ops\": %d, \"us_per_op\": %.4g}\n",
              name, a.cuda ? "cuda" : "cpu", static_cast<long long>(a.numel), 2 * a.steps, us_per_op);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cuda")) a.cuda = true;
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) a.steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--numel") && i + 1 < argc) a.numel = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) a.reps = std::atoi(argv[++i]);
  }
  const Device dev = a.cuda ? Device::cuda() : Device::cpu();
  flame::Generator gen(1234);
  Tensor x = Tensor::randn({a.numel}, 0.0, 1.0, dev, &gen);
  // c close to 1 keeps the chain's values bounded over a thousand steps.
  Tensor c = (Tensor::rand({a.numel}, dev, &gen) * 0.02 + 0.99);
  Tensor d = Tensor::randn({a.numel}, 0.0, 0.01, dev, &gen);
  auto chain = [&](const Tensor& cc, const Tensor& dd) {
    Tensor y = x;
    for (int s = 0; s < a.steps; ++s) y = y * cc + dd;
    return y;
  };
  const double ops = 2.0 * a.steps;
  const double fwd = median_us(a, [&] { (void)chain(c, d); });
  Tensor cg = c.detach().requires_grad_(true), dg = d.detach().requires_grad_(true);
  const double fwd_rec = median_us(a, [&] { (void)chain(cg, dg); });
  const double fwd_bwd = median_us(a, [&] {
    flame::BackwardOptions o;
    o.grad_output = flame::Tensor::ones({a.numel}, dev);
    flame::Gradients g = chain(cg, dg).backward(o);
    (void)g;
  });
  report(a, "chain_fwd_norecord", fwd / ops);
  report(a, "chain_fwd_record", fwd_rec / ops);
  report(a, "chain_fwd_bwd", fwd_bwd / ops);
  report(a, "chain_bwd_share", (fwd_bwd - fwd_rec) / ops);
  return 0;
}
