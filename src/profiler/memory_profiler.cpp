// The memory profiler's recording side: allocator hooks, the per-thread attribution context and
// the session registry. Rendering (groups, JSON, table): report.cpp.
//
// Note [Allocation context]
// An allocation is attributed from thread-local state set by the code above the allocator:
//  - op: make_empty (src/core/tensor.cpp) names the op it allocates an output for; every op's
//    output goes through it. The name stays set after the allocation, so scratch memory a kernel
//    takes from the pool right after (cuBLAS/cuDNN workspaces, sort buffers) is charged to it too.
//  - module: nn::Module::operator() pushes the module's path from its root ("blocks.3.attn",
//    Module::path(): the names it was registered under, up its parents), so the name is right
//    even when a container is iterated instead of called. A direct forward() call pushes nothing.
//  - backward: the engine names the node whose rule runs, and the module path that node was
//    recorded in (Node::module_path, stamped by record() while a session records), so gradient
//    memory is charged to the layer it belongs to.
// Everything is behind one relaxed load of g_recording: with no session the hooks return at once,
// and the thread-local state is only touched while one records.
//
// Note [Profiler accounting]
// Each hook reports the bytes its allocator adds to or removes from allocated_bytes (CPU: the
// rounded block with its header; CUDA: the requested size), after the allocator counted them. A
// session starts from each device's allocated_bytes and follows every event, so with one thread
// allocating its running total, its peak and its totals equal the allocator's own statistics.
// Events of several threads are serialised by the registry lock in the order the hooks ran,
// which may differ from the order the allocator counted them: totals still agree, the running
// value may lag the allocator's by the allocations in flight.
#include <algorithm>
#include <atomic>
#include <tuple>
#include <unordered_set>

#include "flame/cpu.h"
#include "flame/cuda.h"
#include "flame/error.h"
#include "src/core/profiler_context.h"
#include "src/profiler/profiler_impl.h"

namespace flame::profiler_detail {

std::atomic<int> g_recording{0};

ThreadContext& thread_context() {
  thread_local ThreadContext ctx;
  return ctx;
}

namespace {

// Interned strings live as long as the process (never destroyed: frees during static destruction
// may still look names up).
struct Interner {
  std::mutex mutex;
  std::unordered_set<std::string> strings;
  const char* intern(const std::string& s) {
    std::lock_guard<std::mutex> lock(mutex);
    return strings.insert(s).first->c_str();
  }
};
Interner& interner() {
  static Interner* i = new Interner();
  return *i;
}

struct Registry {
  std::mutex mutex;
  std::vector<profiler::MemoryProfiler::Impl*> sessions;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

uint64_t thread_number() {
  static std::atomic<uint64_t> next{1};
  thread_local uint64_t id = next.fetch_add(1, std::memory_order_relaxed);
  return id;
}

void on_event(bool is_alloc, const void* ptr, std::size_t bytes, int device, const void* stream) noexcept {
  if (!recording()) return;
  try {
    ThreadContext& ctx = thread_context();
    profiler::MemoryProfiler::Impl::Event e{};
    e.is_alloc = is_alloc;
    e.device = device;
    e.address = reinterpret_cast<uint64_t>(ptr);
    e.bytes = bytes;
    e.stream = reinterpret_cast<uint64_t>(stream);
    e.thread = thread_number();
    if (is_alloc) {
      // A free takes its attribution from its allocation (Impl::add).
      e.op = interner().intern(ctx.op ? ctx.op : "(unknown)");
      e.node = ctx.backward_node;
      e.module = ctx.backward_node ? ctx.node_module : current_module_path();
    }
    const auto now = std::chrono::steady_clock::now();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (profiler::MemoryProfiler::Impl* s : r.sessions) {
      e.time_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - s->t0).count();
      s->add(e);
    }
  } catch (...) {
    // Out of host memory for the trace: the event is lost, the allocation itself stands.
  }
}

}  // namespace

const char* current_module_path() {
  const ThreadContext& ctx = thread_context();
  if (ctx.depth == 0) return nullptr;
  return ctx.modules[std::min(ctx.depth, ThreadContext::kMaxDepth) - 1];
}

const char* intern(const std::string& s) { return interner().intern(s); }

void on_alloc(const void* ptr, std::size_t bytes, int device, const void* stream) noexcept {
  on_event(true, ptr, bytes, device, stream);
}

void on_free(const void* ptr, std::size_t bytes, int device, const void* stream) noexcept {
  on_event(false, ptr, bytes, device, stream);
}

}  // namespace flame::profiler_detail

namespace flame::profiler {

using profiler_detail::registry;

Device device_of(int device) { return device < 0 ? Device::cpu() : Device::cuda(device); }
int device_code(Device d) { return d.is_cpu() ? -1 : d.index; }

void MemoryProfiler::Impl::add(Event e) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!recording) return;
  DeviceState& d = devices[e.device];  // a device first seen now started from 0 (no baseline read)
  const auto key = std::make_pair(e.device, e.address);
  if (e.is_alloc) {
    d.current += e.bytes;
    d.alloc_total += e.bytes;
    ++d.num_allocs;
    live[key] = events.size();
  } else {
    auto it = live.find(key);
    if (it != live.end()) {
      const Event& a = events[it->second];
      e.op = a.op;
      e.module = a.module;
      e.node = a.node;
      live.erase(it);
    } else {
      e.op = "(before start)";
      e.before = true;
    }
    d.current = d.current >= e.bytes ? d.current - e.bytes : 0;
    d.free_total += e.bytes;
    ++d.num_frees;
  }
  e.allocated_after = d.current;
  if (d.current > d.peak) {
    d.peak = d.current;
    d.peak_event = static_cast<int64_t>(events.size());
  }
  events.push_back(e);
}

std::vector<MemoryGroup> MemoryProfiler::Impl::groups_after(int device, int64_t upto, GroupBy by) const {
  auto dit = devices.find(device);
  if (dit == devices.end()) return {};
  std::map<uint64_t, std::size_t> held;  // address -> allocation event
  std::size_t total = dit->second.start;  // the device's allocated bytes after event `upto`
  for (int64_t i = 0; i <= upto && i < static_cast<int64_t>(events.size()); ++i) {
    const Event& e = events[static_cast<std::size_t>(i)];
    if (e.device != device) continue;
    total = e.allocated_after;
    if (e.is_alloc) {
      held[e.address] = static_cast<std::size_t>(i);
    } else {
      held.erase(e.address);
    }
  }
  struct Key {
    std::string phase, op, module;
    bool operator<(const Key& o) const { return std::tie(phase, op, module) < std::tie(o.phase, o.op, o.module); }
  };
  std::map<Key, MemoryGroup> groups;
  std::size_t attributed = 0;
  for (const auto& [addr, idx] : held) {
    const Event& a = events[idx];
    const char* phase = by != GroupBy::op_and_module ? "*" : (a.node ? "backward" : "forward");
    const char* op = by == GroupBy::module ? "*" : a.op;
    const char* module = by == GroupBy::op ? "*" : (a.module ? a.module : "");
    const Key k{phase, op, module};
    MemoryGroup& g = groups[k];
    g.bytes += a.bytes;
    ++g.count;
    attributed += a.bytes;
  }
  std::vector<MemoryGroup> out;
  for (auto& [k, g] : groups) {
    g.device = device_of(device);
    g.phase = k.phase;
    g.op = k.op;
    g.module = k.module;
    out.push_back(std::move(g));
  }
  if (total > attributed) {  // still held from before start()
    MemoryGroup g;
    g.device = device_of(device);
    g.phase = "before";
    g.op = by == GroupBy::module ? "*" : "(before start)";
    g.module = by == GroupBy::op ? "*" : "";
    g.bytes = total - attributed;
    out.push_back(std::move(g));
  }
  for (MemoryGroup& g : out) g.percent = total > 0 ? 100.0 * static_cast<double>(g.bytes) / static_cast<double>(total) : 0;
  std::stable_sort(out.begin(), out.end(), [](const MemoryGroup& a, const MemoryGroup& b) { return a.bytes > b.bytes; });
  return out;
}

MemoryProfiler::MemoryProfiler() : impl_(std::make_shared<Impl>()) {}

MemoryProfiler::~MemoryProfiler() { stop(); }

void MemoryProfiler::start() {
  FLAME_CHECK(!recording(), "MemoryProfiler::start", "the profiler is already recording");
  // Baselines: what each allocator holds now (Note [Profiler accounting]). Read before taking the
  // registry lock: the first stats call on a device may initialise its backend, whose
  // allocations would otherwise wait on that lock in another session's hook.
  std::map<int, std::size_t> baseline;
  baseline[-1] = flame::cpu::memory_stats().allocated_bytes;
  if (cuda_is_available()) {
    for (int d = 0; d < cuda_device_count(); ++d) baseline[d] = flame::cuda::memory_stats(d).allocated_bytes;
  }
  auto& r = registry();
  std::lock_guard<std::mutex> reg_lock(r.mutex);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  FLAME_CHECK(!impl_->recording, "MemoryProfiler::start", "the profiler is already recording");
  impl_->events.clear();
  impl_->live.clear();
  impl_->devices.clear();
  for (const auto& [d, bytes] : baseline) {
    Impl::DeviceState& s = impl_->devices[d];
    s.start = s.current = s.peak = bytes;
  }
  impl_->t0 = std::chrono::steady_clock::now();
  impl_->recording = true;
  r.sessions.push_back(impl_.get());
  profiler_detail::g_recording.fetch_add(1, std::memory_order_relaxed);
}

void MemoryProfiler::stop() {
  auto& r = registry();
  std::lock_guard<std::mutex> reg_lock(r.mutex);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (!impl_->recording) return;
  impl_->recording = false;
  r.sessions.erase(std::remove(r.sessions.begin(), r.sessions.end(), impl_.get()), r.sessions.end());
  profiler_detail::g_recording.fetch_sub(1, std::memory_order_relaxed);
}

bool MemoryProfiler::recording() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->recording;
}

std::vector<MemoryEvent> MemoryProfiler::trace() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<MemoryEvent> out;
  out.reserve(impl_->events.size());
  for (std::size_t i = 0; i < impl_->events.size(); ++i) {
    const Impl::Event& e = impl_->events[i];
    MemoryEvent m;
    m.index = i;
    m.is_alloc = e.is_alloc;
    m.address = e.address;
    m.bytes = e.bytes;
    m.device = device_of(e.device);
    m.stream = e.stream;
    m.thread = e.thread;
    m.time_us = static_cast<double>(e.time_ns) / 1e3;
    m.op = e.op ? e.op : "";
    m.module = e.module ? e.module : "";
    m.backward_node = e.node ? e.node : "";
    m.allocated_after = e.allocated_after;
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<DeviceMemorySummary> MemoryProfiler::summary() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<DeviceMemorySummary> out;
  for (const auto& [dev, s] : impl_->devices) {
    DeviceMemorySummary m;
    m.device = device_of(dev);
    m.start_bytes = s.start;
    m.end_bytes = s.current;
    m.peak_bytes = s.peak;
    m.peak_event = s.peak_event;
    m.allocated_bytes_total = s.alloc_total;
    m.freed_bytes_total = s.free_total;
    m.num_allocs = s.num_allocs;
    m.num_frees = s.num_frees;
    out.push_back(m);
  }
  return out;
}

std::vector<MemoryGroup> MemoryProfiler::live_groups(Device device, GroupBy by) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->groups_after(device_code(device), static_cast<int64_t>(impl_->events.size()) - 1, by);
}

std::vector<MemoryGroup> MemoryProfiler::peak_groups(Device device, GroupBy by) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->devices.find(device_code(device));
  if (it == impl_->devices.end()) return {};
  return impl_->groups_after(device_code(device), it->second.peak_event, by);
}

}  // namespace flame::profiler
