#pragma once
// Linear (y = x W^T + b) and its functional form, with an optional LoRA/DoRA or LoKr adapter (lora.h).
#include <cstdint>
#include <memory>
#include <string>

#include "flame/nn/args.h"
#include "flame/nn/float8.h"
#include "flame/nn/lora.h"
#include "flame/nn/module.h"

namespace flame::nn {

class Dropout;

namespace functional {
// x [..., in], weight [out, in], bias [out] (or undefined) -> [..., out], as F.linear.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// x [..., in] @ weight^T + residual [..., out], as torch.addmm(residual, x, weight.t()) over any
// leading dims: the GEMM adds residual in its epilogue where the backend can (one rounding, no
// pass of its own); residual has the output's shape and x's dtype (autocast casts all three to the
// low dtype). Gradients: x and weight as linear, residual's is the output's.
Tensor linear_add(const Tensor& x, const Tensor& weight, const Tensor& residual);
}  // namespace functional

class Linear : public Module, public LoraTarget {
 public:
  // weight [out, in] ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); bias ~ the same
  // bound; both PyTorch's defaults. opts picks dtype (default f32) and device.
  Linear(int64_t in_features, int64_t out_features, bool bias = true, TensorOptions opts = {});
  std::string name() const override { return "Linear"; }
  FLAME_NN_ARGS_CHECK(Linear, "nn::Linear(in_features, out_features, bias = true, opts = {})", 2, int64_t,
                      int64_t, bool, TensorOptions)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }  // undefined without bias

  // ---- LoRA / DoRA / LoKr (lora.h) ----
  void add_lora(const LoraOptions& options) override;
  // Any adapter: LoRA, DoRA or LoKr (lora_A() is null for LoKr).
  bool has_lora() const override { return lora_A_ != nullptr || has_lokr(); }
  void merge() override;
  void unmerge() override;
  bool merged() const override { return merged_; }
  const LoraOptions& lora_options() const { return lora_options_; }
  double lora_scaling() const { return scaling_; }
  const std::shared_ptr<Linear>& lora_A() const { return lora_A_; }
  const std::shared_ptr<Linear>& lora_B() const { return lora_B_; }
  const Tensor& lora_magnitude_vector() const { return magnitude_; }  // DoRA only
  // scaling * B A, the adapter's weight update [out, in] (recorded: gradients reach A and B).
  Tensor lora_delta_weight() const;

  // LoKr: the layout lokr_layout() gives these options, or an explicit one (files); w1 (or w1_a,
  // w1_b) kaiming_uniform(a = sqrt(5)), w2_a kaiming_uniform, w2 (or w2_b) zero, as LyCORIS.
  void add_lokr(const LokrOptions& options) override;
  void add_lokr(const LokrLayout& layout);
  bool has_lokr() const { return lokr_layout_.a > 0; }
  const LokrLayout& lokr_layout() const { return lokr_layout_; }
  // The adapter's parameters; the ones its layout does not use are undefined.
  struct LokrFactors {
    Tensor w1, w1_a, w1_b, w2, w2_a, w2_b;
  };
  const LokrFactors& lokr_factors() const { return lokr_; }
  // w1 [a, b] and w2 [c, d], products formed when decomposed (recorded).
  Tensor lokr_w1() const;
  Tensor lokr_w2() const;
  // scale * kron(w1, w2) [out, in] (recorded).
  Tensor lokr_delta_weight() const;

  // ---- 8-bit float weight (flame/nn/float8.h, Note [Float8 Linear]) ----
  // Quantises the weight, which must not require a gradient, to options.dtype with one f32 scale
  // per output row: the parameter "weight" becomes the 8-bit tensor (the same handle) and a buffer
  // "weight_scale" [out] (f32) joins the state dict. forward then runs functional::linear_float8;
  // an adapter works as before (added before or after). On a layer already in 8 bits it only takes
  // the new compute mode and gradient dtype (options.dtype must match the stored one). merge()
  // raises on an 8-bit layer.
  void to_float8(const Float8Options& options = {});
  // Installs an 8-bit weight as it is (a file's F8 codes, no requantising): q [out, in] f8 and its
  // scale (one value per output row, or one for all), on the weight's device. The weight is frozen
  // (requires_grad false); options.dtype is ignored (q's dtype is kept).
  void set_float8_weight(const Tensor& q, const Tensor& scale, const Float8Options& options = {});
  bool is_float8() const { return weight_scale_.defined(); }
  const Tensor& weight_scale() const { return weight_scale_; }  // undefined unless is_float8()
  const Float8Options& float8_options() const { return float8_; }
  // The base weight in dtype without a graph: the weight cast, or the 8-bit one dequantised.
  Tensor dense_weight(DType dtype) const;

 private:
  // x W^T (+ bias): the ordinary linear, or the 8-bit one.
  Tensor base_forward(const Tensor& x, const Tensor& bias) const;
  // dtype and device of new adapter weights: the weight's (f32 in place of an 8-bit weight's).
  TensorOptions adapter_options() const;
  // DoRA's per-row norm of W + delta, detached (the DoRA paper's and PEFT's choice).
  Tensor dora_weight_norm(const Tensor& delta) const;
  // scaling * (h B^T), plus residual when given (Note [LoRA forward])
  Tensor lora_up(const Tensor& h, const Tensor& residual = Tensor()) const;
  // scale * x kron(w1, w2)^T without forming the [out, in] product (Note [LoKr forward]).
  Tensor lokr_forward(const Tensor& x) const;

  int64_t in_features_, out_features_;
  Tensor weight_, bias_;
  std::shared_ptr<Linear> lora_A_, lora_B_;
  std::shared_ptr<Module> lora_dropout_;
  Tensor magnitude_;
  LoraOptions lora_options_;
  double scaling_ = 0.0;
  bool merged_ = false;
  Tensor dora_factor_;  // magnitude / norm at merge time, to unmerge exactly
  LokrLayout lokr_layout_;
  LokrFactors lokr_;
  Tensor weight_scale_;  // 8-bit weight only
  Float8Options float8_;
};

}  // namespace flame::nn
