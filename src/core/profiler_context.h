#pragma once
// What the allocators, the op layer, autograd and nn::Module tell the memory profiler
// (include/flame/profiler.h). Internal; kept free of CUDA and tensor headers so that the CUDA
// pool (.cu) and the CPU allocator can include it. See Note [Allocation context] in
// src/profiler/memory_profiler.cpp.
#include <atomic>
#include <cstddef>
#include <string>

namespace flame::profiler_detail {

// Memory profiler sessions recording now, on any thread. Every hook tests this first (one relaxed
// load): with no session the hooks do nothing else.
extern std::atomic<int> g_recording;
inline bool recording() { return g_recording.load(std::memory_order_relaxed) > 0; }

// Per-thread attribution of allocations. Trivially destructible (a fixed stack of module paths),
// so that a free hooked while the thread's other thread-locals are destroyed finds it intact.
struct ThreadContext {
  static constexpr int kMaxDepth = 64;  // deeper module calls keep the path of the 64th
  const char* op = nullptr;             // the op that last allocated an output on this thread
  const char* invoking = nullptr;       // the op invoke<Def> runs now (Note [Invoke] in src/ops/invoke.h)
  const char* backward_node = nullptr;  // the node whose gradient rule runs now (backward only)
  const char* node_module = nullptr;    // the module path that node was recorded in
  const char* modules[kMaxDepth] = {};  // paths of the nn::Module calls entered (interned)
  int depth = 0;                        // module calls entered (may exceed kMaxDepth)
};
ThreadContext& thread_context();

// Names the op allocating now (make_empty's op). Deliberately not restored on exit: scratch
// memory a kernel allocates right after its output (a cuBLAS or cuDNN workspace) is attributed
// to the same op.
// Inside an op run through invoke<Def>, its allocations (outputs, layout copies, scratch) belong
// to that op rather than to the generic name ("empty") make_empty was given.
inline void set_current_op(const char* op) {
  if (!recording()) return;
  ThreadContext& ctx = thread_context();
  ctx.op = ctx.invoking ? ctx.invoking : op;
}

// The op invoke<Def> runs while alive (the innermost one when invokes nest).
class InvokeScope {
 public:
  explicit InvokeScope(const char* op) {
    if (!recording()) return;
    ctx_ = &thread_context();
    prev_ = ctx_->invoking;
    ctx_->invoking = op;
  }
  ~InvokeScope() {
    if (ctx_) ctx_->invoking = prev_;
  }
  InvokeScope(const InvokeScope&) = delete;
  InvokeScope& operator=(const InvokeScope&) = delete;

 private:
  ThreadContext* ctx_ = nullptr;
  const char* prev_ = nullptr;
};

// The gradient rule of `node` runs (backward.cpp): allocations meanwhile belong to it.
class BackwardNodeScope {
 public:
  BackwardNodeScope(const char* node, const char* module) {
    if (!recording()) return;
    ctx_ = &thread_context();
    prev_node_ = ctx_->backward_node;
    prev_module_ = ctx_->node_module;
    ctx_->backward_node = node;
    ctx_->node_module = module;
  }
  ~BackwardNodeScope() {
    if (!ctx_) return;
    ctx_->backward_node = prev_node_;
    ctx_->node_module = prev_module_;
  }
  BackwardNodeScope(const BackwardNodeScope&) = delete;
  BackwardNodeScope& operator=(const BackwardNodeScope&) = delete;

 private:
  ThreadContext* ctx_ = nullptr;
  const char* prev_node_ = nullptr;
  const char* prev_module_ = nullptr;
};

// An nn::Module call (Module::operator()): its path ("blocks.3.attn", interned) is the thread's
// module path until the call returns; null pushes nothing (no session, no anomaly mode, a root).
// push_module / pop_module are its two halves, for nn::Module::CallScope (a public header that
// cannot name ThreadContext): push returns the context to pop, or null when it pushed nothing.
inline ThreadContext* push_module(const char* path) {
  if (path == nullptr) return nullptr;
  ThreadContext* ctx = &thread_context();
  if (ctx->depth < ThreadContext::kMaxDepth) ctx->modules[ctx->depth] = path;
  ++ctx->depth;
  return ctx;
}
inline void pop_module(ThreadContext* ctx) {
  if (ctx && ctx->depth > 0) --ctx->depth;
}

class ModuleScope {
 public:
  explicit ModuleScope(const char* path) : ctx_(push_module(path)) {}
  ~ModuleScope() { pop_module(ctx_); }
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

 private:
  ThreadContext* ctx_ = nullptr;
};

// A copy of `s` that lives as long as the process (one per distinct string).
const char* intern(const std::string& s);

// The path of the innermost module call of this thread ("blocks.3.attn"; interned); nullptr when
// no module is entered.
const char* current_module_path();

// Allocator hooks. device: -1 for the CPU allocator, the CUDA device index otherwise; stream: the
// cudaStream_t (null on the CPU); bytes: what the allocator counts in its allocated_bytes.
// Thread-safe; cheap no-ops while no session records. Never throw.
void on_alloc(const void* ptr, std::size_t bytes, int device, const void* stream) noexcept;
void on_free(const void* ptr, std::size_t bytes, int device, const void* stream) noexcept;

}  // namespace flame::profiler_detail
