// Convolution modules (include/flame/nn/conv_layers.h) and Conv2d's LoRA adapter.
#include "flame/nn/conv_layers.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "flame/autograd.h"
#include "flame/nn/dropout.h"
#include "flame/nn/flatten.h"
#include "flame/nn/init.h"
#include "flame/ops.h"
#include "src/ops/conv.h"

namespace flame::nn {
namespace {

using conv_detail::expand_arg;


std::string tuple_str(const Shape& v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  if (v.size() == 1) s << ",";
  s << ")";
  return s.str();
}

}  // namespace

ConvNd::ConvNd(int64_t nsp, bool transposed, int64_t in_channels, int64_t out_channels, const Shape& kernel_size,
               const Shape& stride, const functional::Padding& padding, const Shape& dilation, int64_t groups,
               bool bias, const Shape& output_padding, TensorOptions opts)
    : nsp_(nsp), transposed_(transposed), in_channels_(in_channels), out_channels_(out_channels),
      padding_(padding), groups_(groups) {
  // Errors name the layer ("Conv2d: kernel_size must be > 0, ...").
  const std::string layer = (transposed ? "ConvTranspose" : "Conv") + std::to_string(nsp) + "d";
  const char* op = layer.c_str();
  FLAME_CHECK(in_channels > 0 && out_channels > 0, op, "channel counts must be > 0, got in_channels=", in_channels,
              ", out_channels=", out_channels);
  FLAME_CHECK(groups > 0 && in_channels % groups == 0 && out_channels % groups == 0, op, "groups=", groups,
              " must divide in_channels=", in_channels, " and out_channels=", out_channels);
  kernel_ = expand_arg(kernel_size, nsp, op, "kernel_size");
  stride_ = expand_arg(stride, nsp, op, "stride");
  dilation_ = expand_arg(dilation, nsp, op, "dilation");
  output_padding_ = expand_arg(output_padding, nsp, op, "output_padding");
  if (padding_.mode == functional::Padding::Mode::explicit_sizes)
    padding_.sizes = expand_arg(padding_.sizes, nsp, op, "padding");
  for (int64_t k : kernel_) FLAME_CHECK(k > 0, op, "kernel_size must be > 0, got ", kernel_);

  const TensorOptions o(opts.dtype_or(DType::f32), opts.device);
  FLAME_CHECK(is_floating(*o.dtype), op, "parameters must be floating, got ", dtype_name(*o.dtype));
  Shape wshape = transposed ? Shape{in_channels, out_channels / groups} : Shape{out_channels, in_channels / groups};
  wshape.insert(wshape.end(), kernel_.begin(), kernel_.end());
  Tensor w = Tensor::empty(wshape, o);
  init::kaiming_uniform_(w, std::sqrt(5.0));
  weight_ = register_parameter("weight", w);
  if (bias) {
    const int64_t fan_in = init::calculate_fan_in_and_fan_out(w).first;
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    Tensor b = Tensor::empty({out_channels}, o);
    init::uniform_(b, -bound, bound);
    bias_ = register_parameter("bias", b);
  }
}

Tensor ConvNd::conv(const Tensor& x, const Tensor& w, const Tensor& b) const {
  using namespace functional;
  if (transposed_) {
    const Shape& pad = padding_.sizes;
    switch (nsp_) {
      case 1: return conv_transpose1d(x, w, b, stride_, pad, output_padding_, groups_, dilation_);
      case 2: return conv_transpose2d(x, w, b, stride_, pad, output_padding_, groups_, dilation_);
      default: return conv_transpose3d(x, w, b, stride_, pad, output_padding_, groups_, dilation_);
    }
  }
  switch (nsp_) {
    case 1: return conv1d(x, w, b, stride_, padding_, dilation_, groups_);
    case 2: return conv2d(x, w, b, stride_, padding_, dilation_, groups_);
    default: return conv3d(x, w, b, stride_, padding_, dilation_, groups_);
  }
}

Tensor ConvNd::forward(const Tensor& x) { return conv(x, weight_, bias_); }

std::string ConvNd::extra_repr() const {
  std::ostringstream s;
  s << in_channels_ << ", " << out_channels_ << ", kernel_size=" << tuple_str(kernel_)
    << ", stride=" << tuple_str(stride_);
  switch (padding_.mode) {
    case functional::Padding::Mode::same: s << ", padding=same"; break;
    case functional::Padding::Mode::valid: s << ", padding=valid"; break;
    default:
      if (std::any_of(padding_.sizes.begin(), padding_.sizes.end(), [](int64_t p) { return p != 0; }))
        s << ", padding=" << tuple_str(padding_.sizes);
  }
  if (std::any_of(dilation_.begin(), dilation_.end(), [](int64_t d) { return d != 1; }))
    s << ", dilation=" << tuple_str(dilation_);
  if (transposed_ && std::any_of(output_padding_.begin(), output_padding_.end(), [](int64_t d) { return d != 0; }))
    s << ", output_padding=" << tuple_str(output_padding_);
  if (groups_ != 1) s << ", groups=" << groups_;
  if (!bias_.defined()) s << ", bias=False";
  return s.str();
}

// ---- Conv2d's adapter (PEFT's LoRA Conv2d) ----
void Conv2d::add_lora(const LoraOptions& options) {
  FLAME_CHECK(!has_lora(), "add_lora", "this Conv2d (", extra_repr(), ") already has an adapter");
  FLAME_CHECK(!options.use_dora, "add_lora", "DoRA is supported on Linear only, not on Conv2d (", extra_repr(), ")");
  FLAME_CHECK(groups_ == 1, "add_lora", "LoRA on a grouped Conv2d (groups=", groups_, ") is not supported");
  scaling_ = nn::lora_scaling(options, "add_lora");
  const TensorOptions o(weight_.dtype(), weight_.device());
  lora_A_ = register_module("lora_A", std::make_shared<Conv2d>(in_channels_, options.rank, kernel_, stride_, padding_,
                                                                 dilation_, 1, false, o));
  lora_B_ = register_module("lora_B", std::make_shared<Conv2d>(options.rank, out_channels_, Shape{1}, Shape{1},
                                                                 functional::Padding{0}, Shape{1}, 1, false, o));
  {
    Tensor b = lora_B_->weight();
    init::zeros_(b);
  }
  if (options.dropout > 0.0)
    lora_dropout_ = register_module("lora_dropout", std::make_shared<Dropout>(options.dropout));
  else
    lora_dropout_ = register_module("lora_dropout", std::make_shared<Identity>());
  for (Module* m : {static_cast<Module*>(lora_A_.get()), static_cast<Module*>(lora_B_.get()), lora_dropout_.get()})
    m->train(is_training());
  weight_.requires_grad_(false);
  if (bias_.defined()) bias_.requires_grad_(false);
}

Tensor Conv2d::lora_delta_weight() const {
  FLAME_CHECK(has_lora(), "lora_delta_weight", "this Conv2d (", extra_repr(), ") has no adapter");
  const Tensor& a = lora_A_->weight();  // [r, in, kh, kw]
  const Tensor& b = lora_B_->weight();  // [out, r, 1, 1]
  const int64_t r = a.size(0);
  Tensor d = b.reshape({out_channels_, r}).matmul(a.reshape({r, -1}));
  return d.reshape(weight_.sizes()) * scaling_;
}

Tensor Conv2d::forward(const Tensor& x) {
  Tensor y = conv(x, weight_, bias_);
  if (!has_lora() || merged_) return y;
  return y + lora_B_->forward(lora_A_->forward(lora_dropout_->forward(x))) * scaling_;
}

void Conv2d::merge() {
  FLAME_CHECK(has_lora(), "merge", "this Conv2d (", extra_repr(), ") has no adapter");
  FLAME_CHECK(!merged_, "merge", "the adapter is already merged");
  NoGradGuard no_grad;
  Tensor w = weight_;
  w.add_(lora_delta_weight());
  merged_ = true;
}

void Conv2d::unmerge() {
  FLAME_CHECK(has_lora(), "unmerge", "this Conv2d (", extra_repr(), ") has no adapter");
  FLAME_CHECK(merged_, "unmerge", "the adapter is not merged");
  NoGradGuard no_grad;
  Tensor w = weight_;
  w.sub_(lora_delta_weight());
  merged_ = false;
}

}  // namespace flame::nn
