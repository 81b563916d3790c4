// The CUPTI side of profiler::KernelTrace (include/flame/profiler.h): activity records of kernels,
// memcpys and memsets, delivered by CUPTI in buffers we hand it and collected at stop(). CUPTI is
// the profiler's vendor library, behind this one file (as NCCL is behind src/dist/nccl_group.cpp);
// a build without CUDA or without CUPTI gets the collector that says why tracing cannot run.
//
// Note [CUPTI buffers]
// CUPTI asks for buffers on its own threads (buffer_requested) and hands them back full or at a
// flush (buffer_completed); the records are converted there, under one mutex, into the
// process-wide list that kernel_trace_end() takes. Enabling CONCURRENT_KERNEL (not KERNEL) keeps
// kernels of different streams overlapping as they ran. cuptiActivityFlushAll(FORCED) after a
// device synchronisation delivers every record of the session before it is read.
#include "src/profiler/kernel_trace.h"

#include "flame/error.h"

#ifdef FLAME_WITH_CUDA
#include <cuda_runtime.h>
#include <cxxabi.h>

#include <cstdlib>
#include <mutex>

#include "flame/cuda.h"

#ifdef FLAME_WITH_CUPTI
#include <cupti.h>
#endif
#endif  // FLAME_WITH_CUDA

namespace flame::profiler::detail {

#if defined(FLAME_WITH_CUDA) && defined(FLAME_WITH_CUPTI)
namespace {

std::mutex g_mu;
std::vector<KernelRecord> g_records;
bool g_callbacks_registered = false;
constexpr size_t kBufferBytes = 8u << 20;
constexpr size_t kAlign = 8;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  FLAME_FAIL("KernelTrace", what, " failed: ", msg ? msg : "unknown CUPTI error", " (", static_cast<int>(r), ")");
}

std::string demangle(const char* name) {
  if (name == nullptr) return "(unnamed kernel)";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return name;
  std::string out(d);
  std::free(d);
  return out;
}

const char* memcpy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
    default: return "memcpy";
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  void* p = std::aligned_alloc(kAlign, kBufferBytes);
  *buffer = static_cast<uint8_t*>(p);
  *size = p ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<KernelRecord> got;
  CUpti_Activity* rec = nullptr;
  while (valid > 0 && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    KernelRecord r;
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        r.kind = KernelRecord::Kind::kernel;
        r.name = demangle(k->name);
        r.start_ns = k->start;
        r.end_ns = k->end;
        r.device = static_cast<int>(k->deviceId);
        r.stream = k->streamId;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        r.kind = KernelRecord::Kind::memcpy;
        r.name = memcpy_kind(m->copyKind);
        r.start_ns = m->start;
        r.end_ns = m->end;
        r.device = static_cast<int>(m->deviceId);
        r.stream = m->streamId;
        r.bytes = m->bytes;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        r.kind = KernelRecord::Kind::memset;
        r.name = "memset";
        r.start_ns = m->start;
        r.end_ns = m->end;
        r.device = static_cast<int>(m->deviceId);
        r.stream = m->streamId;
        r.bytes = m->bytes;
        break;
      }
      default:
        continue;
    }
    if (r.end_ns >= r.start_ns) got.push_back(std::move(r));
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_records.insert(g_records.end(), std::make_move_iterator(got.begin()), std::make_move_iterator(got.end()));
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};

}  // namespace

std::string kernel_trace_unavailable() {
  if (!flame::cuda_is_available()) return "no CUDA device is available to trace";
  return {};
}

void kernel_trace_begin() {
  if (!g_callbacks_registered) {
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    g_callbacks_registered = true;
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_records.clear();
  }
  // Work queued before start() must not leak into the session.
  for (int d = 0; d < flame::cuda_device_count(); ++d) flame::cuda::synchronize(d);
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_records.clear();
  }
  for (auto k : kKinds) check(cuptiActivityEnable(k), "cuptiActivityEnable");
}

std::vector<KernelRecord> kernel_trace_end() {
  for (int d = 0; d < flame::cuda_device_count(); ++d) flame::cuda::synchronize(d);
  CUptiResult flushed = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (auto k : kKinds) cuptiActivityDisable(k);
  check(flushed, "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<KernelRecord> out;
  out.swap(g_records);
  return out;
}

#else  // without CUDA, or CUDA without CUPTI

std::string kernel_trace_unavailable() {
#ifdef FLAME_WITH_CUDA
  return "FLAME was built without CUPTI (CUDA::cupti was not found at configure time)";
#else
  return "FLAME was built without CUDA: there is no GPU to trace";
#endif
}
void kernel_trace_begin() { FLAME_FAIL("KernelTrace", kernel_trace_unavailable()); }
std::vector<KernelRecord> kernel_trace_end() { return {}; }

#endif

}  // namespace flame::profiler::detail
