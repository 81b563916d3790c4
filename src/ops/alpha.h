#pragma once
// alpha * other for self + alpha * other (torch.add/sub's alpha), shared by add/sub/add_/sub_.
#include "flame/tensor.h"

namespace flame {
// Scales `other` in the result type of (self, other), so an integer other is not scaled (and
// wrapped) in its narrower type; returns `other` itself for alpha == 1. Raises, naming `op`, for a
// floating alpha with an integral result or a non-bool alpha with bool inputs (as PyTorch).
Tensor alpha_scaled(const char* op, const Tensor& self, const Tensor& other, Scalar alpha);
}  // namespace flame
