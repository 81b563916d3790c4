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

#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/pool_def.h"

namespace flame::op_detail {

CrossEntropyRowsDef::Prep CrossEntropyRowsDef::prepare(const Args& a) {
  FLAME_CHECK(a.logits.size(0) == 0 || a.logits.size(1) > 0, "cross_entropy",
              "expected at least one class, got logits of shape ", a.logits.sizes());
  return {a.logits.contiguous(), a.target.contiguous()};
}

CrossEntropyRowsDef::Result CrossEntropyRowsDef::run(const Args& a, Prep& p) {
  const DType acc = p.x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const int64_t n = p.x.size(0);
  Result r;
  r.loss = make_empty({n}, acc, p.x.device());
  r.lse = make_empty({n}, acc, p.x.device());
  if (n > 0) backend::backend_for(p.x.device()).cross_entropy(r.loss, r.lse, p.x, p.t, a.ignore_index, a.label_smoothing);
  return r;
}

}  // namespace flame::op_detail

namespace flame::detail {

Tensor cross_entropy_rows(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing) {
  // The rule reads the contiguous logits; gradients reach `logits` through contiguous().
  return op_detail::invoke<op_detail::CrossEntropyRowsDef>({logits, target, ignore_index, label_smoothing});
}

}  // namespace flame::detail
