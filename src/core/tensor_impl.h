#pragma once
// Internal representation behind flame::Tensor. Not part of the public API.
#include <atomic>
#include <memory>

#include "flame/tensor.h"

namespace flame {

namespace autograd_detail {
struct Recipe;  // src/autograd/recompute.h
}

// Bytes on one device. Shared by every view of a tensor; the version counter counts in-place
// writes so that autograd can detect a saved tensor that was overwritten.
struct Storage {
  Storage(std::shared_ptr<void> data_, std::size_t nbytes_, Device device_)
      : data(std::move(data_)), nbytes(nbytes_), device(device_) {}
  std::shared_ptr<void> data;
  std::size_t nbytes;
  Device device;
  std::atomic<uint64_t> version{0};

  // CPU storage in page-locked memory from the pinned host cache (src/backend/pinned_host.h); the
  // deleter of `data` hands the block back to that cache.
  bool pinned = false;
  // Set while autograd::RecomputeCheap is active by the cheap op that wrote these bytes: how to
  // write them again (Note [Recompute cheap] in src/autograd/recompute.cpp).
  std::shared_ptr<const autograd_detail::Recipe> recipe;
};

// The bytes of a new tensor's storage on `device` (uninitialised). Core declares it, the kernels
// layer implements it (src/backend/registry.cpp: the CPU allocator's storage-in-its-block, or the
// device backend's pool), so that core reaches no backend header (Note [Layers] in docs/design.md).
std::shared_ptr<Storage> allocate_storage(Device device, std::size_t nbytes);

struct AutogradMeta;  // src/autograd/node.h

class TensorImpl {
 public:
  TensorImpl(std::shared_ptr<Storage> storage_, Shape sizes_, Shape strides_, int64_t offset_,
             DType dtype_);
  ~TensorImpl();
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;
  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;
  int64_t offset;  // elements
  DType dtype;
  int64_t numel;
  std::shared_ptr<AutogradMeta> autograd;  // null: no gradient is tracked for this tensor
  // Note [View base]: the tensor this one is a view of (always the root of the view chain, never
  // a view itself); null for tensors that own their geometry. An in-place write through a view
  // gives the base its new autograd history (src/autograd/rules/inplace.cpp).
  std::shared_ptr<TensorImpl> base;
  // On a base: counts the autograd histories in-place writes gave it. On a view: the base's count
  // when the view's history was made; a view whose base moved on regenerates its history on next
  // use (Note [In-place recording]).
  uint64_t history_version = 0;
  uint64_t base_history_seen = 0;
};

Shape contiguous_strides(const Shape& sizes);
// Element count; errors (naming op) on a negative size or a count or stride that overflows int64.
int64_t shape_numel(const Shape& sizes, const char* op = "shape");
// numel x element size; errors past kMaxTensorBytes (see src/core/checked_math.h).
int64_t shape_nbytes(const Shape& sizes, DType dtype, const char* op);
// Wraps a possibly negative dim into [0, ndim); error names the op.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// A view of t's storage with new geometry; remembers t's base (or t) as its view base. Errors
// (naming op) unless every element it reaches lies inside the storage, so no view arithmetic can
// point outside the allocation.
Tensor make_view(const Tensor& t, Shape sizes, Shape strides, int64_t offset, const char* op = "view");
// A new handle on t's storage and geometry that is nobody's view and has no autograd state
// (detach(), saved tensors, and the in-place recorder's handles on old histories).
Tensor make_alias(const Tensor& t);
// A new uninitialised contiguous tensor. Overflowing shapes and failed allocations raise an
// error naming `op` (the public op that asked for the memory) and the shape.
Tensor make_empty(const Shape& sizes, DType dtype, Device device, const char* op = "empty");
// The same, taking over a shape the caller no longer needs (no copy of it).
Tensor make_empty(Shape&& sizes, DType dtype, Device device, const char* op = "empty");
// A new uninitialised tensor with the given strides, which must be non-overlapping and dense
// (a permutation of a contiguous layout's; error naming op otherwise). Not a view: nothing else
// holds its storage, which spans exactly its elements.
Tensor make_empty_strided(const Shape& sizes, const Shape& strides, DType dtype, Device device,
                          const char* op = "empty_strided");
// PyTorch's is_non_overlapping_and_dense: the elements fill a block of numel() slots with no gaps
// and no sharing, i.e. the strides, sorted, are a contiguous layout's for the sizes in that order.
// Strides of size-1 dims are ignored (any value); negative strides are not dense; a tensor with
// no elements is dense.
bool is_non_overlapping_and_dense(const Shape& sizes, const Shape& strides);
bool is_non_overlapping_and_dense(const Tensor& t);
// True when a and b have one shape and are laid out alike: both non-overlapping and dense with
// equal strides on every dim of size > 1 (so an elementwise walk visits them in one order).
bool same_dense_layout(const Tensor& a, const Tensor& b);
// A new uninitialised tensor shaped like t, in t's layout when t is non-overlapping and dense (a
// channels-last or transposed tensor keeps its strides), else contiguous.
Tensor make_empty_in_layout_of(const Tensor& t, DType dtype, Device device, const char* op = "empty_like");
// Bumps the storage's version counter (call after every in-place write).
void bump_version(const Tensor& t);
// Errors when two elements of t share one memory location (expanded views, overlapping windows
// such as unfold with step < size); used by in-place ops. Decides exactly (Note [Internal overlap]).
void check_no_internal_overlap(const Tensor& t, const char* op);
// The decision behind check_no_internal_overlap, on raw geometry: true when two distinct indices
// address one element. Exposed for tests.
bool has_internal_overlap(const Shape& sizes, const Shape& strides);
// Errors unless all tensors are on one device.
void check_same_device(const char* op, const Tensor& a, const Tensor& b);

}  // namespace flame
