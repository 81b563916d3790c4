// Gradient rule of conv and conv_transpose (Note [Transposed conv] in src/ops/conv.cpp):
//   conv:       dx = backward_data(g, w),  dw = backward_filter(x, g),  db = sum of g over N, spatial
//   transposed: dx = forward(g, w),        dw = backward_filter(g, x),  db likewise
// Saved: w only when x needs a gradient, x only when w does; nothing for the bias. Each gradient
// is computed only for the inputs that need one, in the forward's layout, and the weight's
// gradient is returned in the weight's own layout.
#include "src/ops/conv_def.h"

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/conv.h"

namespace flame::op_detail {

// The record member of the conv op definition (src/ops/conv_def.h): the node of y = conv(x, w) + bias
// (bias may be undefined) when any input needs a gradient.
void ConvDef::record(Result& r, const Args& a, const Prep& pr) {
  Tensor& y = r.y;
  const Tensor &x = pr.x, &w = a.weight, &bias = a.bias;
  struct {
    backend::Backend::ConvParams params;  // a copy: the node outlives the call
    bool transposed, channels_last;
  } const rec{pr.p, a.transposed, pr.cl};
  const bool has_bias = bias.defined();
  if (!(has_bias ? needs_grad({x, w, bias}) : needs_grad({x, w}))) return;
  const bool need_x = x.requires_grad(), need_w = w.requires_grad(), need_b = has_bias && bias.requires_grad();
  SavedTensor saved_x = need_w ? SavedTensor(x, "conv") : SavedTensor();
  SavedTensor saved_w = need_x ? SavedTensor(w, "conv") : SavedTensor();
  const Shape xs = x.sizes(), ws = w.sizes();
  const bool w_cl = conv_detail::channels_last(w);
  TensorList inputs{x, w};
  if (has_bias) inputs.push_back(bias);
  const char* name = rec.transposed ? "ConvTransposeBackward" : "ConvolutionBackward";
  flame::record(y, name, inputs, [=](const Tensor& g) {
    const auto& p = rec.params;
    const bool cl = rec.channels_last;
    TensorList grads(has_bias ? 3 : 2);
    if (need_x) {
      const Tensor wv = saved_w.get();
      grads[0] = rec.transposed ? conv_detail::conv_forward(g, wv, p, xs, cl)
                                : conv_detail::conv_backward_data(g, wv, p, xs, cl);
    }
    if (need_w) {
      const Tensor xv = saved_x.get();
      Tensor dw = rec.transposed ? conv_detail::conv_backward_filter(g, xv, p, ws, cl)
                                 : conv_detail::conv_backward_filter(xv, g, p, ws, cl);
      grads[1] = conv_detail::in_layout(dw, w_cl);
    }
    if (need_b) {
      Shape dims{0};
      for (int64_t d = 2; d < g.dim(); ++d) dims.push_back(d);
      grads[2] = g.sum(dims);  // zeros for an empty batch
    }
    return grads;
  });
}

}  // namespace flame::op_detail
