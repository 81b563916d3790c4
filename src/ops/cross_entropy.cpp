// Note [Fused cross-entropy]
// cross_entropy over [N, V] logits runs as two row kernels instead of log_softmax + gather: the
// forward makes one pass per row (online max / sum of exp, the sum of the logits for label
// smoothing, the target logit) and keeps only the per-row loss and logsumexp [N]; the backward
// writes (softmax - (1 - eps) * onehot - eps / V) * grad straight into the logits gradient, in the
// logits' dtype. Half logits compute in float. Ignored rows (target == ignore_index) give loss 0
// and gradient 0; the mean's count of valid rows is formed by the op (loss.cpp). Scores with
// spatial dims [N, C, d...] keep the composite (log_softmax + gather), which is also the reference
// the tests compare the fused path with.
#include "src/ops/cross_entropy.h"

#include "src/autograd/rules/pool.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"

namespace flame::detail {

Tensor cross_entropy_rows(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing) {
  const Tensor x = logits.contiguous();
  const Tensor t = target.contiguous();
  const DType acc = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const int64_t n = x.size(0);
  Tensor loss = make_empty({n}, acc, x.device());
  Tensor lse = make_empty({n}, acc, x.device());
  if (n > 0) {
    FLAME_CHECK(x.size(1) > 0, "cross_entropy", "expected at least one class, got logits of shape ", logits.sizes());
    backend::backend_for(x.device()).cross_entropy(loss, lse, x, t, ignore_index, label_smoothing);
  }
  // The rule reads x (the contiguous logits); gradients reach `logits` through contiguous().
  rules::cross_entropy(loss, x, t, lse, ignore_index, label_smoothing);
  return loss;
}

}  // namespace flame::detail
