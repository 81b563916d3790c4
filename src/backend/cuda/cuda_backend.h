#pragma once
// The CUDA backend. One CudaBackend per device; its work is queued on the calling thread's current
// stream (Note [Current stream]) and memory comes from its stream-ordered pool.
//
// Note [Current stream]
// Every kernel, copy, cuBLASLt call and pool allocation/free of a device goes to
// CudaBackend::stream(): the calling thread's current stream for the device (set by
// cuda::StreamGuard / cuda::set_current_stream, a thread-local per device), else the backend's own
// non-blocking default stream. Ops of one thread on one stream need no events between them, and
// freeing a tensor returns its memory in the order of the stream it was allocated on: a later op
// on that stream may reuse it only after every earlier queued op has run. Work on two streams is
// ordered only by events (cuda::Event, Stream::wait); a tensor used on a stream other than its
// allocation stream must be recorded there (cuda::record_stream, Note [Record stream]).
// The host waits only at explicit reads (copy_to_host: to_vec/item/printing), masked_select
// (data-dependent size), synchronize and empty_cache; all of them raise while the stream they
// would wait on is being captured into a CUDA graph (check_not_capturing).
#include <cuda_runtime.h>

#include <memory>

#include "flame/cuda.h"
#include "src/backend/backend.h"

namespace flame::backend::cuda {

class MemoryPool;  // src/backend/cuda/memory_pool.*

// The calling thread's current stream of `device`, or nullptr for the backend's default stream.
cudaStream_t current_stream_override(int device);
void set_current_stream_override(int device, cudaStream_t stream);

// Raises flame::Error "<op>: cannot <what> while a CUDA graph is being captured" when `stream` is
// being captured (by FLAME or by anyone else): the call would wait for the GPU or read the host.
void check_not_capturing(cudaStream_t stream, const char* op, const char* what);

// Note [Launch blocking]: FLAME_CUDA_LAUNCH_BLOCKING=1 in the environment makes every launch check
// wait for the stream and name the kernel that faulted (read once).
bool launch_blocking();

// Creates what a capture on `device` must not create itself (library handles); matmul.cu.
void prepare_capture(int device);

// Note [Deferred device errors]
// A kernel that finds invalid data (an index out of range) cannot throw. It records the first such
// error in this device-resident record (atomicCAS on `op` from 0) and skips the bad element. The
// next synchronising call of the backend (copy_to_host, synchronize, masked_select) reads the
// record, clears it and raises flame::Error naming the op and the offending value. So a bad index
// is never silently accepted, and no op pays a host round trip to validate indices.
struct DeviceErrorRecord {
  int32_t op;  // 0: none; else a DeviceErrorOp
  int32_t dim;
  int64_t value;  // the offending index
  int64_t limit;  // the size it had to be below
};
enum DeviceErrorOp : int32_t { kErrNone = 0, kErrIndexSelect, kErrGather, kErrScatter, kErrTake, kErrScatterAdd };

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  int device() const { return device_; }
  // The stream this thread's ops on this device run on (Note [Current stream]).
  cudaStream_t stream() const {
    const cudaStream_t s = current_stream_override(device_);
    return s != nullptr ? s : stream_;
  }
  cudaStream_t default_stream() const { return stream_; }
  MemoryPool& pool() { return *pool_; }
  // Device pointer to this backend's DeviceErrorRecord (Note [Deferred device errors]).
  DeviceErrorRecord* error_record() const { return error_record_; }
  // Reads the record (the caller has synchronised the stream), clears it, raises if set.
  void raise_deferred_error();

  std::shared_ptr<void> allocate(std::size_t nbytes) override;
  void copy(const Tensor& dst, const Tensor& src) override;
  void copy_from_host(const Tensor& dst, const void* host) override;
  void copy_to_host(void* host, const Tensor& src) override;
  // Waits for the current stream (Backend contract), then raises any deferred device error.
  void synchronize() override;
  // Waits for every stream of the device (cuda::synchronize).
  void synchronize_device();
  void fill(const Tensor& dst, Scalar value) override;
  void iota(const Tensor& dst, double start, double step) override;
  void unary(UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) override;
  void binary(BinaryOp op, const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void where(const Tensor& dst, const Tensor& cond, const Tensor& a, const Tensor& b) override;
  void reduce(ReduceOp op, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) override;
  void cumsum(const Tensor& dst, const Tensor& src, int64_t dim) override;
  void softmax(const Tensor& dst, const Tensor& src, int64_t dim, bool log) override;
  void matmul(const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void index_select(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) override;
  void gather(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) override;
  void scatter(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate) override;
  Tensor masked_select(const Tensor& src, const Tensor& mask) override;
  void sort(const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim, bool descending) override;
  void random(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset, double a, double b) override;
  // ---- conv ---- (cpu_conv.cpp / conv/)
  void conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) override;
  void conv_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p) override;
  void conv_backward_filter(const Tensor& dw, const Tensor& x, const Tensor& dy, const ConvParams& p) override;

  // ---- pool ----
  void pool2d(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p) override;
  void pool2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                       const Pool2dParams& p) override;
  void upsample2d(const Tensor& out, const Tensor& x, const Upsample2dParams& p) override;
  void upsample2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p) override;
  void cross_entropy(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                     int64_t ignore_index, double label_smoothing) override;
  void cross_entropy_backward(const Tensor& grad_logits, const Tensor& grad_loss, const Tensor& logits,
                              const Tensor& target, const Tensor& lse, int64_t ignore_index,
                              double label_smoothing) override;
  // Graph capture (Note [Graph-safe RNG]): seed = state[0], offset = state[1] + relative_offset,
  // read by the kernel when it runs. `state` is device memory.
  void random_from_device_state(RandomKind kind, const Tensor& dst, const uint64_t* state, uint64_t relative_offset,
                                double a, double b);

  // ---- attention ---- (attention/sdpa_cudnn.cpp: cuDNN SDPA through cudnn-frontend)
  void sdpa_forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& bias, double scale, bool causal) override;
  void sdpa_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& stats, const Tensor& bias,
                     double scale, bool causal, Tensor* column_sums) override;
  // ---- norm ----
  void norm_rows_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         const Tensor& bias, double eps) override;
  void norm_rows_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                          const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight) override;
  void group_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                          const Tensor& weight, const Tensor& bias, int64_t groups, double eps) override;
  void group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                           int64_t groups) override;
  void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& x) override;
  void batch_norm_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& weight, const Tensor& bias) override;
  void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                           bool training) override;


 private:
  void random_impl(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset, const uint64_t* state, double a,
                   double b);

  int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<MemoryPool> pool_;
  DeviceErrorRecord* error_record_ = nullptr;
};

// The backend of device `index` (created on first use); errors name the device when absent.
CudaBackend& cuda_backend(int index);

// The fused kernels the CUDA backend implements (Note [Fused kernels]), registered when a CUDA
// backend is created: epi/linear_epilogue.cu, adaln/adaln.cu.
void register_epilogue_kernels();
void register_adaln_kernels();
// and the training step's multi-tensor updates: optim/multi_tensor.cu, graph/foreach_norm.cu,
// amp/amp_unscale.cu.
void register_optim_kernels();
void register_adamw8bit_kernels();  // optim/adamw8bit.cu
void register_foreach_kernels();
void register_amp_kernels();
// and the rotary embedding: rotary/rotary.cu; the 8-bit float Linear's kernels: float8/float8.cu.
void register_rotary_kernels();
void register_rms_norm_rotary_kernels();  // rotary/rms_norm_rotary.cu
void register_matmul_add_kernel();        // matmul.cu
void register_float8_kernels();

}  // namespace flame::backend::cuda
