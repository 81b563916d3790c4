// Memory profiler (flame/profiler.h): the trace against the allocators' own counters, op and
// module attribution, peak attribution, JSON, the report, inactive cost and threads. Runs on the
// test device (FLAME_TEST_DEVICE=cuda: the GPU's stream-ordered pool).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "flame/cpu.h"
#include "flame/cuda.h"
#include "flame/nn.h"
#include "flame/profiler.h"
#include "test_util.h"

namespace flame {
namespace {

using profiler::MemoryEvent;
using profiler::MemoryGroup;
using profiler::MemoryProfiler;
using test::test_device;

struct Counters {
  std::size_t allocated = 0, peak = 0;
  uint64_t allocs = 0, frees = 0;
};

Counters counters(Device d) {
  if (d.is_cpu()) {
    const cpu::MemoryStats s = cpu::memory_stats();
    return {s.allocated_bytes, s.peak_allocated_bytes, s.num_allocs, s.num_frees};
  }
  const cuda::MemoryStats s = cuda::memory_stats(d.index);
  return {s.allocated_bytes, s.peak_allocated_bytes, s.num_allocs, s.num_frees};
}

void reset_peak(Device d) {
  if (d.is_cpu()) {
    cpu::reset_peak_memory_stats();
  } else {
    cuda::reset_peak_memory_stats(d.index);
  }
}

profiler::DeviceMemorySummary summary_of(const MemoryProfiler& p, Device d) {
  for (const auto& s : p.summary()) {
    if (s.device == d) return s;
  }
  ADD_FAILURE() << "no summary for " << d.str();
  return {};
}

std::shared_ptr<nn::Sequential> small_mlp(Device d) {
  auto m = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(24, 48), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(48, 8)});
  m->to(d);
  return m;
}

struct Replay {
  std::size_t alloc_bytes = 0, free_bytes = 0, peak = 0, end = 0;
  int64_t allocs = 0, frees = 0;
};

// An independent walk of the trace: the running total from `start`, its maximum, the sums.
Replay replay(const std::vector<MemoryEvent>& trace, Device d, std::size_t start) {
  Replay r;
  std::size_t cur = start;
  r.peak = start;
  for (const MemoryEvent& e : trace) {
    if (e.device != d) continue;
    if (e.is_alloc) {
      cur += e.bytes;
      r.alloc_bytes += e.bytes;
      ++r.allocs;
    } else {
      cur -= e.bytes;
      r.free_bytes += e.bytes;
      ++r.frees;
    }
    EXPECT_EQ(e.allocated_after, cur) << "event " << e.index;
    r.peak = std::max(r.peak, cur);
  }
  r.end = cur;
  return r;
}

bool has_alloc(const std::vector<MemoryEvent>& trace, Device d, const std::string& op, const std::string& module,
               bool backward) {
  for (const MemoryEvent& e : trace) {
    if (e.is_alloc && e.device == d && e.op == op && e.module == module && e.backward_node.empty() != backward) {
      return true;
    }
  }
  return false;
}

// A Linear's output: "matmul" + add, or "linear" where the bias is fused into the GEMM's epilogue
// (CUDA, aligned sizes: Note [Linear epilogues]).
bool has_linear_alloc(const std::vector<MemoryEvent>& trace, Device d, const std::string& module) {
  return has_alloc(trace, d, "matmul", module, false) || has_alloc(trace, d, "linear", module, false);
}

TEST(MemProfTest, MlpTraceMatchesTheAllocatorCounters) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto model = small_mlp(dev);
  Tensor x = Tensor::randn({64, 24}, TensorOptions(dev));
  Tensor target = Tensor::randn({64, 8}, TensorOptions(dev));
  reset_peak(dev);
  const Counters c0 = counters(dev);
  MemoryProfiler prof;
  prof.start();
  Gradients grads;
  {
    Tensor loss = ((*model)(x) - target).square().mean();
    grads = loss.backward();
  }
  prof.stop();
  const Counters c1 = counters(dev);
  const std::vector<MemoryEvent> trace = prof.trace();
  ASSERT_FALSE(trace.empty());

  // Totals and the peak, from the trace alone, equal the allocator's own statistics.
  const Replay r = replay(trace, dev, c0.allocated);
  EXPECT_EQ(r.end, c1.allocated);
  EXPECT_EQ(r.peak, c1.peak);
  EXPECT_GT(r.peak, c0.allocated);
  if (dev.is_cpu()) {
    EXPECT_EQ(static_cast<uint64_t>(r.allocs), c1.allocs - c0.allocs);
    EXPECT_EQ(static_cast<uint64_t>(r.frees), c1.frees - c0.frees);
  } else {
    // The CUDA pool also counts zero-byte allocations, which hold no memory and are not traced.
    EXPECT_LE(static_cast<uint64_t>(r.allocs), c1.allocs - c0.allocs);
    EXPECT_GT(r.allocs, 0);
  }
  // Allocations are on the thread's current stream (0 on the CPU).
  const uint64_t stream = dev.is_cuda() ? reinterpret_cast<uint64_t>(cuda::current_stream(dev.index)) : 0;
  for (const MemoryEvent& e : trace) {
    if (e.device == dev) EXPECT_EQ(e.stream, stream) << "event " << e.index;
  }
  const profiler::DeviceMemorySummary s = summary_of(prof, dev);
  EXPECT_EQ(s.start_bytes, c0.allocated);
  EXPECT_EQ(s.end_bytes, c1.allocated);
  EXPECT_EQ(s.peak_bytes, c1.peak);
  EXPECT_EQ(s.allocated_bytes_total, r.alloc_bytes);
  EXPECT_EQ(s.freed_bytes_total, r.free_bytes);
  ASSERT_GE(s.peak_event, 0);
  EXPECT_EQ(trace[static_cast<std::size_t>(s.peak_event)].allocated_after, s.peak_bytes);

  // Attribution: the two Linear layers' matmuls by their Sequential names, in both phases.
  EXPECT_TRUE(has_linear_alloc(trace, dev, "0"));
  EXPECT_TRUE(has_linear_alloc(trace, dev, "2"));
  bool backward_in_0 = false, backward_in_2 = false;
  for (const MemoryEvent& e : trace) {
    if (!e.is_alloc || e.device != dev || e.backward_node.empty()) continue;
    backward_in_0 |= e.module == "0";
    backward_in_2 |= e.module == "2";
  }
  EXPECT_TRUE(backward_in_0);
  EXPECT_TRUE(backward_in_2);

  // Peak attribution covers the peak exactly; the live snapshot covers what is held at stop.
  const std::vector<MemoryGroup> peak = prof.peak_groups(dev);
  std::size_t peak_sum = 0;
  double pct = 0;
  for (const MemoryGroup& g : peak) {
    peak_sum += g.bytes;
    pct += g.percent;
    EXPECT_GT(g.bytes, 0u);
  }
  EXPECT_EQ(peak_sum, s.peak_bytes);
  EXPECT_NEAR(pct, 100.0, 1e-6);
  for (std::size_t i = 1; i < peak.size(); ++i) EXPECT_GE(peak[i - 1].bytes, peak[i].bytes);
  // The coarser groupings partition the same bytes, one group per distinct op (module) of the
  // fine grouping.
  for (profiler::GroupBy by : {profiler::GroupBy::op, profiler::GroupBy::module}) {
    std::set<std::string> fine_keys, coarse_keys;
    for (const MemoryGroup& g : peak) {
      if (g.phase != "before") fine_keys.insert(by == profiler::GroupBy::op ? g.op : g.module);
    }
    std::size_t sum = 0;
    for (const MemoryGroup& g : prof.peak_groups(dev, by)) {
      sum += g.bytes;
      if (g.phase == "before") continue;
      EXPECT_EQ(g.phase, "*");
      EXPECT_EQ(by == profiler::GroupBy::op ? g.module : g.op, "*");
      coarse_keys.insert(by == profiler::GroupBy::op ? g.op : g.module);
    }
    EXPECT_EQ(sum, s.peak_bytes);
    EXPECT_EQ(fine_keys, coarse_keys);
  }
  const std::vector<MemoryGroup> live = prof.live_groups(dev);
  std::size_t live_sum = 0, live_backward = 0;
  for (const MemoryGroup& g : live) {
    live_sum += g.bytes;
    if (g.phase == "backward") live_backward += g.bytes;
  }
  EXPECT_EQ(live_sum, c1.allocated);
  // The gradients the store holds were made in backward (4 parameters).
  std::size_t grad_bytes = 0;
  for (const auto& e : grads.entries()) grad_bytes += e.grad.nbytes();
  EXPECT_EQ(grads.entries().size(), 4u);
  EXPECT_GE(live_backward, grad_bytes);
}

TEST(MemProfTest, NestedModulePaths) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto block = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(8, 16), std::make_shared<nn::SiLU>()});
  nn::Sequential model({std::make_shared<nn::Linear>(12, 8), block, std::make_shared<nn::Linear>(16, 4)});
  model.to(dev);
  Tensor x = Tensor::randn({5, 12}, TensorOptions(dev));
  MemoryProfiler prof;
  Tensor y;
  {
    profiler::MemoryProfileScope scope(prof);
    EXPECT_TRUE(prof.recording());
    y = model(x);
  }
  EXPECT_FALSE(prof.recording());
  const auto trace = prof.trace();
  EXPECT_TRUE(has_linear_alloc(trace, dev, "0"));
  EXPECT_TRUE(has_linear_alloc(trace, dev, "1.0"));
  EXPECT_TRUE(has_alloc(trace, dev, "silu", "1.1", false));
  EXPECT_TRUE(has_linear_alloc(trace, dev, "2"));
  // Outside any module call: no path.
  for (const MemoryEvent& e : trace) EXPECT_NE(e.module, "") << "event " << e.index << " op " << e.op;
}

// A model that iterates its ModuleList instead of calling it: paths still start at the root.
class Stack : public nn::Module {
 public:
  explicit Stack(Device d) {
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int i = 0; i < 3; ++i) {
      auto block = std::make_shared<nn::Sequential>();
      block->register_module("attn", std::make_shared<nn::Linear>(6, 6));
      blocks->push_back(block);
    }
    to(d);
  }
  std::string name() const override { return "Stack"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& b : *blocks) h = (*b)(h).tanh();
    return h;
  }
  std::shared_ptr<nn::ModuleList> blocks;
};

TEST(MemProfTest, ModulePathsFromTheRoot) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto net = std::make_shared<Stack>(dev);
  EXPECT_EQ(net->path(), "");
  EXPECT_EQ((*net->blocks)[2]->path(), "blocks.2");
  EXPECT_EQ((*net->blocks)[2]->child("attn")->path(), "blocks.2.attn");
  Tensor x = Tensor::randn({4, 6}, TensorOptions(dev));
  MemoryProfiler prof;
  prof.start();
  Tensor y = (*net)(x);
  prof.stop();
  const auto trace = prof.trace();
  for (int i = 0; i < 3; ++i) {
    const std::string b = "blocks." + std::to_string(i);
    EXPECT_TRUE(has_alloc(trace, dev, "matmul", b + ".attn", false)) << b;
    EXPECT_TRUE(has_alloc(trace, dev, "tanh", "", false));  // the root's own op: no path
  }
  // A child outliving its parent forgets it.
  nn::ModulePtr attn = (*net->blocks)[1]->child("attn");
  net.reset();
  EXPECT_EQ(attn->path(), "");
}

// A block whose forward takes two inputs is called directly, not through operator(): a
// Module::CallScope gives its allocations its path, and its children's calls nest under it.
class TwoInputBlock : public nn::Module {
 public:
  TwoInputBlock() { proj = register_module("proj", std::make_shared<nn::Linear>(6, 6)); }
  std::string name() const override { return "TwoInputBlock"; }
  Tensor forward(const Tensor& x, const Tensor& c) {
    const CallScope scope(*this);
    return (*proj)(x) + c.sigmoid();
  }
  std::shared_ptr<nn::Linear> proj;
};

TEST(MemProfTest, CallScopeAttributesDirectCalls) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  nn::ModuleList blocks;
  auto block = std::make_shared<TwoInputBlock>();
  blocks.push_back(std::make_shared<nn::Linear>(6, 6));
  blocks.push_back(block);
  blocks.to(dev);
  const Tensor x = Tensor::randn({4, 6}, TensorOptions(dev)), c = Tensor::randn({4, 6}, TensorOptions(dev));
  MemoryProfiler prof;
  prof.start();
  const Tensor y = block->forward(x, c);
  const Tensor outside = c.sigmoid();
  prof.stop();
  const auto trace = prof.trace();
  EXPECT_TRUE(has_alloc(trace, dev, "sigmoid", "1", false));
  EXPECT_TRUE(has_alloc(trace, dev, "add", "1", false));
  EXPECT_TRUE(has_linear_alloc(trace, dev, "1.proj"));
  EXPECT_TRUE(has_alloc(trace, dev, "sigmoid", "", false));  // after the scope: no path
  // Not recording: the scope pushes nothing (the thread's path stays empty).
  const Tensor again = block->forward(x, c);
  prof.start();
  const Tensor later = c.sigmoid();
  prof.stop();
  EXPECT_TRUE(has_alloc(prof.trace(), dev, "sigmoid", "", false));
  EXPECT_FALSE(has_alloc(prof.trace(), dev, "sigmoid", "1", false));
}

TEST(MemProfTest, RecordsNothingWhenInactive) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  MemoryProfiler prof;
  Tensor a = Tensor::randn({32, 32}, TensorOptions(dev));
  EXPECT_FALSE(prof.recording());
  EXPECT_TRUE(prof.trace().empty());
  prof.start();
  Tensor b = a.matmul(a);
  prof.stop();
  const std::size_t n = prof.trace().size();
  EXPECT_GE(n, 1u);
  Tensor c = b.matmul(a) + 1.0;  // after stop: not traced
  b = Tensor();
  EXPECT_EQ(prof.trace().size(), n);
  EXPECT_THROW(
      {
        MemoryProfiler twice;
        twice.start();
        twice.start();
      },
      Error);
  // A restart clears the trace.
  prof.start();
  prof.stop();
  EXPECT_TRUE(prof.trace().empty());
}

TEST(MemProfTest, TwoSessionsSeeTheSameEvents) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor a = Tensor::randn({16, 20}, TensorOptions(dev));
  MemoryProfiler p1, p2;
  p1.start();
  Tensor b = a.exp();
  p2.start();
  Tensor c = b.matmul(a.t());
  p2.stop();
  Tensor d = c.sum();
  p1.stop();
  EXPECT_TRUE(has_alloc(p1.trace(), dev, "exp", "", false));
  EXPECT_TRUE(has_alloc(p1.trace(), dev, "matmul", "", false));
  EXPECT_TRUE(has_alloc(p2.trace(), dev, "matmul", "", false));
  EXPECT_FALSE(has_alloc(p2.trace(), dev, "exp", "", false));
  EXPECT_LT(p2.trace().size(), p1.trace().size());
}

// Ops run through invoke (Note [Invoke]) own every allocation they make, their output and a layout
// copy of a non-contiguous input alike: each event names the op, none the generic "empty" or
// "contiguous".
TEST(MemProfTest, InvokedOpsOwnTheirAllocations) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = Tensor::randn({2, 3, 8, 8}, TensorOptions(dev)), w = Tensor::randn({4, 3, 3, 3}, TensorOptions(dev));
  const Tensor xt = x.transpose(2, 3);  // neither contiguous nor channels-last: conv copies it
  MemoryProfiler prof;
  prof.start();
  Tensor y = nn::functional::conv2d(xt, w, {}, {1}, {1});
  Tensor z = nn::functional::max_pool2d(y, 2);
  Tensor u = nn::functional::interpolate(z, nn::functional::InterpolateOptions().with_scale(2.0));
  prof.stop();
  int conv = 0;
  for (const MemoryEvent& e : prof.trace()) {
    if (!e.is_alloc) continue;
    EXPECT_TRUE(e.op == "conv2d" || e.op == "max_pool2d" || e.op == "interpolate") << "an allocation of " << e.op;
    conv += e.op == "conv2d" ? 1 : 0;
  }
  EXPECT_GE(conv, 2) << "conv2d's output and its copy of the input";
  EXPECT_TRUE(has_alloc(prof.trace(), dev, "max_pool2d", "", false));
  EXPECT_TRUE(has_alloc(prof.trace(), dev, "interpolate", "", false));
}

TEST(MemProfTest, TwoThreadsAllocating) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  MemoryProfiler prof;
  const Counters c0 = counters(dev);
  prof.start();
  auto work = [dev](uint64_t seed) {
    Generator gen(seed);
    for (int i = 0; i < 40; ++i) {
      Tensor a = Tensor::randn({17 + i % 5, 9}, 0.0, 1.0, TensorOptions(dev), &gen);
      Tensor b = (a * 2.0).exp().sum({0});
      (void)b;
    }
    if (dev.is_cuda()) cuda::synchronize(dev.index);
  };
  std::thread t1(work, 1), t2(work, 2);
  t1.join();
  t2.join();
  prof.stop();
  const Counters c1 = counters(dev);
  const auto trace = prof.trace();
  std::set<uint64_t> threads;
  std::map<uint64_t, int> open;  // address -> live allocations of it
  std::size_t alloc = 0, freed = 0;
  for (const MemoryEvent& e : trace) {
    if (e.device != dev) continue;
    threads.insert(e.thread);
    if (e.is_alloc) {
      alloc += e.bytes;
      EXPECT_EQ(open[e.address]++, 0) << "address allocated twice without a free, event " << e.index;
    } else {
      freed += e.bytes;
      if (e.op != "(before start)") {
        EXPECT_EQ(open[e.address]--, 1) << "free without an allocation, event " << e.index;
      }
    }
  }
  EXPECT_GE(threads.size(), 2u);
  EXPECT_EQ(c0.allocated + alloc - freed, c1.allocated);
  EXPECT_EQ(summary_of(prof, dev).end_bytes, c1.allocated);
  if (dev.is_cpu()) {
    int64_t n = 0;
    for (const MemoryEvent& e : trace) n += e.is_alloc && e.device == dev;
    EXPECT_EQ(static_cast<uint64_t>(n), c1.allocs - c0.allocs);
  }
}

TEST(MemProfTest, CudaSideStreamAllocations) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  Tensor a = Tensor::randn({64, 64}, TensorOptions(dev));
  cuda::Stream side = cuda::Stream::create(0);
  side.wait(cuda::Stream::current(0));
  const Counters c0 = counters(dev);
  MemoryProfiler prof;
  prof.start();
  {
    cuda::StreamGuard guard(side);
    Tensor b = a.matmul(a).relu();
    side.synchronize();
  }
  prof.stop();
  const Counters c1 = counters(dev);
  const auto trace = prof.trace();
  const uint64_t side_handle = reinterpret_cast<uint64_t>(side.handle());
  bool matmul_on_side = false;
  std::size_t net = 0;
  for (const MemoryEvent& e : trace) {
    if (e.device != dev) continue;
    if (e.is_alloc) {
      EXPECT_EQ(e.stream, side_handle) << "event " << e.index << " op " << e.op;
      matmul_on_side |= e.op == "matmul";
      net += e.bytes;
    } else {
      net -= e.bytes;
    }
  }
  EXPECT_TRUE(matmul_on_side);
  EXPECT_EQ(c0.allocated + net, c1.allocated);
}

TEST(MemProfTest, JsonHasTheFields) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto model = small_mlp(dev);
  Tensor x = Tensor::randn({10, 24}, TensorOptions(dev));
  MemoryProfiler prof;
  prof.start();
  Gradients g = (*model)(x).sum().backward();
  prof.stop();
  const nlohmann::json j = nlohmann::json::parse(prof.json());
  for (const char* key : {"summary", "peak", "live", "timeline", "trace"}) ASSERT_TRUE(j.contains(key)) << key;
  const auto trace = prof.trace();
  ASSERT_EQ(j["trace"].size(), trace.size());
  const auto& first = j["trace"][0];
  for (const char* key : {"index", "action", "address", "bytes", "device", "stream", "thread", "time_us", "op",
                          "module", "backward_node", "allocated_after"}) {
    EXPECT_TRUE(first.contains(key)) << key;
  }
  EXPECT_EQ(first["bytes"].get<std::size_t>(), trace[0].bytes);
  EXPECT_EQ(first["op"].get<std::string>(), trace[0].op);
  const std::string dname = dev.str();
  const profiler::DeviceMemorySummary s = summary_of(prof, dev);
  ASSERT_TRUE(j["timeline"].contains(dname));
  const auto& tl = j["timeline"][dname]["allocated_bytes"];
  ASSERT_FALSE(tl.empty());
  EXPECT_EQ(tl.back().get<std::size_t>(), s.end_bytes);
  std::size_t tl_max = 0;
  for (const auto& v : tl) tl_max = std::max(tl_max, v.get<std::size_t>());
  EXPECT_EQ(tl_max, s.peak_bytes);
  EXPECT_EQ(j["peak"][dname]["bytes"].get<std::size_t>(), s.peak_bytes);
  std::size_t sum = 0;
  for (const auto& grp : j["peak"][dname]["groups"]) {
    for (const char* key : {"phase", "op", "module", "bytes", "count", "percent"}) EXPECT_TRUE(grp.contains(key));
    sum += grp["bytes"].get<std::size_t>();
  }
  EXPECT_EQ(sum, s.peak_bytes);
  bool found = false;
  for (const auto& sm : j["summary"]) found |= sm["device"] == dname && sm["peak_bytes"] == s.peak_bytes;
  EXPECT_TRUE(found);

  // save_json writes the same document; without the trace it keeps the timeline.
  const std::string path = test::unique_temp_path("memprof", ".json");
  prof.save_json(path, /*with_trace=*/false);
  std::ifstream f(path);
  const nlohmann::json k = nlohmann::json::parse(f);
  EXPECT_FALSE(k.contains("trace"));
  EXPECT_EQ(k["timeline"][dname]["allocated_bytes"].size(), tl.size());
  std::remove(path.c_str());
  EXPECT_THROW(prof.save_json("/nonexistent-dir/x.json"), Error);
}

TEST(MemProfTest, ReportNamesWhereThePeakWent) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto model = small_mlp(dev);
  Tensor x = Tensor::randn({300, 24}, TensorOptions(dev));  // the activations dominate the peak
  MemoryProfiler prof;
  prof.start();
  Gradients g = (*model)(x).square().sum().backward();
  prof.stop();
  const std::string text = prof.report(5);
  for (const char* part : {"Where the peak went", "matmul", "%", "forward", "Live at stop"}) {
    EXPECT_NE(text.find(part), std::string::npos) << "missing '" << part << "' in:\n" << text;
  }
  EXPECT_NE(text.find(dev.str() + ": peak"), std::string::npos) << text;
  // The top group at the peak is named first in its table.
  const auto peak = prof.peak_groups(dev);
  ASSERT_FALSE(peak.empty());
  const std::size_t table = text.find("Where the peak went", text.find(dev.str() + ": peak"));
  EXPECT_NE(text.find(peak[0].op, table), std::string::npos);
}

}  // namespace
}  // namespace flame
