#pragma once
// Memory profiler: which op and module allocated what, and where the peak went.
// See docs/profiling.md.
//
//   flame::profiler::MemoryProfiler prof;
//   prof.start();
//   Tensor loss = model(x).mean();
//   Gradients g = loss.backward();
//   prof.stop();
//   std::cout << prof.report();             // "where the peak went", per device
//   prof.save_json("memory.json");          // trace, timeline, peak and live groups
//
// While a profiler records, every allocation and free of the CPU allocator and of the CUDA
// stream-ordered pools (any thread) is traced with its bytes (as the allocator counts them in
// memory_stats().allocated_bytes), device, stream, thread, the op that allocated it (the op name
// an output was made for; scratch memory a kernel takes after its output is charged to that op),
// the module path it ran in ("blocks.3.attn": modules called through nn::Module::operator()) and,
// in backward, the autograd node whose rule ran (phase "backward", module = where that node's
// forward ran). With no profiler recording, the allocator hooks cost one relaxed atomic load.
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "flame/device.h"

namespace flame::profiler {

// One allocation or free of the trace.
struct MemoryEvent {
  uint64_t index = 0;        // position in the trace (all devices)
  bool is_alloc = true;      // false: a free
  uint64_t address = 0;      // the block's address (pairs an allocation with its free)
  std::size_t bytes = 0;     // as counted by the allocator (CPU: the rounded block)
  Device device;
  uint64_t stream = 0;       // the cudaStream_t as a number; 0 on the CPU
  uint64_t thread = 0;       // small per-process thread number (1, 2, ...)
  double time_us = 0;        // since start()
  // Attribution of the allocation (a free repeats the attribution of its block; a block
  // allocated before start() has op "(before start)").
  std::string op;             // "matmul", "add", ...; "(unknown)" when no op was named
  std::string module;         // "0", "blocks.3.attn"; empty outside any module
  std::string backward_node;  // "MmBackward" when allocated by that node's rule; empty in forward
  std::size_t allocated_after = 0;  // the device's allocated bytes after the event (timeline)
};

// How blocks are grouped: by (phase, op, module), by op alone or by module alone (the fields
// not grouped by read "*").
enum class GroupBy { op_and_module, op, module };

// Bytes held by the blocks of one group.
struct MemoryGroup {
  Device device;
  std::string phase;   // "forward", "backward" or "before" (held since before start())
  std::string op;
  std::string module;
  std::size_t bytes = 0;
  int64_t count = 0;   // blocks
  double percent = 0;  // of the device's total at that moment
};

// Per-device summary.
struct DeviceMemorySummary {
  Device device;
  std::size_t start_bytes = 0;  // allocated when start() ran
  std::size_t end_bytes = 0;    // allocated at stop() (or now, while recording)
  std::size_t peak_bytes = 0;   // the most allocated at any event of the session (>= start_bytes)
  int64_t peak_event = -1;      // index of the event that reached it (-1: none, peak = start)
  std::size_t allocated_bytes_total = 0;  // sum over the session's allocations
  std::size_t freed_bytes_total = 0;      // sum over its frees
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
};

class MemoryProfiler {
 public:
  MemoryProfiler();
  ~MemoryProfiler();  // stops a recording profiler
  MemoryProfiler(const MemoryProfiler&) = delete;
  MemoryProfiler& operator=(const MemoryProfiler&) = delete;

  // Starts recording (clearing an earlier trace); reads each device's allocated bytes as the
  // baseline. Error when already recording.
  void start();
  void stop();  // no-op when not recording
  bool recording() const;

  std::vector<MemoryEvent> trace() const;  // (a) every allocation and free, in order
  std::vector<DeviceMemorySummary> summary() const;  // one per device seen (the CPU always)
  // (b) blocks allocated during the session and still live at stop() (or now), grouped, largest
  // first; blocks held since before start() form one "before" group.
  std::vector<MemoryGroup> live_groups(Device device, GroupBy by = GroupBy::op_and_module) const;
  // (c) the same at the moment of the device's peak.
  std::vector<MemoryGroup> peak_groups(Device device, GroupBy by = GroupBy::op_and_module) const;

  // (d) JSON: {"summary": [...], "peak": {...}, "live": {...}, "trace": [...], "timeline": {...}}
  // (docs/profiling.md lists the fields); the timeline gives the allocated bytes after each event.
  std::string json(bool with_trace = true) const;
  void save_json(const std::string& path, bool with_trace = true) const;
  // The readable table: per device, the peak and the top groups holding it ("where the peak
  // went") by op and module, by module and by op, then what is still live.
  std::string report(std::size_t top = 10) const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// RAII: records for its lifetime.
class MemoryProfileScope {
 public:
  explicit MemoryProfileScope(MemoryProfiler& p) : p_(p) { p_.start(); }
  ~MemoryProfileScope() { p_.stop(); }
  MemoryProfileScope(const MemoryProfileScope&) = delete;
  MemoryProfileScope& operator=(const MemoryProfileScope&) = delete;

 private:
  MemoryProfiler& p_;
};

}  // namespace flame::profiler
