#pragma once
// flame::compile: traced fusion of elementwise ops into generated kernels. See docs/compile.md.
//
//   auto f = flame::compile([](const flame::TensorList& in) -> flame::TensorList {
//     return {in[0].add_scalar(1).relu()};
//   });
//   flame::Tensor y = f({x})[0];   // first call: traces; later calls: one generated kernel
//
// On the first call for an input signature (shapes, strides, dtypes, devices, requires_grad, grad
// mode, autocast state) the function runs eagerly while its ops are recorded; the recording becomes
// a plan of fused regions (each one kernel, NVRTC-compiled and cached on disk, with a generated
// backward kernel) that later calls with that signature replay. Anything the tracer cannot
// replay makes the function run eagerly, with the reason in fallback_reason().
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "flame/tensor.h"

namespace flame {

struct CompileOptions {
  std::size_t max_signatures = 8;  // traces kept; the least recently used one is dropped beyond
  bool log_fallbacks = true;       // one line on stderr the first time a signature falls back
  std::string name = "compiled";   // in log lines and kernel tags
};

struct CompileStats {
  int64_t traces = 0;          // signatures traced (each first call of a new signature)
  int64_t replays = 0;         // calls served by a traced plan
  int64_t eager_calls = 0;     // calls run eagerly (the tracing calls and fallbacks)
  int64_t evictions = 0;       // traces dropped by the signature bound
  // The plan of the last call's signature (0 when it fell back):
  int64_t fused_kernels = 0;   // generated kernels one forward replay launches
  int64_t fused_ops = 0;       // traced elementwise ops inside them
  int64_t eager_ops = 0;       // ops a replay runs eagerly, outside fused kernels
  int64_t saved_inputs = 0;    // tensors the plan's backward nodes save (region inputs only)
  // Work done by replays so far:
  int64_t kernel_launches = 0;     // forward fused kernels run (CUDA launches or CPU interpretations)
  int64_t backward_kernels = 0;    // backward fused kernels run
};

class CompiledFunction {
 public:
  using Fn = std::function<TensorList(const TensorList&)>;
  CompiledFunction() = default;
  CompiledFunction(Fn fn, CompileOptions options);

  // Calls the function: replays the plan traced for this signature, traces it (running eagerly)
  // on its first call, or runs eagerly when it cannot be compiled.
  TensorList operator()(const TensorList& inputs) const;

  CompileStats stats() const;
  // Why the last call's signature runs eagerly ("" when it was compiled).
  std::string fallback_reason() const;
  // The generated CUDA source of the last call's plan, region by region ("" on the CPU or when
  // nothing was generated yet): for inspection and tests.
  std::string last_kernel_sources() const;
  void clear_cache() const;  // drops every trace (the kernels stay in the kernel cache)

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

CompiledFunction compile(CompiledFunction::Fn fn, CompileOptions options = {});

}  // namespace flame
