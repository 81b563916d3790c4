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
#include "src/amp/autocast.h"
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

// -scores[i, target[i], ...] per target element, 0 where ignored; and the mask of counted targets.
std::pair<Tensor, Tensor> pick_negated(const Tensor& scores, const Tensor& target, int64_t class_dim,
                                       int64_t ignore_index) {
  const Tensor ignored_value = Tensor::scalar(ignore_index, {DType::i64, target.device()});
  const Tensor valid = ne(target, ignored_value);
  const Tensor safe = where(valid, target, Tensor::scalar(int64_t{0}, {DType::i64, target.device()}));
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

}  // namespace

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

Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target, Reduction r) {
  if (amp::detail::should_autocast(logits)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return binary_cross_entropy_with_logits(amp::detail::cast_f32(logits), amp::detail::cast_f32(target), r);
  }
  check_pointwise("binary_cross_entropy_with_logits", logits, target);
  const DType dt = promote_types(logits.dtype(), target.dtype());
  const Tensor x = logits.to(dt), t = target.to(dt);
  // max(x, 0) - x*t + log1p(exp(-|x|)): never exponentiates a positive number.
  const Tensor loss = add(sub(relu(x), mul(x, t)), log1p(exp(neg(abs(x)))));
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
                     double label_smoothing) {
  const int64_t class_dim = check_class_target("cross_entropy", logits, target, ignore_index);
  FLAME_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "cross_entropy",
              "label_smoothing must be in [0, 1], got ", label_smoothing);
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
