#pragma once
// The collection side of profiler::KernelTrace (include/flame/profiler.h): CUPTI activity records
// in CUDA builds with CUPTI, an error elsewhere (src/profiler/cupti_trace.cpp, either way).
#include <string>
#include <vector>

#include "flame/profiler.h"

namespace flame::profiler::detail {

// Why tracing cannot run in this build, or empty when it can.
std::string kernel_trace_unavailable();
void kernel_trace_begin();                     // enables the activity kinds
std::vector<KernelRecord> kernel_trace_end();  // synchronises, flushes, disables, returns records

}  // namespace flame::profiler::detail
