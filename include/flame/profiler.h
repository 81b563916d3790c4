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


// ---- GPU kernel trace (docs/profiling.md) ----
// Records every kernel, memcpy and memset the GPU runs between start() and stop() (any thread,
// any stream, FLAME's kernels and the libraries' alike: cuBLASLt, cuDNN, NCCL), with device-side
// start and end times, through NVIDIA's CUPTI activity API. It answers "where does the step's
// time go" without Nsight Systems:
//
//   flame::profiler::KernelTrace trace;
//   trace.start();
//   for (int i = 0; i < 5; ++i) step();
//   trace.stop();                         // waits for the GPU, then collects the records
//   std::cout << trace.summary(20);      // by kernel: calls, total ms, mean us, % of GPU time
//   trace.save_chrome_trace("trace.json");  // chrome://tracing or ui.perfetto.dev
//
// busy_ms() is the union of the GPU's activity intervals and span_ms() the first start to the last
// end: span - busy is time the GPU sat idle (host overhead, syncs). One trace records at a time per
// process. In a build without CUDA or CUPTI, start() raises flame::Error.
struct KernelRecord {
  enum class Kind { kernel, memcpy, memset };
  Kind kind = Kind::kernel;
  std::string name;        // the kernel's (demangled) name; "memcpy HtoD" / "memset" for the others
  uint64_t start_ns = 0;   // GPU timestamps (CUPTI's clock)
  uint64_t end_ns = 0;
  int device = 0;
  uint32_t stream = 0;     // CUPTI's stream id
  uint64_t bytes = 0;      // memcpy / memset only
  double ms() const { return double(end_ns - start_ns) * 1e-6; }
};

struct KernelSummaryRow {
  std::string name;
  int64_t calls = 0;
  double total_ms = 0;
  double percent = 0;  // of the summed durations of all records
};

class KernelTrace {
 public:
  KernelTrace();
  ~KernelTrace();  // stops a recording trace
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  void start();  // clears earlier records; error when another KernelTrace records
  void stop();   // synchronises every device used, flushes and collects; no-op when not recording
  bool recording() const;

  const std::vector<KernelRecord>& records() const;  // sorted by start time
  // Rows by name, largest total first. `group_by_prefix` > 0 cuts names at that many characters
  // (template-heavy names of one family then share a row).
  std::vector<KernelSummaryRow> by_name(std::size_t group_by_prefix = 0) const;
  double total_ms() const;  // summed durations (overlapping streams count twice)
  double busy_ms() const;   // union of the intervals
  double span_ms() const;   // first start to last end
  std::string summary(std::size_t top = 20, std::size_t name_width = 90) const;
  std::string chrome_trace_json() const;
  void save_chrome_trace(const std::string& path) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace flame::profiler
