// profiler::KernelTrace: GPU kernels, copies and memsets recorded through CUPTI, and the views.
#include <gtest/gtest.h>

#include <string>

#include "flame/flame.h"
#include "flame/profiler.h"
#include "test_util.h"

namespace flame {
namespace {

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(KernelTrace, RecordsKernelsAndCopiesWithTimesAndNames) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  Tensor a = Tensor::randn({512, 512}, 0.0, 1.0, dev);
  Tensor b = Tensor::randn({512, 512}, 0.0, 1.0, dev);
  Tensor host = Tensor::randn({4096}, 0.0, 1.0, Device::cpu());
  profiler::KernelTrace trace;
  trace.start();
  EXPECT_TRUE(trace.recording());
  Tensor up = host.to(dev);
  Tensor d;
  for (int i = 0; i < 3; ++i) d = (matmul(a, b) + 1.0).relu();
  trace.stop();
  EXPECT_FALSE(trace.recording());
  // The work is really done: relu(ab + 1) >= 0 everywhere.
  EXPECT_GE(d.min().item<float>(), 0.0f);

  const auto recs = trace.records();  // a copy: the second session below replaces the records
  int kernels = 0, flame_kernels = 0, htod = 0;
  for (size_t i = 0; i < recs.size(); ++i) {
    const auto& r = recs[i];
    EXPECT_GE(r.end_ns, r.start_ns) << r.name;
    if (i > 0) EXPECT_GE(r.start_ns, recs[i - 1].start_ns) << "records are sorted by start";
    if (r.kind == profiler::KernelRecord::Kind::kernel) {
      ++kernels;
      if (r.name.find("flame::") != std::string::npos) ++flame_kernels;
    }
    if (r.kind == profiler::KernelRecord::Kind::memcpy && r.name == "memcpy HtoD" && r.bytes == 4096 * 4) ++htod;
  }
  EXPECT_GE(kernels, 6) << "3 GEMMs and at least 3 elementwise kernels";
  EXPECT_GE(flame_kernels, 3) << "FLAME's elementwise kernels, demangled";
  EXPECT_EQ(htod, 1) << "the 16 KiB upload";
  EXPECT_GT(trace.total_ms(), 0.0);
  EXPECT_LE(trace.busy_ms(), trace.span_ms() + 1e-9);
  EXPECT_LE(trace.busy_ms(), trace.total_ms() + 1e-9);

  double pct = 0;
  int64_t calls = 0;
  for (const auto& row : trace.by_name()) {
    pct += row.percent;
    calls += row.calls;
  }
  EXPECT_NEAR(pct, 100.0, 1e-6);
  EXPECT_EQ(calls, static_cast<int64_t>(recs.size()));
  const std::string table = trace.summary(5);
  EXPECT_NE(table.find("GPU trace: " + std::to_string(recs.size()) + " records"), std::string::npos) << table;
  const std::string json = trace.chrome_trace_json();
  EXPECT_EQ(json.rfind("{\"traceEvents\":[", 0), 0u);
  EXPECT_EQ(count(json, "\"ph\":\"X\""), static_cast<int>(recs.size()));

  // A new session starts empty and sees only its own work.
  trace.start();
  Tensor e = a + b;
  trace.stop();
  EXPECT_GE(trace.records().size(), 1u);
  EXPECT_LT(trace.records().size(), recs.size());
}

TEST(KernelTrace, OneTraceAtATimeAndBuildsWithoutAGpuRaise) {
  profiler::KernelTrace first, second;
  if (!cuda_is_available()) {
    try {
      first.start();
      FAIL() << "start() without a GPU must raise";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KernelTrace"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(first.recording());
    return;
  }
  first.start();
  EXPECT_THROW(second.start(), Error);
  EXPECT_THROW(first.start(), Error);
  first.stop();
  second.start();  // free again
  second.stop();
  first.stop();  // stopping twice is a no-op
}

}  // namespace
}  // namespace flame
