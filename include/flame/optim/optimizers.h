#pragma once
// Optimizers with torch.optim semantics and defaults: SGD, Adam, AdamW, Lion, Adafactor, and
// AdamW8bit (AdamW with 8-bit block-wise quantised state, as bitsandbytes' AdamW8bit). See
// docs/optim.md.
//
//   optim::AdamW opt(model.parameters(), {.lr = 1e-4, .weight_decay = 0.01});
//   Gradients grads = loss.backward();
//   opt.step(grads);
//
// Parameter groups: build each group from the options (Options::group) and change what differs:
//   optim::AdamWOptions o{.lr = 1e-4, .weight_decay = 0.01};
//   optim::ParamGroup no_decay = o.group(norm_params);
//   no_decay.weight_decay = 0;
//   optim::AdamW opt({o.group(weights), no_decay}, o);
// A ParamGroup written by hand takes every hyperparameter from its own fields (their defaults
// are Adam's); the options then supply only the optimizer-wide settings (amsgrad, nesterov,
// maximize, master weights).
//
// Updates are in place: a parameter keeps its identity and its version counter rises. On CUDA
// SGD, Adam, AdamW and Lion update a whole group in one fused multi-tensor kernel launch per
// (device, dtype) bucket (Note [Multi-tensor apply]), AdamW8bit in one launch of its block-wise
// kernel (plus AdamW's for its small parameters); Adafactor uses FLAME ops per parameter.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flame/optim/optimizer.h"

namespace flame::optim {

// Mixed precision (every options struct below has these three fields): for bf16/f16 parameters
// the optimizer keeps f32 master weights and f32 state when master_weights is on (the default),
// updates the master and writes the rounded parameter in the same pass; stochastic_rounding
// rounds bf16 parameters stochastically (Philox keyed by `seed`, deterministic) instead of to
// nearest. Without master weights half parameters keep half state (as PyTorch), computed in f32.
//
// capturable (SGD, Adam, AdamW, Lion; docs/graph-step.md): every parameter must be on one device;
// the optimizer keeps each group's hyperparameters (lr, weight_decay, betas, eps, momentum,
// dampening) and each parameter's step count in that device's memory and the kernel reads them
// when it runs (bias corrections are computed there), so a step captured into a CUDA graph uses
// the current values at every replay. set_lr / set_momentum (what schedulers call) write the new
// value to the device at once (one small fill on the current stream, no wait); after editing
// param_groups() directly, call sync_hyperparameters() (an eager step() does it too). Changing a
// hyperparameter while a graph is being captured raises. The first step of a parameter (it
// creates the state) must run eagerly before a capture. Results are those of the default mode.

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
  bool master_weights = true;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  // Capturable step (PyTorch's capturable=True; Note [Capturable optimizers]): hyperparameters and
  // step counts live in device memory, so the step can be captured into a CUDA graph and replayed.
  bool capturable = false;
  ParamGroup group(TensorList params) const;
};

struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;  // coupled: added to the gradient (L2), as torch.optim.Adam
  bool amsgrad = false;
  bool maximize = false;
  bool master_weights = true;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  // Capturable step (PyTorch's capturable=True; Note [Capturable optimizers]): hyperparameters and
  // step counts live in device memory, so the step can be captured into a CUDA graph and replayed.
  bool capturable = false;
  ParamGroup group(TensorList params) const;
};

struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: p *= 1 - lr * weight_decay
  bool amsgrad = false;
  bool maximize = false;
  bool master_weights = true;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  // Capturable step (PyTorch's capturable=True; Note [Capturable optimizers]): hyperparameters and
  // step counts live in device memory, so the step can be captured into a CUDA graph and replayed.
  bool capturable = false;
  ParamGroup group(TensorList params) const;
};

// Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023); not in torch.optim.
struct LionOptions {
  double lr = 1e-4;
  std::pair<double, double> betas{0.9, 0.99};
  double weight_decay = 0.0;  // decoupled
  bool maximize = false;
  bool master_weights = true;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  // Capturable step (PyTorch's capturable=True; Note [Capturable optimizers]): hyperparameters and
  // step counts live in device memory, so the step can be captured into a CUDA graph and replayed.
  bool capturable = false;
  ParamGroup group(TensorList params) const;
};

// torch.optim.Adafactor (PyTorch 2.5+): lr is the cap of the relative step min(lr, 1/sqrt(t)),
// scaled by max(eps2, RMS(param)); second moment factored into row and column means for >= 2-d
// parameters (over the last two dims); the update's RMS clipped to d; weight decay decoupled
// (p *= 1 - lr * weight_decay). eps = {eps1, eps2}; eps1 unset is the parameter dtype's epsilon.
struct AdafactorOptions {
  double lr = 1e-2;
  double beta2_decay = -0.8;
  std::pair<std::optional<double>, double> eps{std::nullopt, 1e-3};
  double d = 1.0;
  double weight_decay = 0.0;
  bool maximize = false;
  bool master_weights = true;
  ParamGroup group(TensorList params) const;
};

// Shared machinery: per-parameter state (PyTorch's optimizer.state), master weights, lazy state
// creation at a parameter's first gradient, validation, and the state dict:
//   state.<i>.step (int64, 0-d), state.<i>.<slot> (exp_avg, exp_avg_sq, max_exp_avg_sq,
//   momentum_buffer, row_var, col_var, variance), state.<i>.master_param (f32, half parameters),
//   param_groups.<g>.params (int64 indices), param_groups.<g>.<hyperparameter> (f64, 0-d;
//   betas is a 1-d f64 pair).
// i counts parameters over all groups in order, as PyTorch does.
class FusedOptimizer : public Optimizer {
 public:
  void step(const Gradients& grads) override;
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  std::size_t num_params() const { return params_.size(); }
  // Parameters are indexed over all groups in order (PyTorch's state_dict numbering), which need
  // not be the order they were handed over in; each accessor below also takes the parameter
  // tensor itself (the handle given to the optimizer, not a copy, view or detach() of it).
  // The index of `param`; raises naming its shape when it is not a parameter of this optimizer.
  // (`what` names the accessor in the error.)
  std::size_t param_index(const Tensor& param, const char* what = "param_index") const;
  // Steps taken by parameter `index` (0 before its first gradient).
  int64_t param_step(std::size_t index) const;
  int64_t param_step(const Tensor& param) const { return param_step(param_index(param, "param_step")); }
  // A state slot of parameter `index` (undefined when absent); a handle on the live tensor.
  Tensor state(std::size_t index, const std::string& slot) const;
  Tensor state(const Tensor& param, const std::string& slot) const {
    return state(param_index(param, "state"), slot);
  }
  // The f32 master weights of parameter `index` (undefined when it has none).
  Tensor master_weights(std::size_t index) const;
  Tensor master_weights(const Tensor& param) const {
    return master_weights(param_index(param, "master_weights"));
  }

  // Bytes of state the parameters that have not stepped yet will get at their first step (f32
  // master weights and the optimizer's slots, on the parameters' devices; with `on`, only those of
  // parameters on that device): what a memory plan made before the first step must leave room for
  // (models::fit_vram_budget's callers in apps/diffusion).
  std::size_t pending_state_bytes(std::optional<Device> on = std::nullopt) const;

  // Capturable mode (Note [Capturable optimizers]).
  bool capturable() const { return precision_.capturable; }
  // Writes hyperparameters changed on the host since the last write to the device (no-op when not
  // capturable or nothing changed); raises while a graph is being captured if something changed.
  void sync_hyperparameters();

 protected:
  struct Precision {
    bool master_weights = true;
    bool stochastic_rounding = false;
    uint64_t seed = 0;
    bool capturable = false;
  };
  struct Slot {
    std::string name;
    Shape shape;
    std::optional<DType> dtype{};  // unset: state_dtype(param)
  };
  // A parameter being updated this step: its index, the parameter, its gradient (same dtype and
  // dense layout), and whether its state slots were created in this step.
  struct Active {
    std::size_t index;
    Tensor param;
    Tensor grad;
    bool fresh_state = false;
  };

  FusedOptimizer(std::vector<ParamGroup> groups, Precision precision);
  // Checks the hyperparameters of a group; raises naming the optimizer, group and value.
  virtual void validate_group(const ParamGroup& g, std::size_t index) const = 0;
  // The state slots a parameter of group g gets at its first step (their names and shapes).
  virtual std::vector<Slot> slots(const ParamGroup& g, const Tensor& param) const = 0;
  // Hyperparameter keys saved per group (besides params), from: lr, weight_decay, momentum,
  // dampening, betas, eps, beta2_decay, d, eps1.
  virtual std::vector<std::string> group_keys() const = 0;
  // Updates the parameters of group g that have a gradient this step (their step counters are
  // already advanced).
  virtual void update_group(std::size_t g, const std::vector<Active>& active) = 0;
  // The fused kernel path shared by SGD, Adam, AdamW and Lion.
  void fused_update(std::size_t g, const std::vector<Active>& active, int kind, bool amsgrad, bool nesterov,
                    bool maximize, bool decoupled);

  struct ParamState {
    int64_t step = 0;
    Tensor master;                                       // f32 master weights or undefined
    std::vector<std::pair<std::string, Tensor>> slots;  // created at the first step
  };
  bool uses_master(const Tensor& param) const;
  DType state_dtype(const Tensor& param) const;
  Tensor find_slot(std::size_t index, const std::string& name) const;
  void check_groups() const;
  void hyperparameters_changed(std::size_t group) override;
  // Capturable mode: the values of group g as the kernel reads them (OptimHyper::device_hyper).
  std::vector<double> hyper_values(std::size_t g) const;
  void write_hyperparameters(bool force);
  void advance_device_steps(const std::vector<std::vector<Active>>& active);

  Precision precision_;
  TensorList params_;                     // every parameter, in group order
  std::unordered_map<const TensorImpl*, std::size_t> index_of_;  // parameter -> its index in params_
  std::vector<std::size_t> group_begin_;  // index of each group's first parameter; size groups + 1
  std::vector<ParamState> state_;
  // Capturable mode: per group an f64 [kDeviceHyperSize] tensor of its hyperparameters and the
  // values last written to it; an f64 [num_params] tensor of step counts (the source of truth;
  // ParamState::step is not used). All on the parameters' device.
  std::vector<Tensor> hyper_device_;
  std::vector<std::vector<double>> hyper_written_;
  Tensor steps_device_;
  // During step(), per parameter index: the kept low-precision copy the fused kernel wrote, or
  // undefined (Note [Kept low-precision copies] in src/amp/autocast.cpp); marked up to date after
  // the version bump.
  TensorList low_written_;
};

class SGD final : public FusedOptimizer {
 public:
  using Options = SGDOptions;
  explicit SGD(TensorList params, Options options = {});
  SGD(std::vector<ParamGroup> groups, Options options);
  std::string name() const override { return "SGD"; }
  MomentumKind momentum_kind() const override { return MomentumKind::momentum; }
  const Options& options() const { return options_; }

 protected:
  void validate_group(const ParamGroup& g, std::size_t index) const override;
  std::vector<Slot> slots(const ParamGroup& g, const Tensor& param) const override;
  std::vector<std::string> group_keys() const override;
  void update_group(std::size_t g, const std::vector<Active>& active) override;

 private:
  Options options_;
};

class Adam : public FusedOptimizer {
 public:
  using Options = AdamOptions;
  explicit Adam(TensorList params, Options options = {});
  Adam(std::vector<ParamGroup> groups, Options options);
  std::string name() const override { return "Adam"; }
  MomentumKind momentum_kind() const override { return MomentumKind::beta1; }
  const Options& options() const { return options_; }

 protected:
  Adam(std::vector<ParamGroup> groups, Options options, bool decoupled);
  void validate_group(const ParamGroup& g, std::size_t index) const override;
  std::vector<Slot> slots(const ParamGroup& g, const Tensor& param) const override;
  std::vector<std::string> group_keys() const override;
  void update_group(std::size_t g, const std::vector<Active>& active) override;

 private:
  Options options_;
  bool decoupled_;
};

class AdamW final : public Adam {
 public:
  using Options = AdamWOptions;
  explicit AdamW(TensorList params, Options options = {});
  AdamW(std::vector<ParamGroup> groups, Options options);
  std::string name() const override { return "AdamW"; }
};

class Lion final : public FusedOptimizer {
 public:
  using Options = LionOptions;
  explicit Lion(TensorList params, Options options = {});
  Lion(std::vector<ParamGroup> groups, Options options);
  std::string name() const override { return "Lion"; }
  MomentumKind momentum_kind() const override { return MomentumKind::beta1; }
  const Options& options() const { return options_; }

 protected:
  void validate_group(const ParamGroup& g, std::size_t index) const override;
  std::vector<Slot> slots(const ParamGroup& g, const Tensor& param) const override;
  std::vector<std::string> group_keys() const override;
  void update_group(std::size_t g, const std::vector<Active>& active) override;

 private:
  Options options_;
};

class Adafactor final : public FusedOptimizer {
 public:
  using Options = AdafactorOptions;
  explicit Adafactor(TensorList params, Options options = {});
  Adafactor(std::vector<ParamGroup> groups, Options options);
  std::string name() const override { return "Adafactor"; }
  const Options& options() const { return options_; }

 protected:
  void validate_group(const ParamGroup& g, std::size_t index) const override;
  std::vector<Slot> slots(const ParamGroup& g, const Tensor& param) const override;
  std::vector<std::string> group_keys() const override;
  void update_group(std::size_t g, const std::vector<Active>& active) override;

 private:
  Options options_;
};

// AdamW whose two moments are stored in 8 bits (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization", 2021; bitsandbytes' bnb.optim.AdamW8bit): the update is AdamW's (decoupled weight
// decay, torch.optim.AdamW's bias corrections) computed in f32 (f64 for f64 parameters) from the
// dequantised state; exp_avg and exp_avg_sq are then requantised block-wise: per block of
// block_size elements (in the parameter's memory order) one f32 absmax and one uint8 code per
// element into a 256-entry dynamic map, signed for exp_avg, unsigned for exp_avg_sq
// (dynamic_map below; Note [8-bit optimizer state] in src/backend/fused/adamw8bit.h). State per
// parameter element: 2 bytes + 8 / block_size bytes of absmax (2.03 bytes at block_size 256)
// instead of AdamW's 8 (f32 state). Parameters of fewer than min_8bit_size elements keep AdamW's
// f32 state (exp_avg, exp_avg_sq) and are updated exactly as AdamW updates them.
//   optim::AdamW8bit opt(model.parameters(), {.lr = 1e-4, .weight_decay = 0.01});
// State dict: as FusedOptimizer's, with state.<i>.exp_avg_codes / exp_avg_sq_codes (u8, the
// parameter's shape) and state.<i>.exp_avg_absmax / exp_avg_sq_absmax (f32 [ceil(numel /
// block_size)]) for 8-bit parameters, plus options.block_size and options.min_8bit_size (i64);
// load_state_dict refuses a state of another block size, kind (8-bit or f32) or shape, naming it.
// Half parameters keep f32 master weights by default (the 8-bit state does not depend on it).
struct AdamW8bitOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: p *= 1 - lr * weight_decay
  int64_t min_8bit_size = 4096;  // smaller parameters keep f32 (AdamW) state
  int64_t block_size = 256;      // elements per absmax; a power of two in [64, 4096]
  bool maximize = false;
  bool master_weights = true;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  ParamGroup group(TensorList params) const;
};

class AdamW8bit final : public FusedOptimizer {
 public:
  using Options = AdamW8bitOptions;
  explicit AdamW8bit(TensorList params, Options options = {});
  AdamW8bit(std::vector<ParamGroup> groups, Options options);
  std::string name() const override { return "AdamW8bit"; }
  MomentumKind momentum_kind() const override { return MomentumKind::beta1; }
  const Options& options() const { return options_; }
  // Whether parameter `index` (or `param`) keeps 8-bit state: numel >= min_8bit_size.
  bool is_8bit(std::size_t index) const;
  bool is_8bit(const Tensor& param) const { return is_8bit(param_index(param, "is_8bit")); }
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

 protected:
  void validate_group(const ParamGroup& g, std::size_t index) const override;
  std::vector<Slot> slots(const ParamGroup& g, const Tensor& param) const override;
  std::vector<std::string> group_keys() const override;
  void update_group(std::size_t g, const std::vector<Active>& active) override;

 private:
  Options options_;
};

// Block-wise dynamic quantisation, the format of AdamW8bit's state (bitsandbytes'
// create_dynamic_map / quantize_blockwise / dequantize_blockwise).
// The 256 values of the dynamic map, ascending: signed (in [-1, 1], for exp_avg) or unsigned (in
// [0, 1], for exp_avg_sq); both hold 0 and 1 exactly.
const std::array<float, 256>& dynamic_map(bool is_signed);
struct QuantizedBlocks {
  Tensor codes;   // u8, x's shape: the nearest map entry to x / absmax of its block
  Tensor absmax;  // f32 [ceil(numel / block_size)]: the largest |x| of each block
};
// Quantises x (floating, any device; blocks over its elements in row-major order); the results are
// on x's device. An unsigned map takes x >= 0.
QuantizedBlocks quantize_blockwise(const Tensor& x, bool is_signed, int64_t block_size = 256);
// map[codes] * absmax of each element's block, f32, on codes' device.
Tensor dequantize_blockwise(const Tensor& codes, const Tensor& absmax, bool is_signed, int64_t block_size = 256);

// Fused optimizer/EMA kernel launches (CUDA) plus CPU backend calls so far, process-wide: a
// step of one group of one dtype on one device adds 1 (a group of more than 288 tensors adds
// one per 288). For tests and profiling.
int64_t fused_launch_count();

}  // namespace flame::optim
