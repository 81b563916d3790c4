// Host cost of autograd per op: a chain of `y = y * c + d` (2 ops per step) on small tensors,
// timed three ways: forward without recording (c, d frozen), forward with recording, and forward
// plus backward. Per-op figures divide by the number of ops in the chain (2 * steps); the
// backward share is (forward+backward) - (forward, recording). Runs on the CPU backend, or on
// CUDA with --cuda (then each timed region ends with a device synchronise). On the CPU the figure
// is the thread's CPU time (a shared, loaded build machine makes wall time mostly scheduling
// noise); on CUDA it is wall time.
//
// Beside each time it prints the heap allocations per op of that region: calls of the global
// operator new (replaced in this binary only, Note [Allocation counter]) plus the CPU block
// cache's misses (blocks it had to take from the system).
//
// Then, per op family (op_add, op_sum, op_cat, op_conv2d, op_sdpa, ...), the host cost of one call
// on small tensors, unrecorded (us_per_op, allocs_per_op) and with an input that requires grad
// (recorded_us_per_op, recorded_allocs_per_op), and a small MLP training step (mlp_step_small, per
// step). The source uses the public API only, so one build of it can time two builds of the library.
//
// Output: one line per figure, "BENCH {json}" like bench_ops.
//   BENCH {"name": "chain_fwd_norecord", "device": "cpu", "us_per_op": 0.51, "allocs_per_op": 3}
//
// Usage: bench_autograd [--cuda] [--steps N] [--numel N] [--reps N] [--trace-allocs] [--op NAME --calls N]
//   --op NAME: runs only that op case (op_add, op_sum, ...) N times, unrecorded, and prints nothing:
//   for an instruction count of the op's host path, `valgrind --tool=callgrind bench_autograd --op
//   op_add --calls 2000` (deterministic where wall time on a shared machine is not).
//   --trace-allocs: after the figures, lists the call stacks of the allocations made by one
//   recorded forward + backward of a short chain, most frequent first (where the cost comes from).
//
// Note [Allocation counter]
// Replacing operator new/delete counts every C++ heap allocation of the process (std::vector,
// make_shared, std::function, ...) without touching the library. malloc called directly is not
// counted; the library calls it only for tensor data, behind the block cache, whose misses are
// counted from flame::cpu::memory_stats(). The counter is one relaxed atomic increment, so the
// timed regions run with it on.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <cxxabi.h>
#include <execinfo.h>
#include <atomic>
#include <functional>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "flame/cpu.h"
#include "flame/flame.h"
#include "flame/nn/functional.h"

namespace {

std::atomic<uint64_t> g_news{0};
// --trace-allocs: while set, each allocation's call stack is recorded (outside the timed regions).
bool g_tracing = false;
struct Trace {
  void* frames[12];
  int n;
};
std::vector<Trace>* g_traces = nullptr;

void* counted_new(std::size_t n, std::size_t align) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (g_tracing && g_traces != nullptr) {
    g_tracing = false;  // the vector's own growth and backtrace() are not traced
    Trace t{};
    t.n = backtrace(t.frames, 12);
    g_traces->push_back(t);
    g_tracing = true;
  }
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align)
                                              : std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t n) { return counted_new(n, 0); }
void* operator new[](std::size_t n) { return counted_new(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_new(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_new(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_new(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_new(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

using flame::Device;
using flame::Tensor;

struct Args {
  bool cuda = false;
  bool trace = false;
  std::string op;  // --op NAME: only run that op case `calls` times, unrecorded, untimed
  int calls = 1000;
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

// Heap allocations (operator new calls plus CPU block-cache misses) made by one call of fn.
uint64_t heap_allocs() {
  const flame::cpu::MemoryStats s = flame::cpu::memory_stats();
  return g_news.load(std::memory_order_relaxed) + (s.num_allocs - s.num_cache_hits);
}

double allocs_per_call(const std::function<void()>& fn) {
  fn();  // warm: caches filled, lazily made state made
  const uint64_t before = heap_allocs();
  fn();
  return static_cast<double>(heap_allocs() - before);
}

void report(const Args& a, const char* name, double us_per_op, double allocs_per_op) {
  std::printf(
      "BENCH {\"name\": \"%s\", \"device\": \"%s\", \"numel\": %lld, \"ops\": %d, \"us_per_op\": %.4g, "
      "\"allocs_per_op\": %.3g}\n",
      name, a.cuda ? "cuda" : "cpu", static_cast<long long>(a.numel), 2 * a.steps, us_per_op, allocs_per_op);
}

// Prints the distinct call stacks of the allocations fn makes, most frequent first.
void trace_allocs(const std::function<void()>& fn) {
  fn();
  std::vector<Trace> traces;
  traces.reserve(1 << 16);
  g_traces = &traces;
  g_tracing = true;
  fn();
  g_tracing = false;
  g_traces = nullptr;
  std::map<std::vector<void*>, int> count;
  for (const Trace& t : traces) count[std::vector<void*>(t.frames + 2, t.frames + t.n)]++;
  std::vector<std::pair<int, std::vector<void*>>> order;
  for (auto& [k, v] : count) order.emplace_back(v, k);
  std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  for (const auto& [n, frames] : order) {
    std::printf("---- %d allocations\n", n);
    char** names = backtrace_symbols(frames.data(), static_cast<int>(frames.size()));
    for (std::size_t i = 0; i < frames.size() && i < 7; ++i) {
      std::string s = names[i];
      const auto l = s.find('('), r = s.find('+', l);
      if (l != std::string::npos && r != std::string::npos) {
        int st = 0;
        char* d = abi::__cxa_demangle(s.substr(l + 1, r - l - 1).c_str(), nullptr, nullptr, &st);
        if (st == 0 && d) s = d;
        std::free(d);
      }
      std::printf("    %s\n", s.substr(0, 160).c_str());
    }
    std::free(names);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cuda")) a.cuda = true;
    else if (!std::strcmp(argv[i], "--trace-allocs")) a.trace = true;
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) a.steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--numel") && i + 1 < argc) a.numel = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) a.reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--op") && i + 1 < argc) a.op = argv[++i];
    else if (!std::strcmp(argv[i], "--calls") && i + 1 < argc) a.calls = std::atoi(argv[++i]);
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
  const auto run_fwd = [&] { (void)chain(c, d); };
  Tensor cg = c.detach().requires_grad_(true), dg = d.detach().requires_grad_(true);
  const auto run_rec = [&] { (void)chain(cg, dg); };
  const auto run_bwd = [&] {
    flame::BackwardOptions o;
    o.grad_output = flame::Tensor::ones({a.numel}, dev);
    flame::Gradients g = chain(cg, dg).backward(o);
    (void)g;
  };
  if (!a.op.empty()) a.reps = 0;  // --op: the op case alone (below)
  const double fwd = a.op.empty() ? median_us(a, run_fwd) : 0.0;
  if (a.op.empty()) {
    const double fwd_rec = median_us(a, run_rec);
    const double fwd_bwd = median_us(a, run_bwd);
    const double n_fwd = allocs_per_call(run_fwd), n_rec = allocs_per_call(run_rec), n_bwd = allocs_per_call(run_bwd);
    report(a, "chain_fwd_norecord", fwd / ops, n_fwd / ops);
    report(a, "chain_fwd_record", fwd_rec / ops, n_rec / ops);
    report(a, "chain_fwd_bwd", fwd_bwd / ops, n_bwd / ops);
    report(a, "chain_bwd_share", (fwd_bwd - fwd_rec) / ops, (n_bwd - n_rec) / ops);
  }
  // Per op: the host cost of one call of each op family on small tensors (the op layer's own work:
  // checks, dispatch, allocation, recording), unrecorded and, where it has a gradient, recorded;
  // and a small MLP training step (forward, MSE, backward, SGD).
  {
    namespace F = flame::nn::functional;
    const Tensor m = Tensor::randn({8, 16}, 0.0, 1.0, dev, &gen), mg = m.detach().requires_grad_(true);
    const Tensor w = Tensor::randn({16, 16}, 0.0, 0.1, dev, &gen);
    const Tensor img = Tensor::randn({1, 4, 8, 8}, 0.0, 1.0, dev, &gen), img_g = img.detach().requires_grad_(true);
    const Tensor k = Tensor::randn({4, 4, 3, 3}, 0.0, 0.1, dev, &gen);
    const Tensor q = Tensor::randn({1, 2, 8, 16}, 0.0, 1.0, dev, &gen), qg = q.detach().requires_grad_(true);
    const Tensor idx = Tensor::arange(4, dev), mask = m.gt(Tensor::zeros({}, dev));
    const Tensor lnw = Tensor::ones({16}, dev), lnb = Tensor::zeros({16}, dev);
    const flame::TensorList parts = {m, m};
    struct OpCase {
      const char* name;
      std::function<void()> plain, recorded;
    };
    const std::vector<OpCase> cases = {
        {"op_add", [&] { (void)(m + m); }, [&] { (void)(mg + m); }},
        {"op_relu", [&] { (void)m.relu(); }, [&] { (void)mg.relu(); }},
        {"op_mul_scalar", [&] { (void)(m * 2.0); }, [&] { (void)(mg * 2.0); }},
        {"op_where", [&] { (void)flame::where(mask, m, m); }, [&] { (void)flame::where(mask, mg, m); }},
        {"op_sum", [&] { (void)m.sum(flame::Shape{1}); }, [&] { (void)mg.sum(flame::Shape{1}); }},
        {"op_amax", [&] { (void)flame::amax(m, {1}, false); }, [&] { (void)flame::amax(mg, {1}, false); }},
        {"op_softmax", [&] { (void)flame::softmax(m, -1); }, [&] { (void)flame::softmax(mg, -1); }},
        {"op_matmul", [&] { (void)m.matmul(w); }, [&] { (void)mg.matmul(w); }},
        {"op_cat", [&] { (void)flame::cat(parts, 0); }, [&] { (void)flame::cat({mg, m}, 0); }},
        {"op_pad", [&] { (void)flame::pad(m, {1, 1}); }, [&] { (void)flame::pad(mg, {1, 1}); }},
        {"op_transpose", [&] { (void)m.transpose(0, 1); }, [&] { (void)mg.transpose(0, 1); }},
        {"op_index_select", [&] { (void)flame::index_select(m, 0, idx); }, [&] { (void)flame::index_select(mg, 0, idx); }},
        {"op_layer_norm", [&] { (void)F::layer_norm(m, {16}, lnw, lnb); }, [&] { (void)F::layer_norm(mg, {16}, lnw, lnb); }},
        {"op_conv2d", [&] { (void)F::conv2d(img, k, {}, {1}, {1}); }, [&] { (void)F::conv2d(img_g, k, {}, {1}, {1}); }},
        {"op_sdpa", [&] { (void)F::scaled_dot_product_attention(q, q, q); },
         [&] { (void)F::scaled_dot_product_attention(qg, q, q); }},
    };
    if (!a.op.empty()) {  // for an instruction count (valgrind --tool=callgrind): no timing, no output
      for (const OpCase& c : cases) {
        if (a.op != c.name) continue;
        for (int i = 0; i < a.calls; ++i) c.plain();
        return 0;
      }
      std::fprintf(stderr, "bench_autograd: no op case named %s\n", a.op.c_str());
      return 2;
    }
    Args one = a;
    for (const OpCase& c : cases) {
      auto many = [&](const std::function<void()>& f) {
        return [&f] {
          for (int i = 0; i < 100; ++i) f();
        };
      };
      const auto plain = many(c.plain), recorded = many(c.recorded);
      std::printf("BENCH {\"name\": \"%s\", \"device\": \"%s\", \"us_per_op\": %.4g, \"allocs_per_op\": %.3g, "
                  "\"recorded_us_per_op\": %.4g, \"recorded_allocs_per_op\": %.3g}\n",
                  c.name, a.cuda ? "cuda" : "cpu", median_us(one, plain) / 100, allocs_per_call(plain) / 100,
                  median_us(one, recorded) / 100, allocs_per_call(recorded) / 100);
    }
    // A 4-layer MLP (16 wide, batch 8): forward, MSE, backward, SGD on every weight and bias.
    std::vector<Tensor> ws, bs;
    for (int l = 0; l < 4; ++l) {
      ws.push_back(Tensor::randn({16, 16}, 0.0, 0.1, dev, &gen).requires_grad_(true));
      bs.push_back(Tensor::zeros({16}, dev).requires_grad_(true));
    }
    const Tensor target = Tensor::randn({8, 16}, 0.0, 1.0, dev, &gen);
    const auto step = [&] {
      Tensor h = m;
      for (int l = 0; l < 4; ++l) {
        h = F::linear(h, ws[l], bs[l]);
        if (l < 3) h = h.relu();
      }
      flame::Gradients g = flame::mse_loss(h, target).backward();
      flame::NoGradGuard no_grad;
      for (int l = 0; l < 4; ++l) {
        ws[l].add_(g.get(ws[l]), -1e-3);
        bs[l].add_(g.get(bs[l]), -1e-3);
      }
    };
    std::printf("BENCH {\"name\": \"mlp_step_small\", \"device\": \"%s\", \"us_per_op\": %.4g, "
                "\"allocs_per_op\": %.3g}\n",
                a.cuda ? "cuda" : "cpu", median_us(one, step), allocs_per_call(step));
  }
  if (a.trace) {
    const int steps = a.steps;
    a.steps = 4;
    std::printf("==== allocations of a recorded forward + backward of %d ops\n", 2 * a.steps);
    trace_allocs(run_bwd);
    a.steps = steps;
  }
  return 0;
}
