// Losses, written as composites of public ops so every backend runs them and autograd
// differentiates them through the rules of their parts.
//
// Note [Class-index losses]
// cross_entropy and nll_loss take scores [N, C, d1, ...] (or [C]) and i64 class indices
// [N, d1, ...] (or []), as PyTorch. A target equal to ignore_index contributes 0 and is left out of
// the mean's count (a mean over only ignored targets is 0/0 = nan, as PyTorch). Ignored entries are
// replaced by class 0 before the gather so that it only sees valid indices; any other index outside
// [0, C) is an error: checked here for CPU tensors (naming the op), by the gather kernel elsewhere
// (reading a device tensor here would synchronise). Half-precision losses are summed in f32.
#include <cmath>
#include <optional>

#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/core/tensor_impl.h"
#include "src/ops/cross_entropy.h"

namespace flame {
namespace {

// The dtype reductions of a `dt` loss accumulate in.
DType accumulate_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

Tensor reduce_loss(const Tensor& loss, Reduction r) {
  switch (r) {
    case Reduction::none: return loss;
    case Reduction::mean: return mean(loss.to(accumulate_dtype(loss.dtype()))).to(loss.dtype());
    case Reduction::sum: return sum(loss.to(accumulate_dtype(loss.dtype()))).to(loss.dtype());
  }
  FLAME_FAIL("loss", "unknown reduction ", static_cast<int>(r));
}

// Checks of the elementwise losses: same device, equal shapes, floating dtypes.
void check_pointwise(const char* op, const Tensor& input, const Tensor& target) {
  FLAME_CHECK(input.defined() && target.defined(), op, "got an undefined tensor");
  check_same_device(op, input, target);
  FLAME_CHECK(input.sizes() == target.sizes(), op, "input shape ", input.sizes(), " and target shape ",
              target.sizes(), " differ");
  FLAME_CHECK(is_floating(input.dtype()) && is_floating(target.dtype()), op,
              "expected floating input and target, got ", dtype_name(input.dtype()), " and ",
              dtype_name(target.dtype()), " (shape ", input.sizes(), ")");
}

// Validates scores/target per Note [Class-index losses]; returns the class dim.
int64_t check_class_target(const char* op, const Tensor& scores, const Tensor& target, int64_t ignore_index) {
  FLAME_CHECK(scores.defined() && target.defined(), op, "got an undefined tensor");
  check_same_device(op, scores, target);
  FLAME_CHECK(is_floating(scores.dtype()), op, "expected floating scores, got ", dtype_name(scores.dtype()),
              " (shape ", scores.sizes(), ")");
  FLAME_CHECK(target.dtype() == DType::i64, op, "expected i64 class indices as target, got ",
              dtype_name(target.dtype()), " (shape ", target.sizes(), ")");
  FLAME_CHECK(scores.dim() >= 1, op, "expected scores of shape [C], [N, C] or [N, C, d1, ...], got ",
              scores.sizes());
  const int64_t class_dim = scores.dim() == 1 ? 0 : 1;
  Shape want = scores.sizes();
  want.erase(want.begin() + class_dim);
  FLAME_CHECK(target.sizes() == want, op, "scores of shape ", scores.sizes(), " need a target of shape ", want,
              ", got ", target.sizes());
  const int64_t classes = scores.size(class_dim);
  if (target.device().is_cpu() && target.numel() > 0) {
    const Tensor t = target.contiguous();
    const int64_t* p = t.data<int64_t>();
    for (int64_t i = 0, n = t.numel(); i < n; ++i) {
      FLAME_CHECK(p[i] == ignore_index || (p[i] >= 0 && p[i] < classes), op, "target ", p[i],
                  " is out of range for ", classes, " classes (scores shape ", scores.sizes(), ", target shape ",
                  target.sizes(), ", ignore_index ", ignore_index, ")");
    }
  }
  return class_dim;
}

// The mask of counted targets, and the targets with ignored entries replaced by class 0.
std::pair<Tensor, Tensor> valid_and_safe(const Tensor& target, int64_t ignore_index) {
  const Tensor ignored_value = Tensor::scalar(ignore_index, {DType::i64, target.device()});
  const Tensor valid = ne(target, ignored_value);
  return {valid, where(valid, target, Tensor::scalar(int64_t{0}, {DType::i64, target.device()}))};
}

// -scores[i, target[i], ...] per target element, 0 where ignored; and the mask of counted targets.
std::pair<Tensor, Tensor> pick_negated(const Tensor& scores, const Tensor& target, int64_t class_dim,
                                       int64_t ignore_index) {
  const auto [valid, safe] = valid_and_safe(target, ignore_index);
  const Tensor picked = gather(scores, class_dim, safe.unsqueeze(class_dim)).squeeze(class_dim);
  const Tensor zero = Tensor::scalar(0.0, {scores.dtype(), scores.device()});
  return {where(valid, neg(picked), zero), valid};
}

// Reduction of a class-index loss: the mean divides by the number of counted targets.
Tensor reduce_class_loss(const Tensor& loss, const Tensor& valid, Reduction r) {
  if (r != Reduction::mean) return reduce_loss(loss, r);
  const DType acc = accumulate_dtype(loss.dtype());
  return div(sum(loss.to(acc)), sum(valid.to(acc))).to(loss.dtype());
}

// A [C] class-weight vector: checked against the scores, then shaped to broadcast along class_dim.
Tensor class_weight(const char* op, const Tensor& weight, const Tensor& scores, int64_t class_dim) {
  check_same_device(op, scores, weight);
  const int64_t classes = scores.size(class_dim);
  FLAME_CHECK(is_floating(weight.dtype()) && weight.dim() == 1 && weight.size(0) == classes, op,
              "weight must be a floating vector of one entry per class (", classes, " for scores of shape ",
              scores.sizes(), "), got ", weight.sizes(), " ", dtype_name(weight.dtype()));
  Shape shape(static_cast<std::size_t>(scores.dim()), 1);
  shape[static_cast<std::size_t>(class_dim)] = classes;
  return weight.to(scores.dtype()).reshape(shape);
}

// Class indices with class weights (and label smoothing), as PyTorch: the mean divides by the sum
// of the weights of the counted targets; the smoothing term weights each class's -log p too.
Tensor weighted_class_cross_entropy(const Tensor& logits, const Tensor& target, Reduction r, int64_t ignore_index,
                                    double label_smoothing, const Tensor& weight, int64_t class_dim) {
  const Tensor logp = log_softmax(logits, class_dim);
  const Tensor wb = class_weight("cross_entropy", weight, logp, class_dim);
  const auto [valid, safe] = valid_and_safe(target, ignore_index);
  const Tensor zero = Tensor::scalar(0.0, {logp.dtype(), logp.device()});
  const Tensor w_target =
      where(valid, index_select(wb.reshape({-1}), 0, safe.reshape({-1})).reshape(target.sizes()), zero);
  Tensor loss = mul(pick_negated(logp, target, class_dim, ignore_index).first, w_target);
  if (label_smoothing > 0.0) {
    const double classes = static_cast<double>(logits.size(class_dim));
    const Tensor smooth = where(valid, neg(sum(mul(logp, wb), {class_dim})), zero);
    loss = add(mul_scalar(loss, 1.0 - label_smoothing), mul_scalar(smooth, label_smoothing / classes));
  }
  if (r != Reduction::mean) return reduce_loss(loss, r);
  const DType acc = accumulate_dtype(loss.dtype());
  return div(sum(loss.to(acc)), sum(w_target.to(acc))).to(loss.dtype());
}

// Class probabilities (target of the logits' shape), as PyTorch: -sum_c w_c t_c log p_c per
// element, t smoothed towards 1/C; the mean is over the elements (not the weights).
Tensor prob_cross_entropy(const Tensor& logits, const Tensor& target, Reduction r, int64_t ignore_index,
                          double label_smoothing, const Tensor& weight) {
  const char* op = "cross_entropy";
  check_same_device(op, logits, target);
  FLAME_CHECK(is_floating(logits.dtype()), op, "expected floating scores, got ", dtype_name(logits.dtype()),
              " (shape ", logits.sizes(), ")");
  FLAME_CHECK(target.sizes() == logits.sizes() && logits.dim() >= 1, op,
              "a floating target holds class probabilities and needs the scores' shape ", logits.sizes(), ", got ",
              target.sizes(), " (class indices are i64)");
  FLAME_CHECK(ignore_index < 0, op, "ignore_index is not supported for class-probability targets, got ",
              ignore_index);
  const int64_t class_dim = logits.dim() == 1 ? 0 : 1;
  const DType dt = promote_types(logits.dtype(), target.dtype());
  const Tensor logp = log_softmax(logits.to(dt), class_dim);
  Tensor t = target.to(dt);
  if (label_smoothing > 0.0) {
    const double classes = static_cast<double>(logits.size(class_dim));
    t = add_scalar(mul_scalar(t, 1.0 - label_smoothing), label_smoothing / classes);
  }
  Tensor prod = mul(logp, t);
  if (weight.defined()) prod = mul(prod, class_weight(op, weight, logp, class_dim));
  return reduce_loss(neg(sum(prod, {class_dim})), r);
}

// |d| below `knee`: d^2 * quad_scale; above: (|d| - knee / 2) * slope (smooth_l1: 0.5 / beta and 1,
// huber: 0.5 and delta).
Tensor piecewise_quadratic(const Tensor& input, const Tensor& target, double knee, double quad_scale, double slope) {
  const Tensor d = sub(input, target);
  const Tensor z = abs(d);
  const Tensor below = lt(z, Tensor::scalar(knee, {z.dtype(), z.device()}));
  return where(below, mul_scalar(square(d), quad_scale), mul_scalar(add_scalar(z, -0.5 * knee), slope));
}

// `t` broadcast to shape `shape` without growing it (BCE's weight and pos_weight).
void check_broadcasts_to(const char* op, const char* what, const Tensor& t, const Tensor& x) {
  check_same_device(op, x, t);
  FLAME_CHECK(is_floating(t.dtype()), op, what, " must be floating, got ", dtype_name(t.dtype()));
  bool fits = t.dim() <= x.dim();
  for (int64_t i = 1; fits && i <= t.dim(); ++i) fits = t.size(-i) == 1 || t.size(-i) == x.size(-i);
  FLAME_CHECK(fits, op, what, " of shape ", t.sizes(), " does not broadcast to the logits' shape ", x.sizes(),
              " (a [C] ", what, " weights the last dim)");
}

}  // namespace

Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, Reduction r, double beta) {
  if (amp::detail::should_autocast(input)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return smooth_l1_loss(amp::detail::cast_f32(input), amp::detail::cast_f32(target), r, beta);
  }
  check_pointwise("smooth_l1_loss", input, target);
  FLAME_CHECK(beta >= 0.0 && std::isfinite(beta), "smooth_l1_loss", "beta must be finite and non-negative, got ",
              beta);
  if (beta == 0.0) return l1_loss(input, target, r);  // PyTorch's choice too (no 0/0)
  return reduce_loss(piecewise_quadratic(input, target, beta, 0.5 / beta, 1.0), r);
}

Tensor huber_loss(const Tensor& input, const Tensor& target, Reduction r, double delta) {
  if (amp::detail::should_autocast(input)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return huber_loss(amp::detail::cast_f32(input), amp::detail::cast_f32(target), r, delta);
  }
  check_pointwise("huber_loss", input, target);
  FLAME_CHECK(delta > 0.0 && std::isfinite(delta), "huber_loss", "delta must be finite and positive, got ", delta);
  return reduce_loss(piecewise_quadratic(input, target, delta, 0.5, delta), r);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction r) {
  if (amp::detail::should_autocast(input)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return mse_loss(amp::detail::cast_f32(input), amp::detail::cast_f32(target), r);
  }
  check_pointwise("mse_loss", input, target);
  return reduce_loss(square(sub(input, target)), r);
}

Tensor l1_loss(const Tensor& input, const Tensor& target, Reduction r) {
  if (amp::detail::should_autocast(input)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return l1_loss(amp::detail::cast_f32(input), amp::detail::cast_f32(target), r);
  }
  check_pointwise("l1_loss", input, target);
  return reduce_loss(abs(sub(input, target)), r);
}

Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target, Reduction r, const Tensor& weight,
                                        const Tensor& pos_weight) {
  const char* op = "binary_cross_entropy_with_logits";
  if (amp::detail::should_autocast(logits)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return binary_cross_entropy_with_logits(amp::detail::cast_f32(logits), amp::detail::cast_f32(target), r,
                                            amp::detail::cast_f32(weight), amp::detail::cast_f32(pos_weight));
  }
  check_pointwise(op, logits, target);
  const DType dt = promote_types(logits.dtype(), target.dtype());
  const Tensor x = logits.to(dt), t = target.to(dt);
  const Tensor softplus_neg_abs = log1p(exp(neg(abs(x))));  // never exponentiates a positive number
  Tensor loss;
  if (pos_weight.defined()) {
    check_broadcasts_to(op, "pos_weight", pos_weight, x);
    // (1 - t) x + (1 + (pos_weight - 1) t) (log1p(exp(-|x|)) + max(-x, 0)), PyTorch's form.
    const Tensor log_weight = add_scalar(mul(add_scalar(pos_weight.to(dt), -1.0), t), 1.0);
    loss = add(mul(rsub_scalar(t, 1.0), x), mul(log_weight, add(softplus_neg_abs, relu(neg(x)))));
  } else {
    // max(x, 0) - x*t + log1p(exp(-|x|)).
    loss = add(sub(relu(x), mul(x, t)), softplus_neg_abs);
  }
  if (weight.defined()) {
    check_broadcasts_to(op, "weight", weight, x);
    loss = mul(loss, weight.to(dt));
  }
  return reduce_loss(loss, r);
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction r, int64_t ignore_index) {
  if (amp::detail::should_autocast(log_probs)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return nll_loss(amp::detail::cast_f32(log_probs), target, r, ignore_index);
  }
  const int64_t class_dim = check_class_target("nll_loss", log_probs, target, ignore_index);
  auto [loss, valid] = pick_negated(log_probs, target, class_dim, ignore_index);
  return reduce_class_loss(loss, valid, r);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction r, int64_t ignore_index,
                     double label_smoothing, const Tensor& weight) {
  FLAME_CHECK(logits.defined() && target.defined(), "cross_entropy", "got an undefined tensor");
  FLAME_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "cross_entropy",
              "label_smoothing must be in [0, 1], got ", label_smoothing);
  if (is_floating(target.dtype()) || weight.defined()) {  // composites; Note [Autocast policy]: f32
    if (amp::detail::should_autocast(logits)) {
      amp::detail::AutocastOpScope scope;
      const Tensor t = is_floating(target.dtype()) ? amp::detail::cast_f32(target) : target;
      return cross_entropy(amp::detail::cast_f32(logits), t, r, ignore_index, label_smoothing,
                           amp::detail::cast_f32(weight));
    }
    if (is_floating(target.dtype())) return prob_cross_entropy(logits, target, r, ignore_index, label_smoothing, weight);
    const int64_t class_dim = check_class_target("cross_entropy", logits, target, ignore_index);
    return weighted_class_cross_entropy(logits, target, r, ignore_index, label_smoothing, weight, class_dim);
  }
  const int64_t class_dim = check_class_target("cross_entropy", logits, target, ignore_index);
  // Note [Autocast policy]: the loss is f32. [N, C] logits keep the fused kernel (it computes in
  // float from half logits) and only skip the cast of the f32 loss back down; the composite path
  // casts the logits up.
  std::optional<DType> out_dtype;
  std::optional<amp::detail::AutocastOpScope> scope;  // held to the end: nothing below casts again
  if (amp::detail::should_autocast(logits)) {
    scope.emplace();
    if (logits.dim() > 2) return cross_entropy(amp::detail::cast_f32(logits), target, r, ignore_index, label_smoothing);
    if (is_floating(logits.dtype()) && logits.dtype() != DType::f64) out_dtype = DType::f32;
  }
  // Note [Fused cross-entropy]: [C] and [N, C] scores take the fused row kernels (no [N, C]
  // log-softmax is materialised); scores with extra dims [N, C, d...] keep the composite below.
  if (logits.dim() <= 2) {
    const Tensor x2 = logits.dim() == 1 ? logits.unsqueeze(0) : logits;
    const Tensor t1 = target.reshape({x2.size(0)});
    const Tensor rows = detail::cross_entropy_rows(x2, t1, ignore_index, label_smoothing);
    const Tensor valid = ne(t1, Tensor::scalar(ignore_index, {DType::i64, target.device()}));
    const DType dt = out_dtype.value_or(logits.dtype());
    if (r == Reduction::none) return rows.to(dt).reshape(target.sizes());
    return reduce_class_loss(rows, valid, r).to(dt);
  }
  const Tensor logp = log_softmax(logits, class_dim);
  auto [loss, valid] = pick_negated(logp, target, class_dim, ignore_index);
  if (label_smoothing > 0.0) {
    // eps * mean over classes of -log p, also 0 where ignored.
    const int64_t classes = logits.size(class_dim);
    const Tensor smooth = mul_scalar(sum(logp, {class_dim}), -label_smoothing / static_cast<double>(classes));
    const Tensor zero = Tensor::scalar(0.0, {logits.dtype(), logits.device()});
    loss = add(mul_scalar(loss, 1.0 - label_smoothing), where(valid, smooth, zero));
  }
  return reduce_class_loss(loss, valid, r);
}

}  // namespace flame
