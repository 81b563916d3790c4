#pragma once
// The CUDA backend. One CudaBackend per device; all its work is queued on one non-default stream
// (Note [One stream per device]) and memory comes from its stream-ordered pool.
//
// Note [One stream per device]
// Every kernel, copy and library call of a device goes to CudaBackend::stream(). Ordering between
// ops therefore needs no events, and freeing a tensor returns its memory to the pool in stream
// order: a later op may reuse it only after every earlier queued op has run. The host waits only
// at explicit reads (copy_to_host: to_vec/item/printing), masked_select (data-dependent size),
// cuda::synchronize and empty_cache.
#include <cuda_runtime.h>

#include <memory>

#include "flame/cuda.h"
#include "src/backend/backend.h"

namespace flame::backend::cuda {

class MemoryPool;  // src/backend/cuda/memory_pool.*

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
  cudaStream_t stream() const { return stream_; }
  MemoryPool& pool() { return *pool_; }
  // Device pointer to this backend's DeviceErrorRecord (Note [Deferred device errors]).
  DeviceErrorRecord* error_record() const { return error_record_; }
  // Reads the record (the caller has synchronised the stream), clears it, raises if set.
  void raise_deferred_error();

  std::shared_ptr<void> allocate(std::size_t nbytes) override;
  void copy(const Tensor& dst, const Tensor& src) override;
  void copy_from_host(const Tensor& dst, const void* host) override;
  void copy_to_host(void* host, const Tensor& src) override;
  void synchronize() override;
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

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<MemoryPool> pool_;
  DeviceErrorRecord* error_record_ = nullptr;
};

// The backend of device `index` (created on first use); errors name the device when absent.
CudaBackend& cuda_backend(int index);

}  // namespace flame::backend::cuda
