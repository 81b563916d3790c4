// Simple layers: Linear (without its adapter, see lora.cpp), Embedding, Dropout, Flatten,
// Unflatten, and the summaries of the activation modules.
#include <charconv>
#include <cmath>
#include <sstream>

#include "flame/autograd.h"
#include "flame/nn/activation.h"
#include "flame/nn/dropout.h"
#include "flame/nn/embedding.h"
#include "flame/nn/flatten.h"
#include "flame/nn/init.h"
#include "flame/nn/linear.h"
#include "flame/ops.h"
#include "src/amp/autocast.h"
#include "src/ops/linear_epilogue.h"

namespace flame::nn {

std::string detail::py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip, as Python's repr
  std::string s(buf, res.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

namespace {
std::string py_bool(bool b) { return b ? "True" : "False"; }
}  // namespace

// ---- Linear ----
Tensor functional::linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: low precision, bias included
    amp::detail::AutocastOpScope scope;
    const Tensor xl = amp::detail::cast_low(x);
    if (auto y = flame::detail::linear_master(xl, weight, bias)) return *y;  // Note [Master-weight epilogues]
    return linear(xl, amp::detail::cast_low(weight), amp::detail::cast_low(bias));
  }
  FLAME_CHECK(x.defined() && weight.defined(), "linear", "undefined input or weight");
  FLAME_CHECK(weight.dim() == 2, "linear", "weight must be 2-d [out_features, in_features], got shape ",
              weight.sizes());
  FLAME_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "linear", "input of shape ", x.sizes(),
              " does not end in in_features = ", weight.size(1), " (weight shape ", weight.sizes(), ")");
  FLAME_CHECK(x.dtype() == weight.dtype(), "linear", "input dtype ", dtype_name(x.dtype()),
              " differs from weight dtype ", dtype_name(weight.dtype()));
  FLAME_CHECK(x.device() == weight.device(), "linear", "input on ", x.device().str(), ", weight on ",
              weight.device().str());
  if (bias.defined()) {
    FLAME_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), "linear", "bias must have shape [",
                weight.size(0), "], got ", bias.sizes());
    FLAME_CHECK(bias.dtype() == weight.dtype() && bias.device() == weight.device(), "linear", "bias is ",
                dtype_name(bias.dtype()), " on ", bias.device().str(), ", weight is ", dtype_name(weight.dtype()),
                " on ", weight.device().str());
  }
  if (auto fused = flame::detail::linear_bias_fused(x, weight, bias)) return *fused;  // Note [Linear epilogues]
  const int64_t in = weight.size(1), out = weight.size(0);
  Tensor y;
  if (x.dim() <= 2) {
    y = x.matmul(weight.t());
  } else {
    // One GEMM over all leading dims (rows counted explicitly: in = 0 leaves -1 ambiguous).
    Shape lead(x.sizes().begin(), x.sizes().end() - 1);
    int64_t rows = 1;
    for (int64_t d : lead) rows *= d;
    lead.push_back(out);
    y = x.reshape({rows, in}).matmul(weight.t()).reshape(lead);
  }
  return bias.defined() ? y + bias : y;
}

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, TensorOptions opts)
    : in_features_(in_features), out_features_(out_features) {
  FLAME_CHECK(in_features >= 0 && out_features >= 0, "Linear", "feature counts must be >= 0, got in_features=",
              in_features, ", out_features=", out_features);
  const TensorOptions o(opts.dtype_or(DType::f32), opts.device);
  FLAME_CHECK(is_floating(*o.dtype), "Linear", "parameters must be floating, got ", dtype_name(*o.dtype));
  Tensor w = Tensor::empty({out_features, in_features}, o);
  // kaiming_uniform(a = sqrt(5)) is U(+-1/sqrt(fan_in)); PyTorch skips zero-element tensors.
  if (w.numel() > 0) init::kaiming_uniform_(w, std::sqrt(5.0));
  weight_ = register_parameter("weight", w);
  if (bias) {
    Tensor b = Tensor::empty({out_features}, o);
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    if (b.numel() > 0) init::uniform_(b, -bound, bound);
    bias_ = register_parameter("bias", b);
  }
}

std::string Linear::extra_repr() const {
  std::string s = "in_features=" + std::to_string(in_features_) + ", out_features=" + std::to_string(out_features_) +
                  ", bias=" + py_bool(bias_.defined());
  if (is_float8())
    s += std::string(", weight=") + dtype_name(weight_.dtype()) + " (" + float8_compute_name(float8_.compute) + ")";
  return s;
}

// ---- Embedding ----
Tensor functional::embedding(const Tensor& input, const Tensor& weight, std::optional<int64_t> padding_idx) {
  FLAME_CHECK(input.defined() && weight.defined(), "embedding", "undefined input or weight");
  FLAME_CHECK(weight.dim() == 2, "embedding", "weight must be 2-d [num_embeddings, embedding_dim], got shape ",
              weight.sizes());
  Tensor out = flame::embedding(weight, input);
  if (!padding_idx || !weight.requires_grad() || !grad_enabled()) return out;
  int64_t p = *padding_idx;
  const int64_t n = weight.size(0);
  FLAME_CHECK(p >= -n && p < n, "embedding", "padding_idx ", p, " is out of range for ", n, " embeddings");
  if (p < 0) p += n;
  // The padding positions read the row through a detached weight: same values, no gradient.
  const Tensor at_pad = input.eq(Tensor::scalar(p, TensorOptions(input.dtype(), input.device()))).unsqueeze(-1);
  return where(at_pad, flame::embedding(weight.detach(), input), out);
}

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx,
                     TensorOptions opts)
    : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {
  FLAME_CHECK(num_embeddings >= 0 && embedding_dim >= 0, "Embedding", "sizes must be >= 0, got ", num_embeddings,
              " x ", embedding_dim);
  if (padding_idx) {
    int64_t p = *padding_idx;
    FLAME_CHECK(p >= -num_embeddings && p < num_embeddings, "Embedding", "padding_idx ", p,
                " is out of range for ", num_embeddings, " embeddings");
    padding_idx_ = p < 0 ? p + num_embeddings : p;
  }
  const TensorOptions o(opts.dtype_or(DType::f32), opts.device);
  Tensor w = Tensor::empty({num_embeddings, embedding_dim}, o);
  if (w.numel() > 0) init::normal_(w);
  if (padding_idx_) {
    NoGradGuard no_grad;
    w.select(0, *padding_idx_).fill_(0);
  }
  weight_ = register_parameter("weight", w);
}

std::string Embedding::extra_repr() const {
  std::string s = std::to_string(num_embeddings_) + ", " + std::to_string(embedding_dim_);
  if (padding_idx_) s += ", padding_idx=" + std::to_string(*padding_idx_);
  return s;
}

Tensor Embedding::forward(const Tensor& input) { return functional::embedding(input, weight_, padding_idx_); }

// ---- Dropout ----
Tensor functional::dropout(const Tensor& x, double p, bool training, Generator* gen) {
  FLAME_CHECK(x.defined(), "dropout", "undefined input");
  FLAME_CHECK(p >= 0.0 && p <= 1.0, "dropout", "probability must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  FLAME_CHECK(is_floating(x.dtype()), "dropout", "needs a floating input, got ", dtype_name(x.dtype()));
  if (p == 1.0) return x * 0.0;  // all dropped; the gradient is zero, as PyTorch
  // keep ~ Bernoulli(1 - p), drawn in the input's dtype on its device (Philox: device independent).
  const Tensor keep = Tensor::bernoulli(x.sizes(), 1.0 - p, TensorOptions(x.dtype(), x.device()), gen);
  return x * keep * (1.0 / (1.0 - p));
}

Dropout::Dropout(double p, Generator* gen) : p_(p), gen_(gen) {
  FLAME_CHECK(p >= 0.0 && p <= 1.0, "Dropout", "probability must be in [0, 1], got ", p);
}

std::string Dropout::extra_repr() const { return "p=" + detail::py_float(p_) + ", inplace=False"; }

Tensor Dropout::forward(const Tensor& x) { return functional::dropout(x, p_, is_training(), gen_); }

// ---- Flatten / Unflatten ----
std::string Flatten::extra_repr() const {
  return "start_dim=" + std::to_string(start_dim_) + ", end_dim=" + std::to_string(end_dim_);
}
Tensor Flatten::forward(const Tensor& x) { return x.flatten(start_dim_, end_dim_); }

std::string Unflatten::extra_repr() const {
  std::string s = "dim=" + std::to_string(dim_) + ", unflattened_size=(";
  for (std::size_t i = 0; i < sizes_.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes_[i]);
  return s + (sizes_.size() == 1 ? ",)" : ")");
}
Tensor Unflatten::forward(const Tensor& x) { return x.unflatten(dim_, sizes_); }

// ---- activations ----
GELU::GELU(std::string approximate) : approximate_(std::move(approximate)) {
  FLAME_CHECK(approximate_ == "none" || approximate_ == "tanh", "GELU", "approximate must be 'none' or 'tanh', got '",
              approximate_, "'");
}
std::string LeakyReLU::extra_repr() const { return "negative_slope=" + detail::py_float(slope_); }
std::string ELU::extra_repr() const { return "alpha=" + detail::py_float(alpha_); }
std::string Softplus::extra_repr() const {
  return "beta=" + detail::py_float(beta_) + ", threshold=" + detail::py_float(threshold_);
}

}  // namespace flame::nn
