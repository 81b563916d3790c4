// Gradient rules of the normalisation family. One node per op with inputs {x, weight, bias}; its
// backward is one fused backend call that writes only the gradients the graph needs (an input
// whose edge has no autograd meta gets none). Saved: x, the statistics (mean, rstd) and weight;
// never the normalised output, which the kernels recompute from x in registers.
#include "src/ops/norm_def.h"

#include "flame/autograd.h"
#include "src/autograd/record.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"

namespace flame::rules {
namespace {

enum class Kind : int { rows = 0, group = 1, batch = 2 };

// Saved slots, in order: x, rstd, then mean (args.need[0]), then weight (args.need[1]).
struct Saved {
  Tensor x, rstd, mean, weight;
};
Saved load(const Node& n) {
  Saved s;
  std::size_t i = 0;
  s.x = n.saved(i++);
  s.rstd = n.saved(i++);
  if (n.args().need[0]) s.mean = n.saved(i++);
  if (n.args().need[1]) s.weight = n.saved(i++);
  return s;
}

TensorList norm_backward(const Tensor& grad, const Node& n) {
  const auto& e = n.edges();
  const bool need_x = e[0].meta != nullptr;
  const bool need_w = e.size() > 1 && e[1].meta != nullptr;
  const bool need_b = e.size() > 2 && e[2].meta != nullptr;
  Saved s = load(n);
  const Device dev = s.x.device();
  Tensor dx = need_x ? make_empty(s.x.sizes(), s.x.dtype(), dev) : Tensor();
  Tensor dw = need_w ? make_empty(e[1].shape, e[1].dtype, dev) : Tensor();
  Tensor db = need_b ? make_empty(e[2].shape, e[2].dtype, dev) : Tensor();
  if (s.x.numel() == 0) {
    // Nothing was normalised: the parameters' gradients are empty sums.
    if (need_w) dw = Tensor::zeros(e[1].shape, {e[1].dtype, dev});
    if (need_b) db = Tensor::zeros(e[2].shape, {e[2].dtype, dev});
    return {dx, dw, db};
  }
  const Tensor dy = grad.to(s.x.dtype()).contiguous();
  auto& be = backend::backend_for(dev);
  switch (static_cast<Kind>(n.args().op)) {
    case Kind::rows: be.norm_rows_backward(dx, dw, db, dy, s.x, s.mean, s.rstd, s.weight); break;
    case Kind::group: be.group_norm_backward(dx, dw, db, dy, s.x, s.mean, s.rstd, s.weight, n.args().dim); break;
    case Kind::batch: be.batch_norm_backward(dx, dw, db, dy, s.x, s.mean, s.rstd, s.weight, n.args().count != 0); break;
  }
  // Note [Accumulate base] (backward.cpp): layer_norm/rms_norm take x's pending sum. The row
  // kernels do not read it yet, so the sum is composed here (the add the engine would do; in
  // place when this backward owns the base).
  if (const Tensor& base = n.accumulate_base(0); base.defined() && dx.defined()) {
    if (n.accumulate_base_owned()) {
      Tensor owned = base;
      dx = owned.add_(dx);
    } else {
      dx = base + dx;
    }
  }
  return {dx, dw, db};
}

const char* node_name(Kind k, bool rms) {
  switch (k) {
    case Kind::rows: return rms ? "RmsNormBackward" : "LayerNormBackward";
    case Kind::group: return "GroupNormBackward";
    case Kind::batch: return "BatchNormBackward";
  }
  return "NormBackward";
}

void record_norm(Tensor& y, Kind kind, const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean,
                 const Tensor& rstd, int64_t dim, int64_t count) {
  if (!needs_grad({x, weight, bias})) return;
  RuleArgs args;
  args.op = static_cast<int>(kind);
  args.dim = dim;
  args.count = count;
  args.need[0] = mean.defined();
  args.need[1] = weight.defined();
  Node& n = record(y, node_name(kind, !mean.defined()), {x, weight, bias}, &norm_backward, std::move(args));
  if (kind == Kind::rows) n.accept_accumulate_base(0);
  n.save(x);
  n.save(rstd);
  if (mean.defined()) n.save(mean);
  if (weight.defined()) n.save(weight);
}

}  // namespace

}  // namespace flame::rules

namespace flame::op_detail {
using rules::Kind;
using rules::record_norm;

// The record members of the norms' op definitions (src/ops/norm_def.h).
void NormRowsDef::record(Result& r, const Args&, const Prep& p) {
  record_norm(r.y, Kind::rows, p.x, p.weight, p.bias, r.mean, r.rstd, 0, 0);
}

void GroupNormDef::record(Result& r, const Args& a, const Prep& p) {
  record_norm(r.y, Kind::group, p.x, p.weight, p.bias, r.mean, r.rstd, a.groups, 0);
}

void BatchNormDef::record(Result& r, const Args& a, const Prep& p) {
  record_norm(r.y, Kind::batch, p.x, p.weight, p.bias, r.mean, r.rstd, 0, a.training ? 1 : 0);
}

}  // namespace flame::op_detail
