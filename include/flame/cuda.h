#pragma once
// CUDA runtime controls: memory-pool statistics, streams, events, graph capture, synchronisation,
// math-mode flags. In a build without CUDA every call except the flags raises flame::Error.
// docs/streams.md explains streams, events, record_stream and the graph-capture rules.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace flame {
class Tensor;
}

namespace flame::cuda {

struct MemoryStats {
  std::size_t allocated_bytes = 0;       // held by live tensors (requested sizes)
  std::size_t reserved_bytes = 0;        // held from the driver: pool (allocated + cached) + graph pools
  std::size_t cached_bytes = 0;          // part of reserved: freed blocks kept for reuse by size
  std::size_t peak_allocated_bytes = 0;  // max of allocated_bytes since the last reset
  // max of reserved_bytes since the last reset (sampled when memory comes from the driver; a block
  // refused by set_memory_limit does not count): what a cap on reserved memory must allow
  std::size_t peak_reserved_bytes = 0;
  // reserved_bytes - allocated_bytes: memory held but not used by a live tensor (cached blocks,
  // size rounding, pool slack, graph-private blocks not in use).
  std::size_t fragmentation_bytes = 0;
  std::size_t graph_pool_bytes = 0;      // part of reserved: private pools of live cuda::Graphs
  std::size_t pending_stream_bytes = 0;  // freed blocks waiting for other streams (record_stream)
  uint64_t num_allocs = 0;               // allocations served since process start
  uint64_t num_frees = 0;
  uint64_t num_ooms = 0;                 // out-of-memory errors raised
};

MemoryStats memory_stats(int device = 0);
void reset_peak_memory_stats(int device = 0);
// Returns cached, unused memory to the driver (waits for the device first).
void empty_cache(int device = 0);
// Waits until all work queued on every stream of the device has finished. Raises if the calling
// thread is capturing a graph on the device.
void synchronize(int device = 0);

class Event;

// A CUDA stream of one device (a cudaStream_t underneath). Copies share the stream. Streams made by
// Stream::create are recycled, never destroyed, so memory cached for a stream stays valid.
class Stream {
 public:
  // The default FLAME stream of `device`: a non-blocking stream all ops use unless a StreamGuard
  // or set_current_stream says otherwise.
  static Stream default_stream(int device = 0);
  // The stream FLAME ops of this thread run on for `device`.
  static Stream current(int device = 0);
  // A new stream. priority: lower numbers run first (CUDA's convention; 0 is the default, -1 or
  // lower is high priority, clamped to the device's range). non_blocking: no implicit
  // synchronisation with the legacy default stream (cudaStreamNonBlocking).
  static Stream create(int device = 0, int priority = 0, bool non_blocking = true);
  // Wraps a cudaStream_t created elsewhere (a library's); it must outlive every use by FLAME,
  // including tensors allocated while it was current.
  static Stream from_handle(void* cuda_stream, int device = 0);

  void* handle() const;  // the cudaStream_t
  int device() const { return device_; }
  int priority() const;
  // True when all work queued on the stream has finished; never waits.
  bool query() const;
  // Waits for all work queued so far (raises if the stream is being captured).
  void synchronize() const;
  // Work queued on this stream from now on waits for `event` (recorded earlier on any stream).
  void wait(const Event& event) const;
  // Work queued on this stream from now on waits for all work queued on `other` so far.
  void wait(const Stream& other) const;

  bool operator==(const Stream& o) const { return handle_ == o.handle_ && device_ == o.device_; }
  bool operator!=(const Stream& o) const { return !(*this == o); }

 private:
  Stream(void* handle, int device, std::shared_ptr<void> owner) : handle_(handle), device_(device), owner_(std::move(owner)) {}
  void* handle_ = nullptr;
  int device_ = 0;
  std::shared_ptr<void> owner_;  // returns a created stream to the recycling list when the last copy goes
};

// Makes `stream` the current stream of its device for the calling thread.
void set_current_stream(const Stream& stream);

// Makes `stream` current for its device on this thread for the scope, then restores the previous one.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
  Stream current_;  // kept alive while it is current
};

// A CUDA event. Without timing (the default) it is cheaper to record and wait on.
class Event {
 public:
  explicit Event(bool enable_timing = false);
  ~Event();
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Captures the work queued on `stream` so far (by default: the current stream of the calling
  // thread's current CUDA device, device 0 unless cudaSetDevice changed it).
  void record();
  void record(const Stream& stream);
  // Makes `stream` wait for the recorded work (the GPU waits; the host does not).
  void wait(const Stream& stream) const;
  // True when the recorded work has finished (or nothing was recorded).
  bool query() const;
  // The host waits for the recorded work.
  void synchronize() const;
  // Milliseconds between this event and `end`, both recorded with timing enabled and completed.
  float elapsed_time(const Event& end) const;
  bool recorded() const { return recorded_; }
  int device() const { return device_; }
  void* handle() const { return event_; }

 private:
  void* event_ = nullptr;  // cudaEvent_t, created on first record (on the stream's device)
  int device_ = -1;
  bool timing_ = false;
  bool recorded_ = false;
};

// record_stream: `tensor` (a CUDA tensor) is used by work queued on `stream`, which is not the
// stream it was allocated on. When the tensor's memory is freed it is not reused until the work
// queued on `stream` up to the free has finished (an event recorded at free time), like
// torch.Tensor.record_stream.
void record_stream(const Tensor& tensor, const Stream& stream);

// The current stream of `device` for this thread, as a cudaStream_t.
void* current_stream(int device = 0);

// A CUDA graph of FLAME ops: capture once, replay many times with no host cost per op.
//   cuda::Graph g;
//   g.capture_begin();  ... ops on CUDA tensors ...  g.capture_end();
//   for (...) { x_static.copy_(next_batch); g.replay(); }
// Rules (docs/streams.md): tensors the captured ops read (inputs, parameters) must stay alive and
// keep their memory while the graph is replayed; refill them in place. Memory allocated during
// capture comes from a private pool that lives as long as the graph: outputs keep their addresses,
// and every replay rewrites them. Anything that would wait for the GPU or copy from/to the host
// during capture (to_vec, item, printing, synchronize, uploads) raises flame::Error. Random ops
// read their Philox seed and offset from device memory, so each replay draws fresh numbers: the
// k-th replay matches an eager run of the same ops at the generator's offset at that replay.
class Graph {
 public:
  Graph();
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Starts capturing the calling thread's FLAME ops on `device`: they are recorded, not run. The
  // capture runs on a side stream made current for the thread until capture_end.
  void capture_begin(int device = 0);
  void capture_end();
  // Runs the captured work on the current stream of the graph's device.
  void replay();
  // Frees the graph and its private pool (waits for its replays first).
  void reset();
  bool captured() const;
  // Number of random draws (generator offsets) one replay consumes.
  uint64_t random_offsets_per_replay() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// Captures fn() into `graph` (capture_begin/capture_end around it; the capture is aborted if fn throws).
void capture(Graph& graph, const std::function<void()>& fn, int device = 0);

// True when the calling thread is capturing a CUDA graph on `device`.
bool is_capturing(int device = 0);

// ---- memory limit (docs/offload.md, Note [Memory limit] in memory_pool.cu) ----
// Caps the memory the pool of `device` reserves from the driver at `bytes` (0 removes the cap),
// like torch.cuda.set_per_process_memory_fraction: an allocation that would take reserved memory
// above it first releases cached blocks, then raises the pool's out-of-memory error.
void set_memory_limit(std::size_t bytes, int device = 0);
std::size_t memory_limit(int device = 0);  // 0: no cap

// f32 matmuls may use TF32 tensor cores (like torch.backends.cuda.matmul.allow_tf32). Default off,
// as PyTorch's.
void set_allow_tf32(bool allow);
bool allow_tf32();
// f32 convolutions (cuDNN) may use TF32 tensor cores (like torch.backends.cudnn.allow_tf32).
// Default on, as PyTorch's (about 1e-3 relative error); off, cuDNN runs only engines that compute
// in full f32. Applies from the next call on (plans are cached per setting).
void set_allow_conv_tf32(bool allow);
bool allow_conv_tf32();

// ---- epilogue GEMM autotuning (docs/epi.md) ----
// Linear's fused cuBLASLt GEMMs (bias, GELU and bias-gradient epilogues) time up to 8 candidate
// algorithms on the first call of each new shape outside graph capture and keep the fastest for
// the rest of the process; that first call waits for the GPU once (the timing). Default on; the
// environment variable FLAME_EPI_AUTOTUNE=0 turns it off at start-up (=verbose also prints each
// choice to stderr). Off, and for a shape first seen under capture, the heuristic's first
// algorithm runs. The choice is fixed per process; it may differ between processes and GPUs.
void set_epilogue_autotune(bool enable);
bool epilogue_autotune();
// How a weight-gradient GEMM with a bias gradient gets it: `automatic` times cuBLASLt's BGRADB
// epilogue against a plain GEMM plus FLAME's column-sum kernel (BGRADB when not tuning);
// `epilogue` and `column_sum` force one kind (benchmarks, tests). Plans are cached per setting
// (of both switches), so a change applies from the next call on.
enum class EpilogueBiasGrad { automatic, epilogue, column_sum };
void set_epilogue_bias_grad(EpilogueBiasGrad mode);
EpilogueBiasGrad epilogue_bias_grad();
struct EpilogueTuneStats {
  uint64_t tuned_plans = 0;       // plans made with autotuning (timed when 2+ candidates)
  uint64_t heuristic_plans = 0;   // shapes that took the heuristic's first answer
  uint64_t timed_candidates = 0;  // candidates timed, over all tuned plans
  uint64_t column_sum_plans = 0;  // plans (either kind) whose bias gradient is the column-sum kernel
};
// Process-wide counters (all devices); zeros in a build without CUDA.
EpilogueTuneStats epilogue_tune_stats();

// ---- cuDNN plan autotuning (convolution and fused attention; docs/nn-conv.md) ----
// cuDNN's heuristic ranks engine configurations without running them. With autotuning on, the
// first call of each new convolution or SDPA problem outside graph capture also builds the
// heuristic's next candidates (up to 8 in all), times each on the call's own operands, and keeps
// the fastest for the rest of the process; that call waits for the GPU once. Like
// torch.backends.cudnn.benchmark = True, and off by default like it: on an H100 the heuristic's
// first plan was the fastest (within 3%) for every benchmarked conv and attention problem but one
// (docs/nn-conv.md). The switch applies to problems first seen after it changes. FLAME_CUDNN_AUTOTUNE=1 turns it on at start-up (=verbose also prints each problem's
// candidates and timings). Off, and for a problem first seen under capture, the heuristic's first
// plan that builds runs.
void set_cudnn_autotune(bool enable);
bool cudnn_autotune();
struct CudnnTuneStats {
  uint64_t tuned_plans = 0;       // problems whose candidates were timed (2+ built)
  uint64_t timed_candidates = 0;  // candidates timed, over all of them
};
// Process-wide counters (all devices); zeros in a build without CUDA.
CudnnTuneStats cudnn_tune_stats();

// ---- short-sequence attention (docs/nn-attention.md) ----
// FLAME's own fused SDPA kernels for short sequences instead of cuDNN's: taken for bf16/f16 with
// head dim 64, at most 256 queries and 256 keys, no mask, not causal, and 16-byte aligned operands
// whose batch, head and row strides are multiples of 8 elements (a DiT's attention; every other
// call stays on cuDNN). They tile by 16 instead of 64/128 (196 tokens pad to 208, not 256) and
// need no dQ accumulation pass. Default off; FLAME_SHORT_ATTENTION=1 turns it on at start-up. The
// switch is read at every call, so a graph captured with it on replays these kernels.
void set_short_attention(bool enable);
bool short_attention();
struct ShortAttentionStats {
  uint64_t forward_calls = 0;   // sdpa forwards that ran the short kernels
  uint64_t backward_calls = 0;  // and backwards
};
// Process-wide counters (all devices); zeros in a build without CUDA.
ShortAttentionStats short_attention_stats();

}  // namespace flame::cuda
