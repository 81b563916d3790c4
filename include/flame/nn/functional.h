#pragma once
// torch::nn::functional in one namespace: F::relu, F::softmax, F::cross_entropy, ... next to the
// layer ops (F::conv2d, F::layer_norm, F::interpolate, F::embedding, ...). The activations and
// losses are FLAME's ops (ops.h), brought in by using-declarations, so F::relu(x) and
// flame::relu(x) are one function. `flame::F` names this namespace (as the usual
// `namespace F = torch::nn::functional;` does); `namespace F = flame::nn::functional;` still works.
// The list is in docs/nn.md, "Functional".
#include <string>

#include "flame/error.h"
#include "flame/nn/attention.h"
#include "flame/nn/conv.h"
#include "flame/nn/dropout.h"
#include "flame/nn/embedding.h"
#include "flame/nn/linear.h"
#include "flame/nn/norm.h"
#include "flame/nn/pool.h"
#include "flame/ops.h"

namespace flame::nn::functional {

// Activations.
using flame::elu;
using flame::gelu;
using flame::hardsigmoid;
using flame::hardswish;
using flame::leaky_relu;
using flame::log_softmax;
using flame::mish;
using flame::relu;
using flame::sigmoid;
using flame::silu;
using flame::softmax;
using flame::softplus;
using flame::tanh;
// F::gelu(x, "tanh") / F::gelu(x, "none"), as torch's approximate= (the bool form is flame::gelu's).
inline Tensor gelu(const Tensor& x, const std::string& approximate) {
  FLAME_CHECK(approximate == "none" || approximate == "tanh", "gelu", "approximate must be \"none\" or \"tanh\", got \"",
              approximate, "\"");
  return flame::gelu(x, approximate == "tanh");
}
inline Tensor gelu(const Tensor& x, const char* approximate) {  // a literal must not become the bool
  return gelu(x, std::string(approximate ? approximate : "(null)"));
}

// Losses (Reduction::none / mean / sum, as torch's reduction=).
using flame::Reduction;
using flame::binary_cross_entropy_with_logits;
using flame::cross_entropy;
using flame::huber_loss;
using flame::l1_loss;
using flame::mse_loss;
using flame::nll_loss;
using flame::smooth_l1_loss;

// Other torch.nn.functional ops that are FLAME ops.
using flame::one_hot;
using flame::pad;
using flame::PadMode;

}  // namespace flame::nn::functional

namespace flame {
namespace F = nn::functional;
}  // namespace flame
