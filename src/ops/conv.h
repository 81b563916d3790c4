#pragma once
// Internal convolution ops shared by the functional API (src/ops/conv.cpp) and the gradient rules
// (src/autograd/rules/conv.cpp). They validate nothing beyond what the public ops checked and
// record no autograd: the rules call them while the engine runs, without higher-order gradients.
#include "flame/tensor.h"
#include "src/backend/backend.h"
#include "src/core/memory_format.h"

namespace flame::conv_detail {

using ConvParams = backend::Backend::ConvParams;

// One value per spatial dim from a user list of 1 or nsp values (torch's int-or-tuple arguments);
// the error names `op` and the argument `what`.
Shape expand_arg(const Shape& v, int64_t nsp, const char* op, const char* what);

// t in the requested layout (t itself when it already is); no autograd recorded.
Tensor in_layout(const Tensor& t, bool cl);

// y = conv(x, w) in layout cl; y_shape is the logical output shape. Zero-size shapes give zeros.
Tensor conv_forward(const Tensor& x, const Tensor& w, const ConvParams& p, const Shape& y_shape, bool cl);
// The gradient of conv(x, w) with respect to x (shape x_shape) for upstream dy.
Tensor conv_backward_data(const Tensor& dy, const Tensor& w, const ConvParams& p, const Shape& x_shape, bool cl);
// The gradient of conv(x, w) with respect to w (shape w_shape) for upstream dy.
Tensor conv_backward_filter(const Tensor& x, const Tensor& dy, const ConvParams& p, const Shape& w_shape, bool cl);

}  // namespace flame::conv_detail
