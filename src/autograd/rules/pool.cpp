// Gradient rules of the pool family: the record members of its op definitions (src/ops/pool_def.h,
// Note [Invoke]). The backward passes are backend kernels (gathers over the outputs that read each
// input, Note [Pool windows]); their results need no further gradient.
#include "src/ops/pool_def.h"

#include "src/autograd/record.h"
#include "src/core/tensor_impl.h"

namespace flame::op_detail {

void Pool2dDef::record(Result& r, const Args&, const Prep& pr) {
  const Tensor& x4 = pr.x4;
  const Tensor& indices = r.indices;
  const backend::Pool2dParams& p = pr.p;
  Tensor& out = r.out;
  if (!needs_grad({x4})) return;
  const Shape xs = x4.sizes();
  SavedTensor sidx = indices.defined() ? SavedTensor(indices, "max_pool") : SavedTensor();
  flame::record(out, p.mode == backend::PoolMode::max ? "max_pool2d" : "avg_pool2d", {x4}, [xs, sidx, p](const Tensor& g) {
    Tensor gi = make_empty(xs, g.dtype(), g.device());
    if (gi.numel() > 0) {
      const Tensor idx = sidx.defined() ? sidx.get() : Tensor();
      backend::backend_for(g.device()).pool2d_backward(gi, g, idx, p);
    }
    return TensorList{gi};
  });
}

void Upsample2dDef::record(Result& r, const Args&, const Prep& pr) {
  const Tensor& x4 = pr.x4;
  const backend::Upsample2dParams& p = pr.p;
  Tensor& out = r.out;
  if (!needs_grad({x4})) return;
  const Shape xs = x4.sizes();
  const char* name = "upsample_nearest2d";
  switch (p.mode) {
    case backend::UpsampleMode::linear: name = "upsample_bilinear2d"; break;
    case backend::UpsampleMode::cubic: name = "upsample_bicubic2d"; break;
    case backend::UpsampleMode::linear_aa: name = "_upsample_bilinear2d_aa"; break;
    case backend::UpsampleMode::cubic_aa: name = "_upsample_bicubic2d_aa"; break;
    default: break;
  }
  flame::record(out, name, {x4},
         [xs, p](const Tensor& g) {
           Tensor gi = make_empty(xs, g.dtype(), g.device());
           if (gi.numel() > 0) backend::backend_for(g.device()).upsample2d_backward(gi, g, p);
           return TensorList{gi};
         });
}

void CrossEntropyRowsDef::record(Result& r, const Args& a, const Prep& pr) {
  const Tensor& logits = pr.x;
  const Tensor& target = pr.t;
  const Tensor& lse = r.lse;
  Tensor& loss = r.loss;
  const int64_t ignore_index = a.ignore_index;
  const double label_smoothing = a.label_smoothing;
  if (!needs_grad({logits})) return;
  SavedTensor sx(logits, "cross_entropy"), st(target, "cross_entropy"), sl(lse, "cross_entropy");
  flame::record(loss, "cross_entropy", {logits}, [sx, st, sl, ignore_index, label_smoothing](const Tensor& g) {
    const Tensor x = sx.get();
    Tensor gx = make_empty(x.sizes(), x.dtype(), x.device());
    if (gx.numel() > 0) {
      backend::backend_for(x.device())
          .cross_entropy_backward(gx, g.to(sl.get().dtype()).contiguous(), x, st.get(), sl.get(), ignore_index, label_smoothing);
    }
    return TensorList{gx};
  });
}

}  // namespace flame::op_detail
