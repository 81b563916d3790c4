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
#include "src/backend/optim_params.h"
#include "src/backend/pool_params.h"
#include "src/opdef/op_list.h"

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

  // ---- conv ----
  // N-d cross-correlation (PyTorch's conv) over 1..3 spatial dims. Every tensor is logical
  // [N, C, *spatial] (weight [K, C/groups, *kernel]) with nsp + 2 dims, and is either contiguous
  // or dense channels-last (C innermost, then spatial, then N); the op layer guarantees it, checks
  // shapes and never calls with an empty tensor. Half types accumulate in float.
  struct ConvParams {
    int64_t nsp = 2;
    int64_t stride[3] = {1, 1, 1};
    int64_t pad_lo[3] = {0, 0, 0};  // zeros before each spatial dim
    int64_t pad_hi[3] = {0, 0, 0};  // zeros after ("same" with an even kernel pads asymmetrically)
    int64_t dilation[3] = {1, 1, 1};
    int64_t groups = 1;
  };
  // y = conv(x, w).
  virtual void conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) = 0;
  // dx = d<dy, conv(x, w)>/dx (overwrites dx; positions no window reaches get 0).
  virtual void conv_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p) = 0;
  // dw = d<dy, conv(x, w)>/dw (overwrites dw).
  virtual void conv_backward_filter(const Tensor& dw, const Tensor& x, const Tensor& dy, const ConvParams& p) = 0;
  // ---- attention ----
  // Fused scaled dot-product attention (flash-class: memory O(L + S), Note [Fused SDPA contract] in
  // src/ops/attention.cpp). q [B, H, L, D], k [B, H, S, D], v [B, H, S, Dv], each with stride 1 in
  // the last dim; bias (undefined = none) [B or 1, H or 1, L, S] in q's dtype, added to the scaled
  // scores; causal masks key j > query i. out [B, H, L, Dv] (any strides, last dim 1) and stats
  // [B, H, L, 1] contiguous, f32 (f64 for f64 inputs): the logsumexp of each row of scaled, biased
  // scores (-inf for a row whose every key is hidden).
  virtual void sdpa_forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& bias, double scale, bool causal) = 0;
  // Gradients of the forward above given out, its stats and dout (out's shape, last-dim stride 1);
  // dq, dk, dv have q's, k's, v's shapes (any strides, last dim 1). `column_sums` (may be null):
  // a backend whose kernels have them at no extra pass sets it to the f32 [3 * H * E] sums over
  // batches and rows of dq, dk and dv (in that order), the bias gradient of a projection that
  // produced q, k, v packed as (3, H, E); otherwise it leaves it undefined.
  virtual void sdpa_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                             const Tensor& stats, const Tensor& bias, double scale, bool causal,
                             Tensor* column_sums) = 0;
  // ---- norm ----
  // Note [Norm kernels] in src/ops/norm.cpp. Every tensor is contiguous; weight/bias may be
  // undefined (no affine); mean/rstd/var are the statistics dtype (f64 for f64 input, else f32).
  // Rows: x is [rows, cols], statistics per row; rms (mean undefined) divides by sqrt(mean(x^2)+eps).
  virtual void norm_rows_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                 const Tensor& weight, const Tensor& bias, double eps) = 0;
  // dx, dweight, dbias each only when defined; mean undefined means rms.
  virtual void norm_rows_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                  const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight) = 0;
  // Groups: x is [N, C, S]; statistics per (n, group) of C / groups channels; weight/bias per channel.
  virtual void group_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                  const Tensor& weight, const Tensor& bias, int64_t groups, double eps) = 0;
  virtual void group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                   const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                   int64_t groups) = 0;
  // Channels: x is [N, C, S]; mean and biased var per channel over N and S.
  virtual void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& x) = 0;
  // y = (x - mean[c]) * rstd[c] * weight[c] + bias[c].
  virtual void batch_norm_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                const Tensor& weight, const Tensor& bias) = 0;
  // training: mean/rstd are the batch's (their gradient flows into dx); else constants.
  virtual void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                   const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                   bool training) = 0;
  // ---- pool ----
  // Note [Pool windows] in pool_params.h. x: [N, C, H, W] any strides; out (and indices: flat
  // h*W+w of each max, i64, or i32 where the CUDA op layer keeps them internal; may be undefined)
  // contiguous [N, C, OH, OW].
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
  // Fused, model-specific kernels (a Linear's GEMM epilogues, adaLN modulation) and the training
  // step's multi-tensor updates (optimizers, EMA, GradScaler's unscale, sync-free gradient
  // clipping) are not part of this interface: src/backend/fused/ (Note [Fused kernels]).
};

Backend& backend_for(Device device);
Backend& cpu_backend();

}  // namespace flame::backend
