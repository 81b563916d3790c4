// Convolutions: argument handling and validation of conv1d/2d/3d and conv_transpose1d/2d/3d, the
// layout choice, and the calls into Backend::conv_*.
//
// Note [Conv layouts]
// A conv kernel sees every tensor either contiguous or dense channels-last (Backend::ConvParams).
// The output takes the input's memory format as PyTorch's suggest_memory_format decides it: a
// contiguous input (also when it is both, e.g. C == 1) gives a contiguous output, a channels-last
// one a channels-last output; any other view is made contiguous first. The weight is brought to
// the input's format for the kernel (cuDNN wants one layout for both), and its gradient is handed
// back in the weight's own format. 3-d tensors (conv1d) are always contiguous.
//
// Note [Transposed conv]
// conv_transpose(x, w) is the input-gradient of the conv that maps an output-sized tensor to x's
// shape with weight w: y = conv_backward_data(dy = x, w). Its gradients swap roles the same way:
// dx = conv_forward(dy, w) and dw = conv_backward_filter(conv input = dy, conv output grad = x).
#include "src/ops/conv.h"

#include <algorithm>
#include <ostream>
#include <string>

#include "flame/grad_mode.h"
#include "flame/nn/conv.h"
#include "flame/ops.h"
#include "src/core/tensor_impl.h"
#include "src/ops/conv_def.h"

namespace flame {

namespace conv_detail {

Tensor in_layout(const Tensor& t, bool cl) {
  if (cl ? dense_channels_last(t) : t.is_contiguous()) return t;
  Tensor out = empty_in_layout(t.sizes(), t.dtype(), t.device(), cl);
  backend::backend_for(t.device()).copy(out, t);
  return out;
}

namespace {
bool any_zero(const Shape& s) {
  return std::any_of(s.begin(), s.end(), [](int64_t v) { return v == 0; });
}
Tensor zeros_in_layout(const Shape& sizes, DType dtype, Device device, bool cl) {
  Tensor t = empty_in_layout(sizes, dtype, device, cl);
  if (t.numel() > 0) backend::backend_for(device).fill(t, Scalar(0.0));
  return t;
}
}  // namespace

Tensor conv_forward(const Tensor& x, const Tensor& w, const ConvParams& p, const Shape& y_shape, bool cl) {
  if (any_zero(y_shape) || x.numel() == 0 || w.numel() == 0) return zeros_in_layout(y_shape, x.dtype(), x.device(), cl);
  Tensor y = empty_in_layout(y_shape, x.dtype(), x.device(), cl);
  backend::backend_for(x.device()).conv_forward(y, in_layout(x, cl), in_layout(w, cl), p);
  return y;
}

Tensor conv_backward_data(const Tensor& dy, const Tensor& w, const ConvParams& p, const Shape& x_shape, bool cl) {
  if (any_zero(x_shape) || dy.numel() == 0 || w.numel() == 0) return zeros_in_layout(x_shape, dy.dtype(), dy.device(), cl);
  Tensor dx = empty_in_layout(x_shape, dy.dtype(), dy.device(), cl);
  backend::backend_for(dy.device()).conv_backward_data(dx, in_layout(dy, cl), in_layout(w, cl), p);
  return dx;
}

Tensor conv_backward_filter(const Tensor& x, const Tensor& dy, const ConvParams& p, const Shape& w_shape, bool cl) {
  if (any_zero(w_shape) || dy.numel() == 0 || x.numel() == 0) return zeros_in_layout(w_shape, x.dtype(), x.device(), cl);
  Tensor dw = empty_in_layout(w_shape, x.dtype(), x.device(), cl);
  backend::backend_for(x.device()).conv_backward_filter(dw, in_layout(x, cl), in_layout(dy, cl), p);
  return dw;
}

Shape expand_arg(const Shape& v, int64_t nsp, const char* op, const char* what) {
  FLAME_CHECK(v.size() == 1 || static_cast<int64_t>(v.size()) == nsp, op, what, " must have 1 or ", nsp,
              " values, got ", v);
  return v.size() == 1 ? Shape(static_cast<std::size_t>(nsp), v[0]) : v;
}

}  // namespace conv_detail

namespace nn::functional {

Padding::Padding(const char* s) {
  const std::string m = s == nullptr ? "" : s;
  if (m == "same") mode = Mode::same;
  else if (m == "valid") mode = Mode::valid;
  else FLAME_FAIL("conv", "padding must be \"same\", \"valid\" or sizes, got \"", m, "\"");
  sizes = {0};
}

bool is_channels_last(const Tensor& t) { return t.defined() && conv_detail::channels_last(t); }

Tensor to_channels_last(const Tensor& t) {
  FLAME_CHECK(t.defined() && (t.dim() == 4 || t.dim() == 5), "to_channels_last", "expected a 4-d or 5-d tensor, got ",
              t.defined() ? t.sizes() : Shape{});
  if (conv_detail::channels_last(t)) return t;
  Shape to_last{0}, back{0, t.dim() - 1};
  for (int64_t d = 2; d < t.dim(); ++d) to_last.push_back(d);
  to_last.push_back(1);
  for (int64_t d = 1; d < t.dim() - 1; ++d) back.push_back(d);
  // Through ops, so that a gradient flows back to t.
  return t.permute(to_last).contiguous().permute(back);
}

}  // namespace nn::functional

namespace op_detail {
using conv_detail::ConvParams;
using nn::functional::Padding;

namespace {
// A per-dim argument of the call: read by index, printed as a shape only when a check fails.
struct DimsView {
  const int64_t* v;
  int64_t n;
  int64_t operator[](int64_t i) const { return v[i]; }
};
std::ostream& operator<<(std::ostream& os, const DimsView& d) { return os << shape_str(Shape(d.v, d.v + d.n)); }
}  // namespace

ConvDef::Prep ConvDef::prepare(const Args& a) {
  const char* op = a.op;
  const Tensor &input = a.input, &weight = a.weight, &bias = a.bias;
  const int64_t nsp = a.nsp, nd = nsp + 2, groups = a.groups;
  Prep r;
  FLAME_CHECK(input.defined(), op, "input is undefined");
  FLAME_CHECK(weight.defined(), op, "weight is undefined");
  FLAME_CHECK(input.dim() == nd || input.dim() == nd - 1, op, "expected a ", nd - 1, "-d (unbatched) or ", nd,
              "-d (batched) input, got shape ", input.sizes());
  FLAME_CHECK(weight.dim() == nd, op, "expected a ", nd, "-d weight, got shape ", weight.sizes());
  FLAME_CHECK(is_floating(input.dtype()), op, "expected a floating input, got ", dtype_name(input.dtype()));
  FLAME_CHECK(input.dtype() == weight.dtype(), op, "input (", dtype_name(input.dtype()), ") and weight (",
              dtype_name(weight.dtype()), ") must have the same dtype");
  FLAME_CHECK(input.device() == weight.device(), op, "input is on ", input.device(), " but weight is on ",
              weight.device());
  FLAME_CHECK(groups > 0, op, "groups must be positive, got ", groups);
  r.unbatched = input.dim() == nd - 1;
  const Tensor x = r.unbatched ? input.unsqueeze(0) : input;
  const Shape& xs = x.sizes();
  const Shape& ws = weight.sizes();
  const int64_t c_in = xs[1];
  int64_t c_out = 0;
  if (!a.transposed) {
    FLAME_CHECK(ws[0] % groups == 0, op, "weight shape ", ws, ": out_channels ", ws[0], " not divisible by groups ",
                groups);
    FLAME_CHECK(ws[1] * groups == c_in, op, "input shape ", input.sizes(), " has ", c_in,
                " channels, but weight shape ", ws, " with groups ", groups, " expects ", ws[1] * groups);
    c_out = ws[0];
  } else {
    FLAME_CHECK(ws[0] == c_in, op, "input shape ", input.sizes(), " has ", c_in, " channels, but weight shape ", ws,
                " expects ", ws[0], " (weight is [in_channels, out_channels/groups, *kernel])");
    FLAME_CHECK(c_in % groups == 0, op, "in_channels ", c_in, " not divisible by groups ", groups);
    c_out = ws[1] * groups;
  }
  if (bias.defined()) {
    FLAME_CHECK(bias.dim() == 1 && bias.sizes()[0] == c_out, op, "bias must have shape [", c_out, "], got ",
                bias.sizes());
    FLAME_CHECK(bias.dtype() == input.dtype(), op, "bias (", dtype_name(bias.dtype()), ") and input (",
                dtype_name(input.dtype()), ") must have the same dtype");
    FLAME_CHECK(bias.device() == input.device(), op, "input is on ", input.device(), " but bias is on ",
                bias.device());
  }

  const DimsView stride{a.stride, nsp}, dilation{a.dilation, nsp}, out_pad{a.out_pad, nsp};
  ConvParams& p = r.p;
  p.nsp = nsp;
  p.groups = groups;
  for (int64_t i = 0; i < nsp; ++i) {
    FLAME_CHECK(stride[i] > 0, op, "stride must be positive, got ", stride);
    FLAME_CHECK(dilation[i] > 0, op, "dilation must be positive, got ", dilation);
    p.stride[i] = stride[i];
    p.dilation[i] = dilation[i];
  }
  if (a.pad_mode == Padding::Mode::explicit_sizes) {
    const DimsView pad{a.pad, nsp};
    for (int64_t i = 0; i < nsp; ++i) {
      FLAME_CHECK(pad[i] >= 0, op, "padding must be non-negative, got ", pad);
      p.pad_lo[i] = p.pad_hi[i] = pad[i];
    }
  } else if (a.pad_mode == Padding::Mode::same) {
    FLAME_CHECK(!a.transposed, op, "padding \"same\" is only for convolutions");
    for (int64_t i = 0; i < nsp; ++i) {
      FLAME_CHECK(stride[i] == 1, op, "padding=\"same\" is not supported for strided convolutions (stride ", stride,
                  ")");
      // As PyTorch: total dilation*(k-1), the odd extra zero goes after.
      const int64_t total = dilation[i] * (ws[2 + i] - 1);
      p.pad_lo[i] = total / 2;
      p.pad_hi[i] = total - total / 2;
    }
  }
  for (int64_t i = 0; i < nsp; ++i) {
    if (a.transposed) {
      FLAME_CHECK(out_pad[i] >= 0 && (out_pad[i] < stride[i] || out_pad[i] < dilation[i]), op, "output_padding ",
                  out_pad, " must be smaller than either stride ", stride, " or dilation ", dilation);
    } else {
      FLAME_CHECK(out_pad[i] == 0, op, "output_padding is only for transposed convolutions");
    }
  }

  // Output shape; for a transposed conv the roles of the two shapes swap (Note [Transposed conv]).
  r.c_out = c_out;
  Shape& ys = r.ys;
  ys = {xs[0], c_out};
  for (int64_t i = 0; i < nsp; ++i) {
    const int64_t in = xs[2 + i], k = ws[2 + i];
    const int64_t span = p.dilation[i] * (k - 1) + 1;
    if (!a.transposed) {
      const int64_t padded = in + p.pad_lo[i] + p.pad_hi[i];
      FLAME_CHECK(padded >= span, op, "kernel size (dilated) ", span, " in spatial dim ", i,
                  " is larger than the padded input size ", padded, " (input shape ", input.sizes(),
                  ", weight shape ", ws, ", padding ", p.pad_lo[i], "+", p.pad_hi[i], ", dilation ", p.dilation[i],
                  ")");
      ys.push_back((padded - span) / p.stride[i] + 1);
    } else {
      const int64_t out = (in - 1) * p.stride[i] - p.pad_lo[i] - p.pad_hi[i] + span + out_pad[i];
      FLAME_CHECK(out > 0, op, "output size ", out, " in spatial dim ", i, " is not positive (input shape ",
                  input.sizes(), ", weight shape ", ws, ", stride ", stride, ", padding ", p.pad_lo[i], ")");
      ys.push_back(out);
    }
  }

  r.cl = conv_detail::channels_last(x);
  // "same" with an even dilated kernel pads one more zero after than before. As PyTorch, the
  // extra zeros are made explicit (a pad op, with its own gradient) and the kernels only ever see
  // symmetric padding, which every cuDNN engine supports.
  Tensor& xin = r.x;
  xin = x;
  Shape extra;
  bool asymmetric = false;
  for (int64_t i = nsp - 1; i >= 0; --i) {
    extra.push_back(0);
    extra.push_back(p.pad_hi[i] - p.pad_lo[i]);
    asymmetric = asymmetric || p.pad_hi[i] != p.pad_lo[i];
  }
  if (asymmetric) {
    xin = flame::pad(x, extra);
    for (int64_t i = 0; i < nsp; ++i) p.pad_hi[i] = p.pad_lo[i];
  }
  return r;
}

ConvDef::Result ConvDef::run(const Args& a, Prep& pr) {
  const conv_detail::ConvParams& p = pr.p;
  const Tensor& xin = pr.x;
  const Shape& ys = pr.ys;
  const int64_t nd = a.nsp + 2;
  Result r;
  Tensor& y = r.y;
  NoGradGuard no_grad;  // the layout copies below are not part of the graph; the rule is
  if (!a.transposed) {
    y = conv_detail::conv_forward(xin, a.weight, p, ys, pr.cl);
  } else {
    y = conv_detail::conv_backward_data(xin, a.weight, p, ys, pr.cl);
  }
  if (a.bias.defined() && y.numel() > 0) {
    // In place through the broadcast add kernel; y is fresh, so nothing else sees the write.
    Shape bshape(static_cast<std::size_t>(nd), 1);
    bshape[1] = pr.c_out;
    const Tensor b = a.bias.reshape(bshape).expand(ys);
    backend::backend_for(y.device()).binary(backend::BinaryOp::add, y, y, b);
  }
  return r;
}

}  // namespace op_detail

namespace nn::functional {
namespace {
using conv_detail::expand_arg;

struct ConvCall {
  const char* op;
  int64_t nsp;
  bool transposed;
};

Tensor conv_impl(const ConvCall& c, const Tensor& input, const Tensor& weight, const Tensor& bias, const Shape& stride_arg,
                 const Padding& padding_arg, const Shape& dilation_arg, int64_t groups, const Shape& out_pad_arg) {
  op_detail::ConvDef::Args a;
  a.op = c.op;
  a.nsp = c.nsp;
  a.transposed = c.transposed;
  a.input = input;
  a.weight = weight;
  a.bias = bias;
  a.groups = groups;
  a.pad_mode = padding_arg.mode;
  const Shape stride = expand_arg(stride_arg, c.nsp, c.op, "stride");
  const Shape dilation = expand_arg(dilation_arg, c.nsp, c.op, "dilation");
  const Shape out_pad = expand_arg(out_pad_arg, c.nsp, c.op, "output_padding");
  for (int64_t i = 0; i < c.nsp; ++i) {
    a.stride[i] = stride[i];
    a.dilation[i] = dilation[i];
    a.out_pad[i] = out_pad[i];
  }
  if (padding_arg.mode == Padding::Mode::explicit_sizes) {
    const Shape pad = expand_arg(padding_arg.sizes, c.nsp, c.op, "padding");
    for (int64_t i = 0; i < c.nsp; ++i) a.pad[i] = pad[i];
  }
  return op_detail::invoke<op_detail::ConvDef>(a);
}

constexpr ConvCall kConv1d{"conv1d", 1, false}, kConv2d{"conv2d", 2, false}, kConv3d{"conv3d", 3, false};
constexpr ConvCall kConvT1d{"conv_transpose1d", 1, true}, kConvT2d{"conv_transpose2d", 2, true},
    kConvT3d{"conv_transpose3d", 3, true};
}  // namespace

Tensor conv1d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Ints& stride,
              const Padding& padding, const Ints& dilation, int64_t groups) {
  return conv_impl(kConv1d, input, weight, bias, stride, padding, dilation, groups, {0});
}
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Ints& stride,
              const Padding& padding, const Ints& dilation, int64_t groups) {
  return conv_impl(kConv2d, input, weight, bias, stride, padding, dilation, groups, {0});
}
Tensor conv3d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Ints& stride,
              const Padding& padding, const Ints& dilation, int64_t groups) {
  return conv_impl(kConv3d, input, weight, bias, stride, padding, dilation, groups, {0});
}
Tensor conv_transpose1d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Ints& stride,
                        const Ints& padding, const Ints& output_padding, int64_t groups, const Ints& dilation) {
  return conv_impl(kConvT1d, input, weight, bias, stride, Padding(padding.values), dilation, groups, output_padding);
}
Tensor conv_transpose2d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Ints& stride,
                        const Ints& padding, const Ints& output_padding, int64_t groups, const Ints& dilation) {
  return conv_impl(kConvT2d, input, weight, bias, stride, Padding(padding.values), dilation, groups, output_padding);
}
Tensor conv_transpose3d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Ints& stride,
                        const Ints& padding, const Ints& output_padding, int64_t groups, const Ints& dilation) {
  return conv_impl(kConvT3d, input, weight, bias, stride, Padding(padding.values), dilation, groups, output_padding);
}

}  // namespace nn::functional
}  // namespace flame
