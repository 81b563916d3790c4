#pragma once
// Linear (y = x W^T + b) and its functional form, with an optional LoRA/DoRA adapter (lora.h).
#include <cstdint>
#include <memory>
#include <string>

#include "flame/nn/args.h"
#include "flame/nn/lora.h"
#include "flame/nn/module.h"

namespace flame::nn {

class Dropout;

namespace functional {
// x [..., in], weight [out, in], bias [out] (or undefined) -> [..., out], as F.linear.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
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

  // ---- LoRA / DoRA (lora.h) ----
  void add_lora(const LoraOptions& options) override;
  bool has_lora() const override { return lora_A_ != nullptr; }
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

 private:
  // DoRA's per-row norm of W + delta, detached (the DoRA paper's and PEFT's choice).
  Tensor dora_weight_norm(const Tensor& delta) const;

  int64_t in_features_, out_features_;
  Tensor weight_, bias_;
  std::shared_ptr<Linear> lora_A_, lora_B_;
  std::shared_ptr<Module> lora_dropout_;
  Tensor magnitude_;
  LoraOptions lora_options_;
  double scaling_ = 0.0;
  bool merged_ = false;
  Tensor dora_factor_;  // magnitude / norm at merge time, to unmerge exactly
};

}  // namespace flame::nn
