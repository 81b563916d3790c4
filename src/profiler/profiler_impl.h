#pragma once
// The state of one MemoryProfiler (memory_profiler.cpp records, report.cpp renders).
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "flame/profiler.h"

namespace flame::profiler {

struct MemoryProfiler::Impl {
  struct Event {
    bool is_alloc;
    int device;  // -1: the CPU
    uint64_t address;
    std::size_t bytes;
    uint64_t stream;
    uint64_t thread;
    int64_t time_ns;
    const char* op;      // interned; never null
    const char* module;  // interned; null outside any module
    const char* node;    // backward node name; null in forward
    bool before;         // a free of a block allocated before start()
    std::size_t allocated_after;
  };
  struct DeviceState {
    std::size_t start = 0, current = 0, peak = 0;
    int64_t peak_event = -1;
    std::size_t alloc_total = 0, free_total = 0;
    int64_t num_allocs = 0, num_frees = 0;
  };

  mutable std::mutex mutex;  // guards everything below (taken after the session registry's lock)
  bool recording = false;
  std::chrono::steady_clock::time_point t0;
  std::vector<Event> events;
  std::map<int, DeviceState> devices;
  std::map<std::pair<int, uint64_t>, std::size_t> live;  // (device, address) -> its allocation event

  void add(Event e);

  // Groups of the blocks live after event `upto` (-1: before any event) on `device`, plus the
  // "before" group of bytes held since before start(); largest first.
  std::vector<MemoryGroup> groups_after(int device, int64_t upto, GroupBy by) const;
};

Device device_of(int device);
int device_code(Device d);

}  // namespace flame::profiler
