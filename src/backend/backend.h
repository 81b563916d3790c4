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
  // ---- amp ----
  // GradScaler's fused unscale (src/amp/grad_scaler.cpp): each tensor of `grads` (floating, on
  // this device, non-overlapping and dense with non-negative strides, so its elements fill
  // [data_ptr, data_ptr + numel)) is multiplied in place by inv_scale (in float; double for f64),
  // and found_inf (0-d f32) is set to 1 when any element read is Inf or NaN, else left as it is.
  // One pass over all the tensors; no host synchronisation.
  virtual void amp_unscale(const TensorList& grads, double inv_scale, const Tensor& found_inf) = 0;
  // ---- optim ----
  // One fused update of every tensor in `tensors` (src/backend/optim_params.h; Note [Optimizer
  // element math]): one kernel launch per call on CUDA, whatever the number of tensors.
  virtual void optim_step(const OptimHyper& h, const std::vector<OptimTensor>& tensors) = 0;
  // shadow[k] += weight * (params[k] - shadow[k]) for every k (torch._foreach_lerp_); shadow and
  // params pair up by index with equal numel and dense layout; all shadows share one dtype, all
  // params one dtype.
  virtual void ema_update(const TensorList& shadow, const TensorList& params, double weight) = 0;
  // ---- epi ----
  // Fused cuBLASLt epilogues of Linear (Note [Linear epilogues] in src/ops/linear_epilogue.cpp).
  // Each returns false, writing nothing, when the backend has no fused kernel for these dtypes,
  // layouts or sizes; the op layer then runs the unfused composite, which is also the reference
  // (the CPU backend keeps these defaults). Every tensor is contiguous and of one dtype, except
  // the master-weight gradients (Note [Master-weight epilogues] in src/ops/linear_epilogue.cpp):
  // beside bf16/f16 dy and x, the wgrad's dw and dbias may be f32.
  // y [M, N] = act(x [M, K] @ w [N, K]^T + bias [N]); bias may be undefined; act is gelu_tanh when
  // `gelu`, and pre (when defined) receives the value before it.
  virtual bool linear_bias_act(const Tensor& y, const Tensor& pre, const Tensor& x, const Tensor& w,
                               const Tensor& bias, bool gelu) { return false; }
  // dw [N, K] = dy [M, N]^T @ x [M, K] and dbias [N] (when defined) = the column sums of dy, in
  // one GEMM.
  virtual bool linear_wgrad_bgrad(const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x) {
    return false;
  }
  // dpre [M, N] = (dy [M, P] @ w [P, N]) * gelu_tanh'(pre [M, N]) and dbias [N] (when defined) =
  // the column sums of dpre, in one GEMM.
  virtual bool linear_dgelu_bgrad(const Tensor& dpre, const Tensor& dbias, const Tensor& dy, const Tensor& w,
                                  const Tensor& pre) { return false; }
  // dpre = dy * gelu_tanh'(pre), elementwise over same-shape tensors.
  virtual bool gelu_tanh_backward(const Tensor& dpre, const Tensor& dy, const Tensor& pre) { return false; }
  // ---- adaln ----
  // Fused adaLN pieces of DiT-style blocks (Note [adaLN ops] in src/ops/adaln.cpp). Like the epi
  // methods each returns false, writing nothing, when the backend has no kernel for the call; the
  // op layer then composes (the CPU backend keeps these defaults: the composite is the reference).
  // x, y, dy, dx, out, ...: [B, T, D] contiguous; shift, scale, gate: [B, D] with column stride 1
  // (any row stride, e.g. chunks of one [B, k*D] projection); mean/rstd [B*T] f32 per row.
  // y = layer_norm(x) * (1 + scale) + shift, y's dtype may differ from x's (autocast). xhat, when
  // defined (y's dtype and shape), also receives the normalised x, (x - mean) * rstd: what the
  // backward reads instead of x and mean when y's dtype is narrower than x's.
  virtual bool adaln_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                             const Tensor& shift, const Tensor& scale, double eps, const Tensor& xhat) {
    return false;
  }
  // What an adaLN backward may also do (each part undefined: not done).
  struct AdalnBackwardMore {
    // dx's pending gradient sum (dx's shape and dtype, contiguous; it may be dx itself): dx =
    // base + the gradient (Note [Accumulate base] in src/autograd/backward.cpp). A backend that
    // declines it is asked again without it and the rule composes the sum.
    Tensor base;
    // The gated residual x = x_prev + gate * branch (gate [B, D] as shift, branch [B, T, D] in
    // gate's dtype) whose complete gradient the final dx is: then also dbranch = gate * dx
    // (branch's dtype, may be undefined) and dgate = sum over T of dx * branch ([B, D]
    // contiguous, gate's dtype). Note [Fused residual backward] in src/ops/adaln.cpp.
    Tensor gate, branch, dbranch, dgate;
    // With dbranch: its column sums over every row, f32 [D] contiguous, from the f32 products before
    // dbranch's rounding (the bias gradient of the Linear that made branch: Note [Gradient row
    // sums] in src/autograd/node.cpp), or undefined. A backend may leave it unwritten only by
    // declining the whole residual part.
    Tensor dbias;
  };
  // dx (x's dtype), dshift and dscale ([B, D] contiguous, the modulation's dtype; each may be
  // undefined) of the forward above given dy (y's dtype). With mean undefined, x is the x-hat the
  // forward wrote (y's dtype); dx still has the dtype of the forward's x (more.base's, or f32 when
  // x-hat is narrower and there is no base).
  virtual bool adaln_backward(const Tensor& dx, const Tensor& dshift, const Tensor& dscale, const Tensor& dy,
                              const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& scale,
                              const AdalnBackwardMore& more) {
    return false;
  }
  // h = x + gate * branch (x's dtype, branch: gate's), then y, mean, rstd (and xhat) of h as
  // adaln_forward: a gated residual and the adaLN that reads its result, in one pass over the rows.
  virtual bool adaln_residual_forward(const Tensor& h, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                                      const Tensor& x, const Tensor& gate, const Tensor& branch, const Tensor& shift,
                                      const Tensor& scale, double eps, const Tensor& xhat) {
    return false;
  }
  // out = x + gate * y (gate broadcast over T).
  virtual bool gated_residual_forward(const Tensor& out, const Tensor& x, const Tensor& gate, const Tensor& y) {
    return false;
  }
  // dy = dout * gate (y's dtype) and dgate = sum over T of dout * y ([B, D] contiguous, gate's
  // dtype); dy may be undefined.
  virtual bool gated_residual_backward(const Tensor& dy, const Tensor& dgate, const Tensor& dout, const Tensor& y,
                                       const Tensor& gate) {
    return false;
  }
  // ---- graph ----
  // (Defaults raise naming the backend's lack of support: src/backend/backend_graph.cpp.)
  // Capturable EMA (Note [Capturable optimizers], src/optim/fused_optimizer.cpp): ema_update with
  // weight = 1 - decay_at(n), n read at kernel time from `step` (0-d f64 on this device).
  virtual void ema_update_device(const TensorList& shadow, const TensorList& params, const Tensor& step,
                                 double decay, bool warmup);
  // Sync-free gradient norm (Note [Device gradient clipping], src/autograd/grad_clip_device.cpp).
  // `tensors` share one floating dtype, lie on this device and are dense; `acc` is a 0-d f64 on
  // this device. Adds sum_k sum_i |t_k[i]|^p to acc (for p = inf: acc = max(acc, max |t_k[i]|)),
  // in one multi-tensor pass (plus one single-block pass to fold the partial sums) on CUDA, in a
  // fixed order, so the result does not vary between runs.
  virtual void foreach_norm_accumulate(const TensorList& tensors, double norm_type, const Tensor& acc);
  // Multiplies every tensor in place by min(1, max_norm / (norm + 1e-6)), norm = total_norm (0-d
  // f64 on this device) read at kernel time; NaN coefficients propagate (torch.clamp). Tensors as
  // above; a coefficient of exactly 1 leaves them unwritten.
  virtual void foreach_clip_scale(const TensorList& tensors, const Tensor& total_norm, double max_norm);
};

Backend& backend_for(Device device);
Backend& cpu_backend();

}  // namespace flame::backend
