#pragma once
// Pieces the parity tools share: the error of an output against a reference, a median time, the
// command-line flags, and a kernel trace of a step.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <flame/flame.h>
#include <flame/nn/linear.h>
#include <flame/nn/linear_float8.h>
#include <flame/profiler.h>

namespace flame_diffusion::tools {

struct ParityError {
  double abs = 0;  // max |got - ref|
  double rel = 0;  // abs / max |ref|
};

// `tool` names the caller in the shape-mismatch error.
inline ParityError parity_error(const flame::Tensor& got, const flame::Tensor& ref, const char* tool) {
  FLAME_CHECK(got.sizes() == ref.sizes(), tool, "output shape ", got.sizes(), " vs reference ", ref.sizes());
  const flame::Tensor g = got.to(flame::DType::f64, flame::Device::cpu());
  const flame::Tensor r = ref.to(flame::DType::f64, flame::Device::cpu());
  ParityError e;
  e.abs = (g - r).abs().max().item<double>();
  e.rel = e.abs / std::max(1e-30, r.abs().max().item<double>());
  return e;
}

// 3 warm-up calls, then the median of 10 timed ones (CUDA events on a GPU, wall clock on the CPU), ms.
inline double median_ms(const std::function<void()>& fn, bool cuda) {
  for (int i = 0; i < 3; ++i) fn();
  if (cuda) flame::cuda::synchronize();
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    if (cuda) {
      flame::cuda::Event a(true), b(true);
      a.record();
      fn();
      b.record();
      b.synchronize();
      t.push_back(a.elapsed_time(b));
    } else {
      const auto s = std::chrono::steady_clock::now();
      fn();
      t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
    }
  }
  std::sort(t.begin(), t.end());
  return (t[4] + t[5]) / 2;
}

// A training step timed on the GPU: `warmup` untimed calls, then the median of `steps` calls timed
// with CUDA events, and the peak allocated memory over the timed calls (GiB) on `device` (the
// step's GPU: a rank of a multi-GPU job passes its own).
struct StepTimes {
  double median_ms = 0;
  double peak_gib = 0;
};
inline StepTimes time_cuda_steps(const std::function<void()>& step, int64_t warmup, int64_t steps, int device = 0) {
  for (int64_t i = 0; i < warmup; ++i) step();
  flame::cuda::synchronize(device);
  flame::cuda::reset_peak_memory_stats(device);
  std::vector<double> ms;
  for (int64_t i = 0; i < steps; ++i) {
    flame::cuda::Event a(true), b(true);
    a.record();
    step();
    b.record();
    b.synchronize();
    ms.push_back(a.elapsed_time(b));
  }
  std::sort(ms.begin(), ms.end());
  return {ms.empty() ? 0.0 : ms[ms.size() / 2],
          static_cast<double>(flame::cuda::memory_stats(device).peak_allocated_bytes) / (1u << 30)};
}

// "--name value" pairs after the command (argv[1]); an unknown flag or a missing value raises
// std::runtime_error with `usage`.
inline std::map<std::string, std::string> parse_flags(int argc, char** argv, const std::vector<std::string>& known,
                                                      const std::string& usage) {
  std::map<std::string, std::string> f;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || std::find(known.begin(), known.end(), a.substr(2)) == known.end())
      throw std::runtime_error("unknown flag '" + a + "'\n" + usage);
    if (i + 1 >= argc) throw std::runtime_error("flag '" + a + "' needs a value");
    f[a.substr(2)] = argv[++i];
  }
  return f;
}

inline std::string flag_or(const std::map<std::string, std::string>& f, const std::string& k,
                           const std::string& fallback) {
  auto it = f.find(k);
  return it == f.end() ? fallback : it->second;
}

// Bytes of the frozen Linear weights under root (8-bit ones with their scales): the base a
// --fp8 run stores.
inline int64_t base_linear_bytes(flame::nn::Module& root) {
  int64_t bytes = 0;
  for (const auto& [n, m] : root.named_modules()) {
    const auto* lin = dynamic_cast<const flame::nn::Linear*>(m.get());
    if (!lin || lin->weight().requires_grad()) continue;
    bytes += static_cast<int64_t>(lin->weight().nbytes());
    if (lin->is_float8()) bytes += static_cast<int64_t>(lin->weight_scale().nbytes());
  }
  return bytes;
}

// The items of a comma-separated list ("a,b" -> {"a", "b"}; "" -> {""}).
inline std::vector<std::string> split_list(const std::string& v) {
  std::vector<std::string> out;
  for (std::size_t start = 0; start <= v.size();) {
    const std::size_t comma = std::min(v.find(',', start), v.size());
    out.push_back(v.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// --fp8 values: "none" or a Float8Compute name (nn::parse_float8_compute raises naming a bad one),
// comma-separated.
inline std::vector<std::string> fp8_modes(const std::map<std::string, std::string>& f, const char* fallback) {
  std::vector<std::string> out = split_list(flag_or(f, "fp8", fallback));
  for (const std::string& m : out) {
    if (m != "none") (void)flame::nn::parse_float8_compute(m);
  }
  return out;
}

// "1,4" -> {1, 4}; an error names the flag.
inline std::vector<int64_t> int_list(const std::string& flag, const std::string& v) {
  std::vector<int64_t> out;
  std::size_t s = 0;
  while (s <= v.size()) {
    const std::size_t e = std::min(v.find(',', s), v.size());
    try {
      out.push_back(std::stoll(v.substr(s, e - s)));
    } catch (const std::exception&) {
      throw std::runtime_error("--" + flag + ": '" + v + "' is not a comma-separated list of integers");
    }
    s = e + 1;
  }
  return out;
}

inline flame::Device parse_device(const std::string& v) {
  if (v == "cpu") return flame::Device::cpu();
  if (v == "cuda") return flame::Device::cuda(0);
  throw std::runtime_error("--device must be cpu or cuda, got '" + v + "'");
}

// Where the GPU sat idle in a trace: each gap between the union of the activity so far and the
// next record's start is charged to that next record (the work the GPU waited for the host to
// launch), by size and by the next record's name. Host-bound stretches show as many small gaps
// before the same small kernels; a sync or a host read shows as one large gap.
inline void print_idle_time(const std::vector<flame::profiler::KernelRecord>& records, double steps) {
  if (records.empty()) return;
  const double bounds_us[] = {2, 10, 50, 500};
  double by_size_ms[5] = {0, 0, 0, 0, 0};
  int64_t by_size_n[5] = {0, 0, 0, 0, 0};
  std::map<std::string, std::pair<double, int64_t>> by_next;
  uint64_t end = records.front().end_ns;
  std::size_t last = 0;  // the record whose end is `end`
  double total_ms = 0;
  struct Gap { double us; std::size_t before, after; };
  std::vector<Gap> largest;
  for (std::size_t i = 1; i < records.size(); ++i) {
    const auto& r = records[i];
    if (r.start_ns > end) {
      const double us = static_cast<double>(r.start_ns - end) * 1e-3;
      int b = 0;
      while (b < 4 && us >= bounds_us[b]) ++b;
      by_size_ms[b] += us * 1e-3;
      ++by_size_n[b];
      auto& row = by_next[r.name.substr(0, 60)];
      row.first += us * 1e-3;
      ++row.second;
      total_ms += us * 1e-3;
      largest.push_back({us, last, i});
    }
    if (r.end_ns >= end) {
      end = r.end_ns;
      last = i;
    }
  }
  const std::size_t shown = std::min<std::size_t>(largest.size(), 6);
  std::partial_sort(largest.begin(), largest.begin() + static_cast<std::ptrdiff_t>(shown), largest.end(),
                    [](const Gap& a, const Gap& b) { return a.us > b.us; });
  std::printf("# idle %.2f ms/step; gaps by size:", total_ms / steps);
  const char* labels[] = {"<2us", "2-10us", "10-50us", "50-500us", ">=500us"};
  for (int b = 0; b < 5; ++b) {
    std::printf(" %s %.2f ms (%.0f)", labels[b], by_size_ms[b] / steps, static_cast<double>(by_size_n[b]) / steps);
  }
  std::printf("\n# idle by the record that ended the gap:\n");
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(by_next.begin(), by_next.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  for (std::size_t i = 0; i < rows.size() && i < 16; ++i) {
    std::printf("#   %7.2f ms/step %6.0f gaps/step  %s\n", rows[i].second.first / steps,
                static_cast<double>(rows[i].second.second) / steps, rows[i].first.c_str());
  }
  std::printf("# largest gaps:\n");
  for (std::size_t i = 0; i < shown; ++i) {
    std::printf("#   %9.1f us  after %s\n#                before %s\n", largest[i].us,
                records[largest[i].before].name.substr(0, 70).c_str(), records[largest[i].after].name.substr(0, 70).c_str());
  }
}

// Where a step's collectives ran against its compute (rank 0's trace of `steps` steps): the union
// of NCCL's kernels (names starting "nccl"), the part of it that other kernels overlapped, the part
// exposed (the GPU ran only communication), and the first collective's start and the last one's end
// relative to the trace's first record. One "# " line; nothing when no collective ran.
inline void print_comm_overlap(const std::vector<flame::profiler::KernelRecord>& records, double steps) {
  using Span = std::pair<uint64_t, uint64_t>;
  std::vector<Span> comm, other;
  for (const auto& r : records) {
    if (r.end_ns <= r.start_ns) continue;
    (r.name.rfind("nccl", 0) == 0 ? comm : other).emplace_back(r.start_ns, r.end_ns);
  }
  if (comm.empty() || records.empty()) return;
  auto merged = [](std::vector<Span> v) {
    std::sort(v.begin(), v.end());
    std::vector<Span> out;
    for (const Span& s : v) {
      if (!out.empty() && s.first <= out.back().second) out.back().second = std::max(out.back().second, s.second);
      else out.push_back(s);
    }
    return out;
  };
  const std::vector<Span> c = merged(comm), o = merged(other);
  uint64_t comm_ns = 0, overlap_ns = 0;
  for (const Span& s : c) comm_ns += s.second - s.first;
  for (std::size_t i = 0, j = 0; i < c.size() && j < o.size();) {  // the intersection of two sorted unions
    const uint64_t lo = std::max(c[i].first, o[j].first), hi = std::min(c[i].second, o[j].second);
    if (hi > lo) overlap_ns += hi - lo;
    if (c[i].second < o[j].second) ++i;
    else ++j;
  }
  uint64_t t0 = records.front().start_ns, t1 = 0;
  for (const auto& r : records) t1 = std::max(t1, r.end_ns);
  auto ms = [steps](uint64_t ns) { return static_cast<double>(ns) * 1e-6 / steps; };
  std::printf("# collectives: %.2f ms/step of NCCL kernels, %.2f ms overlapped by compute, %.2f ms exposed; the "
              "first starts %.2f ms and the last ends %.2f ms into the %.2f ms traced (%zu collective kernels)\n",
              ms(comm_ns), ms(overlap_ns), ms(comm_ns - overlap_ns), static_cast<double>(c.front().first - t0) * 1e-6,
              static_cast<double>(c.back().second - t0) * 1e-6, static_cast<double>(t1 - t0) * 1e-6, comm.size());
}

// Where the GPU time of `steps` more steps goes (profiler::KernelTrace), by kernel name (grouped
// by their first 60 characters), and the host gap of a step (span - busy), with print_idle_time, as "# "
// lines.
inline void print_kernel_trace(const std::function<void()>& step, int64_t steps) {
  flame::profiler::KernelTrace trace;
  trace.start();
  for (int64_t i = 0; i < steps; ++i) step();
  trace.stop();
  const double n = static_cast<double>(steps);
  std::printf("# kernel trace of %lld steps: per step %.2f ms busy, %.2f ms span, %.0f kernels\n",
              static_cast<long long>(steps), trace.busy_ms() / n, trace.span_ms() / n,
              static_cast<double>(trace.records().size()) / n);
  for (const auto& row : trace.by_name(60)) {
    if (row.percent < 0.5) continue;
    std::printf("#   %7.2f ms/step %5.1f%% %6.0f calls/step  %s\n", row.total_ms / n, row.percent,
                static_cast<double>(row.calls) / n, row.name.c_str());
  }
  print_idle_time(trace.records(), n);
  print_comm_overlap(trace.records(), n);
  std::fflush(stdout);
}

// main() of a tool with commands (`tool CMD --flag value ...`): parses the flags, runs the
// command, and turns any error into one line on stderr naming the tool (exit code 2).
using ToolCommand = std::function<int(const std::map<std::string, std::string>&)>;
inline int run_tool(int argc, char** argv, const char* tool, const std::string& usage,
                    const std::vector<std::string>& known_flags, const std::map<std::string, ToolCommand>& commands) {
  try {
    if (argc < 2) throw std::runtime_error("no command\n" + usage);
    const auto it = commands.find(argv[1]);
    if (it == commands.end()) throw std::runtime_error("unknown command '" + std::string(argv[1]) + "'\n" + usage);
    return it->second(parse_flags(argc, argv, known_flags, usage));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return 2;
  }
}

}  // namespace flame_diffusion::tools
