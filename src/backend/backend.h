#pragma once
// Note [Backend seam]
// Op functions (src/ops) validate inputs, decide output shape and dtype, allocate the output and
// then call one of these kernels. A backend never allocates user-visible results except where the
// size depends on data (masked_select). Kernel contracts:
//  - every tensor argument lives on the backend's device;
//  - elementwise inputs are already broadcast (expanded, stride-0 views) to the output's shape and,
//    except for `copy`, converted to one common dtype; the output is that dtype or bool;
//  - outputs are freshly allocated or checked by the op layer not to overlap themselves.
#include <cstdint>
#include <memory>

#include "flame/tensor.h"
#include "src/backend/pool_params.h"
#include "src/ops/op_list.h"

namespace flame::backend {

enum class ReduceOp : uint8_t { sum, mean, prod, max, min, argmax, argmin, any, all };
enum class RandomKind : uint8_t { uniform, normal, integer };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::shared_ptr<void> allocate(std::size_t nbytes) = 0;

  // dst[i] = convert(src[i]); src has dst's shape (maybe expanded) and any dtype.
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;
  // Between this device and contiguous host memory of the same dtype.
  virtual void copy_from_host(const Tensor& dst_contiguous, const void* host) = 0;
  virtual void copy_to_host(void* host, const Tensor& src_contiguous) = 0;
  virtual void synchronize() = 0;

  virtual void fill(const Tensor& dst, Scalar value) = 0;
  virtual void iota(const Tensor& dst, double start, double step) = 0;  // dst[i] = start + i*step
  virtual void unary(UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) = 0;
  virtual void binary(BinaryOp op, const Tensor& dst, const Tensor& a, const Tensor& b) = 0;
  virtual void where(const Tensor& dst, const Tensor& cond, const Tensor& a, const Tensor& b) = 0;

  // src's last `reduce_ndim` dims are reduced; its leading dims match dst (contiguous) one to one.
  virtual void reduce(ReduceOp op, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) = 0;
  virtual void cumsum(const Tensor& dst, const Tensor& src, int64_t dim) = 0;
  virtual void softmax(const Tensor& dst, const Tensor& src, int64_t dim, bool log) = 0;
  // dst [B, M, N] (contiguous) = a [B, M, K] @ b [B, K, N]; a, b may be strided (batch stride 0).
  virtual void matmul(const Tensor& dst, const Tensor& a, const Tensor& b) = 0;

  // index is i64 and contiguous; out-of-range entries raise flame::Error naming the op.
  virtual void index_select(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) = 0;
  virtual void gather(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) = 0;
  // dst (already holding the input) gets src's values at index along dim; accumulate adds.
  virtual void scatter(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src,
                       bool accumulate) = 0;
  // src and mask (bool) have the same shape; returns the selected elements, 1-d.
  virtual Tensor masked_select(const Tensor& src, const Tensor& mask) = 0;
  // Stable sort along dim; indices are i64.
  virtual void sort(const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim,
                    bool descending) = 0;

  // uniform: [a, b); normal: mean a, std b; integer: [a, b). See random.h for the stream.
  virtual void random(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset, double a,
                      double b) = 0;

  // ---- pool ----
  // Note [Pool windows] in pool_params.h. x: [N, C, H, W] any strides; out (and indices, i64, flat
  // h*W+w of each max; may be undefined) contiguous [N, C, OH, OW].
  virtual void pool2d(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p) = 0;
  // grad_in contiguous [N, C, H, W] (overwritten); grad_out [N, C, OH, OW] any strides; indices
  // contiguous (max only).
  virtual void pool2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                               const Pool2dParams& p) = 0;
  virtual void upsample2d(const Tensor& out, const Tensor& x, const Upsample2dParams& p) = 0;
  virtual void upsample2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p) = 0;
  // Fused cross-entropy over rows of contiguous logits [N, V] and i64 targets [N]: loss and lse
  // [N] (f32, f64 for f64 logits); ignored rows give loss 0. Backward writes grad_logits [N, V]
  // (logits' dtype) = (softmax - smoothed one-hot) * grad_loss[row].
  virtual void cross_entropy(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                             int64_t ignore_index, double label_smoothing) = 0;
  virtual void cross_entropy_backward(const Tensor& grad_logits, const Tensor& grad_loss, const Tensor& logits,
                                      const Tensor& target, const Tensor& lse, int64_t ignore_index,
                                      double label_smoothing) = 0;
};

Backend& backend_for(Device device);
Backend& cpu_backend();

}  // namespace flame::backend
