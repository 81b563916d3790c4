#pragma once
// Conditioning pieces shared by the DiT and the UNet, and the interface every diffusion model of
// the trainer implements (DiffusionModel): forward(x [B,C,H,W], t [B] float in [0, 1], y [B] i64).
//
// Note [Time convention]: models take a continuous time t in [0, 1] and embed t * time_scale
// (1000 by default) with DiT's sinusoidal table, so a DDPM timestep index n of T = 1000 steps is
// passed as n / T and embeds exactly like DiT's integer timesteps. Rectified flow passes its t
// directly (t = 0 data, t = 1 noise).
#include <cstdint>
#include <memory>
#include <string>

#include <flame/flame.h>
#include <flame/nn.h>

namespace flame_diffusion {

using flame::Tensor;

// DiT's sinusoidal embedding: [cos(t * f_0..f_{h-1}), sin(t * f_0..)] with f_i =
// max_period^(-i / h), h = dim / 2 (a zero column is appended for odd dim). t: [B] floating.
Tensor timestep_embedding(const Tensor& t, int64_t dim, double max_period = 10000.0);

// The 2-D sin-cos table of MAE/DiT for a grid_size x grid_size grid: [grid_size^2, dim], row
// r * grid_size + c; the first dim/2 columns encode the column c, the rest the row r, each as
// [sin(pos * w_k), cos(pos * w_k)] with w_k = 10000^(-k / (dim / 4)). dim must be divisible by 4.
Tensor sincos_2d_pos_embed(int64_t dim, int64_t grid_size);

// sinusoidal(frequency_dim) -> Linear -> SiLU -> Linear; children named mlp.0 / mlp.2 as DiT's.
class TimestepEmbedder : public flame::nn::Module {
 public:
  TimestepEmbedder(int64_t hidden, int64_t frequency_dim = 256);
  std::string name() const override { return "TimestepEmbedder"; }
  // t: [B] in the embedding's units (already multiplied by the model's time scale).
  Tensor forward(const Tensor& t) override;
  int64_t frequency_dim() const { return frequency_dim_; }
  std::shared_ptr<flame::nn::Linear> fc1, fc2;  // mlp.0, mlp.2

 private:
  int64_t frequency_dim_;
  std::shared_ptr<flame::nn::Sequential> mlp_;
};

// Class labels -> vectors; row num_classes is the null class used for classifier-free guidance.
class LabelEmbedder : public flame::nn::Module {
 public:
  LabelEmbedder(int64_t num_classes, int64_t hidden);
  std::string name() const override { return "LabelEmbedder"; }
  Tensor forward(const Tensor& labels) override;  // labels: [B] i64 in [0, num_classes]
  int64_t num_classes() const { return num_classes_; }
  std::shared_ptr<flame::nn::Embedding> embedding_table;

 private:
  int64_t num_classes_;
};

// Label dropout for classifier-free guidance training: each label is replaced by `null_class`
// with probability p (Philox draws from gen; the same mask on CPU and CUDA for one seed).
Tensor drop_labels(const Tensor& labels, double p, int64_t null_class, flame::Generator* gen = nullptr);

// DiT's init of the conditioning embedders: N(0, 0.02) for the label table and the two timestep
// MLP weights, zero biases.
void init_embedders(TimestepEmbedder& t, LabelEmbedder& y, flame::Generator* gen);

// What every model of the trainer offers to the objectives and samplers.
class DiffusionModel : public flame::nn::Module {
 public:
  using flame::nn::Module::forward;
  // x: [B, in_channels, image_size, image_size]; t: [B] floating in [0, 1] (Note [Time
  // convention]); y: [B] i64 labels in [0, num_classes] (num_classes = null class).
  // Returns a tensor shaped like x (velocity or noise prediction).
  virtual Tensor forward(const Tensor& x, const Tensor& t, const Tensor& y) = 0;
  virtual int64_t in_channels() const = 0;
  virtual int64_t image_size() const = 0;
  virtual int64_t num_classes() const = 0;
  int64_t null_class() const { return num_classes(); }
  // The preset name it was built from ("dit-s", "unet-tiny", ...).
  virtual std::string preset() const = 0;

 protected:
  // Raises a clear error when x, t or y do not fit the model.
  void check_inputs(const Tensor& x, const Tensor& t, const Tensor& y) const;
};

// Builds any preset of dit.h or unet.h ("dit-tiny", "dit-s", "dit-b", "unet-tiny", "unet-s");
// the weights are drawn from `seed`. Unknown names raise an error listing the presets.
std::shared_ptr<DiffusionModel> make_model(const std::string& preset, uint64_t seed = 0);
std::string model_presets();  // "dit-tiny, dit-s, ..." for help texts

}  // namespace flame_diffusion
