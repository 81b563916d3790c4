// profiler::KernelTrace: start/stop around the CUPTI collector, and the views of its records
// (summary table, busy time, Chrome trace JSON).
#include "src/profiler/kernel_trace.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "flame/error.h"

namespace flame::profiler {

namespace {
std::atomic<bool> g_any_recording{false};

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}
}  // namespace

struct KernelTrace::Impl {
  bool recording = false;
  std::vector<KernelRecord> records;
};

KernelTrace::KernelTrace() : impl_(std::make_unique<Impl>()) {}
KernelTrace::~KernelTrace() {
  try {
    stop();
  } catch (...) {  // a destructor must not throw; the records are lost with the object anyway
  }
}

void KernelTrace::start() {
  const std::string why = detail::kernel_trace_unavailable();
  FLAME_CHECK(why.empty(), "KernelTrace::start", why);
  FLAME_CHECK(!impl_->recording, "KernelTrace::start", "this trace is already recording");
  bool expected = false;
  FLAME_CHECK(g_any_recording.compare_exchange_strong(expected, true), "KernelTrace::start",
              "another KernelTrace is recording (one at a time per process)");
  try {
    detail::kernel_trace_begin();
  } catch (...) {
    g_any_recording = false;
    throw;
  }
  impl_->records.clear();
  impl_->recording = true;
}

void KernelTrace::stop() {
  if (!impl_->recording) return;
  impl_->recording = false;
  std::vector<KernelRecord> r;
  try {
    r = detail::kernel_trace_end();
  } catch (...) {
    g_any_recording = false;
    throw;
  }
  g_any_recording = false;
  std::sort(r.begin(), r.end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  impl_->records = std::move(r);
}

bool KernelTrace::recording() const { return impl_->recording; }
const std::vector<KernelRecord>& KernelTrace::records() const { return impl_->records; }

std::vector<KernelSummaryRow> KernelTrace::by_name(std::size_t prefix) const {
  std::map<std::string, KernelSummaryRow> rows;
  double total = 0;
  for (const auto& r : impl_->records) {
    std::string name = prefix > 0 && r.name.size() > prefix ? r.name.substr(0, prefix) : r.name;
    auto& row = rows[name];
    row.name = name;
    row.calls += 1;
    row.total_ms += r.ms();
    total += r.ms();
  }
  std::vector<KernelSummaryRow> out;
  out.reserve(rows.size());
  for (auto& [_, row] : rows) {
    row.percent = total > 0 ? 100.0 * row.total_ms / total : 0.0;
    out.push_back(row);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.total_ms > b.total_ms; });
  return out;
}

double KernelTrace::total_ms() const {
  double t = 0;
  for (const auto& r : impl_->records) t += r.ms();
  return t;
}

double KernelTrace::busy_ms() const {
  // Records are sorted by start: merge overlapping intervals.
  uint64_t busy = 0, cur_start = 0, cur_end = 0;
  bool open = false;
  for (const auto& r : impl_->records) {
    if (!open || r.start_ns > cur_end) {
      if (open) busy += cur_end - cur_start;
      cur_start = r.start_ns;
      cur_end = r.end_ns;
      open = true;
    } else {
      cur_end = std::max(cur_end, r.end_ns);
    }
  }
  if (open) busy += cur_end - cur_start;
  return double(busy) * 1e-6;
}

double KernelTrace::span_ms() const {
  if (impl_->records.empty()) return 0;
  uint64_t last = 0;
  for (const auto& r : impl_->records) last = std::max(last, r.end_ns);
  return double(last - impl_->records.front().start_ns) * 1e-6;
}

std::string KernelTrace::summary(std::size_t top, std::size_t name_width) const {
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line,
                "GPU trace: %zu records, span %.3f ms, busy %.3f ms (%.1f%%), summed durations %.3f ms\n",
                impl_->records.size(), span_ms(), busy_ms(), span_ms() > 0 ? 100.0 * busy_ms() / span_ms() : 0.0,
                total_ms());
  os << line;
  std::snprintf(line, sizeof line, "%8s %10s %10s %6s  %s\n", "calls", "total ms", "mean us", "%", "name");
  os << line;
  const auto rows = by_name();
  for (std::size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& r = rows[i];
    std::string name = r.name.size() > name_width ? r.name.substr(0, name_width - 3) + "..." : r.name;
    std::snprintf(line, sizeof line, "%8lld %10.3f %10.2f %6.2f  %s\n", static_cast<long long>(r.calls), r.total_ms,
                  1000.0 * r.total_ms / double(r.calls), r.percent, name.c_str());
    os << line;
  }
  if (rows.size() > top) os << "  (" << rows.size() - top << " more names)\n";
  return os.str();
}

std::string KernelTrace::chrome_trace_json() const {
  std::ostringstream os;
  os << "{\"traceEvents\":[";
  const uint64_t t0 = impl_->records.empty() ? 0 : impl_->records.front().start_ns;
  bool first = true;
  for (const auto& r : impl_->records) {
    if (!first) os << ',';
    first = false;
    char buf[160];
    std::snprintf(buf, sizeof buf, "\"ph\":\"X\",\"pid\":%d,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f", r.device, r.stream,
                  double(r.start_ns - t0) * 1e-3, double(r.end_ns - r.start_ns) * 1e-3);
    os << "{\"name\":\"" << json_escape(r.name) << "\"," << buf;
    if (r.kind != KernelRecord::Kind::kernel) os << ",\"args\":{\"bytes\":" << r.bytes << '}';
    os << '}';
  }
  os << "],\"displayTimeUnit\":\"ms\"}";
  return os.str();
}

void KernelTrace::save_chrome_trace(const std::string& path) const {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  FLAME_CHECK(f.good(), "KernelTrace::save_chrome_trace", "cannot open '", path, "' for writing");
  f << chrome_trace_json();
  FLAME_CHECK(f.good(), "KernelTrace::save_chrome_trace", "writing '", path, "' failed");
}

}  // namespace flame::profiler
