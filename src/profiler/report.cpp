// The memory profiler's outputs: JSON (trace, timeline, peak and live groups) and the readable
// "where the peak went" table.
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "flame/error.h"
#include "src/profiler/profiler_impl.h"

namespace flame::profiler {

namespace {

nlohmann::json group_json(const MemoryGroup& g) {
  return {{"phase", g.phase}, {"op", g.op},       {"module", g.module},
          {"bytes", g.bytes}, {"count", g.count}, {"percent", g.percent}};
}

// 1536 -> "1.50 KiB"
std::string human(std::size_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%zu B", bytes);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, units[u]);
  }
  return buf;
}

void group_table(std::ostringstream& os, const std::vector<MemoryGroup>& groups, std::size_t top) {
  os << "  " << std::left << std::setw(12) << "bytes" << std::right << std::setw(8) << "%" << std::setw(8)
     << "blocks" << "  " << std::left << std::setw(10) << "phase" << std::setw(24) << "op"
     << "module\n";
  std::size_t shown = 0, rest_bytes = 0;
  int64_t rest_count = 0;
  double rest_pct = 0;
  for (const MemoryGroup& g : groups) {
    if (shown < top) {
      char pct[16];
      std::snprintf(pct, sizeof(pct), "%.1f%%", g.percent);
      const std::string count = g.phase == "before" ? "-" : std::to_string(g.count);  // blocks not seen
      os << "  " << std::left << std::setw(12) << human(g.bytes) << std::right << std::setw(8) << pct
         << std::setw(8) << count << "  " << std::left << std::setw(10) << g.phase << std::setw(24) << g.op
         << (g.module.empty() ? "-" : g.module) << "\n";
      ++shown;
    } else {
      rest_bytes += g.bytes;
      rest_count += g.count;
      rest_pct += g.percent;
    }
  }
  if (shown < groups.size()) {
    char pct[16];
    std::snprintf(pct, sizeof(pct), "%.1f%%", rest_pct);
    os << "  " << std::left << std::setw(12) << human(rest_bytes) << std::right << std::setw(8) << pct
       << std::setw(8) << rest_count << "  (" << groups.size() - shown << " more groups)\n";
  }
}

}  // namespace

std::string MemoryProfiler::json(bool with_trace) const {
  nlohmann::json j;
  j["summary"] = nlohmann::json::array();
  j["peak"] = nlohmann::json::object();
  j["live"] = nlohmann::json::object();
  j["timeline"] = nlohmann::json::object();
  for (const DeviceMemorySummary& s : summary()) {
    const std::string dev = s.device.str();
    j["summary"].push_back({{"device", dev},
                            {"start_bytes", s.start_bytes},
                            {"end_bytes", s.end_bytes},
                            {"peak_bytes", s.peak_bytes},
                            {"peak_event", s.peak_event},
                            {"allocated_bytes_total", s.allocated_bytes_total},
                            {"freed_bytes_total", s.freed_bytes_total},
                            {"num_allocs", s.num_allocs},
                            {"num_frees", s.num_frees}});
    nlohmann::json peak = nlohmann::json::array(), live = nlohmann::json::array();
    nlohmann::json by_module = nlohmann::json::array(), by_op = nlohmann::json::array();
    for (const MemoryGroup& g : peak_groups(s.device)) peak.push_back(group_json(g));
    for (const MemoryGroup& g : peak_groups(s.device, GroupBy::module)) by_module.push_back(group_json(g));
    for (const MemoryGroup& g : peak_groups(s.device, GroupBy::op)) by_op.push_back(group_json(g));
    for (const MemoryGroup& g : live_groups(s.device)) live.push_back(group_json(g));
    j["peak"][dev] = {{"bytes", s.peak_bytes},
                      {"event", s.peak_event},
                      {"groups", std::move(peak)},
                      {"by_module", std::move(by_module)},
                      {"by_op", std::move(by_op)}};
    j["live"][dev] = {{"bytes", s.end_bytes}, {"groups", std::move(live)}};
    j["timeline"][dev] = {{"event", nlohmann::json::array()},
                          {"time_us", nlohmann::json::array()},
                          {"allocated_bytes", nlohmann::json::array()}};
  }
  const std::vector<MemoryEvent> events = trace();
  nlohmann::json tr = nlohmann::json::array();
  for (const MemoryEvent& e : events) {
    const std::string dev = e.device.str();
    nlohmann::json& tl = j["timeline"][dev];
    if (tl.is_null()) {
      tl = {{"event", nlohmann::json::array()},
            {"time_us", nlohmann::json::array()},
            {"allocated_bytes", nlohmann::json::array()}};
    }
    tl["event"].push_back(e.index);
    tl["time_us"].push_back(e.time_us);
    tl["allocated_bytes"].push_back(e.allocated_after);
    if (!with_trace) continue;
    tr.push_back({{"index", e.index},
                  {"action", e.is_alloc ? "alloc" : "free"},
                  {"address", e.address},
                  {"bytes", e.bytes},
                  {"device", dev},
                  {"stream", e.stream},
                  {"thread", e.thread},
                  {"time_us", e.time_us},
                  {"op", e.op},
                  {"module", e.module},
                  {"backward_node", e.backward_node},
                  {"allocated_after", e.allocated_after}});
  }
  if (with_trace) j["trace"] = std::move(tr);
  return j.dump(1);
}

void MemoryProfiler::save_json(const std::string& path, bool with_trace) const {
  const std::string text = json(with_trace);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  FLAME_CHECK(f.good(), "MemoryProfiler::save_json", "cannot open '", path, "' for writing");
  f << text;
  f.close();
  FLAME_CHECK(f.good(), "MemoryProfiler::save_json", "writing '", path, "' failed");
}

std::string MemoryProfiler::report(std::size_t top) const {
  std::ostringstream os;
  os << "Memory profile (" << (recording() ? "recording" : "stopped") << ")\n";
  for (const DeviceMemorySummary& s : summary()) {
    if (s.num_allocs == 0 && s.num_frees == 0 && !s.device.is_cpu()) continue;  // an idle GPU
    os << "\n" << s.device.str() << ": peak " << human(s.peak_bytes) << " (" << s.peak_bytes << " B";
    if (s.peak_event >= 0) {
      os << ", at event " << s.peak_event;
    } else {
      os << ", already held at start";
    }
    os << "); start " << human(s.start_bytes) << ", end " << human(s.end_bytes) << "; " << s.num_allocs
       << " allocations (" << human(s.allocated_bytes_total) << "), " << s.num_frees << " frees ("
       << human(s.freed_bytes_total) << ")\n";
    os << "Where the peak went (by op and module):\n";
    group_table(os, peak_groups(s.device), top);
    os << "By module:\n";
    group_table(os, peak_groups(s.device, GroupBy::module), top);
    os << "By op:\n";
    group_table(os, peak_groups(s.device, GroupBy::op), top);
    const std::vector<MemoryGroup> live = live_groups(s.device);
    os << "Live at " << (recording() ? "now" : "stop") << " (" << human(s.end_bytes) << "):\n";
    if (live.empty()) {
      os << "  (nothing)\n";
    } else {
      group_table(os, live, top);
    }
  }
  return os.str();
}

}  // namespace flame::profiler
