// AdamW8bit over FusedOptimizer (fused_optimizer.cpp): parameters of at least min_8bit_size
// elements keep block-wise 8-bit state and step through the adamw8bit_step kernel (Note [8-bit
// optimizer state] in src/backend/fused/adamw8bit.h); smaller ones keep f32 state and step through
// AdamW's fused kernel, so they follow AdamW exactly. Also the public block-wise quantisation
// helpers (dynamic_map, quantize_blockwise, dequantize_blockwise) over the same maps and rounding.
#include <algorithm>
#include <cmath>

#include "flame/optim/optimizers.h"
#include "src/backend/fused/adamw8bit.h"
#include "src/optim/optim_checks.h"

namespace flame::optim {

namespace {

constexpr const char* kCodes[2] = {"exp_avg_codes", "exp_avg_sq_codes"};
constexpr const char* kAbsmax[2] = {"exp_avg_absmax", "exp_avg_sq_absmax"};
constexpr const char* kBlockSizeKey = "options.block_size";
constexpr const char* kMin8bitKey = "options.min_8bit_size";

int64_t blocks_of(int64_t numel, int64_t block_size) { return (numel + block_size - 1) / block_size; }

void check_block_size(const char* op, int64_t block_size) {
  FLAME_CHECK(block_size >= 64 && block_size <= 4096 && (block_size & (block_size - 1)) == 0, op, "block_size ",
              block_size, " is not a power of two in [64, 4096] (bitsandbytes' 8-bit optimizers use 256)");
}

}  // namespace

ParamGroup AdamW8bitOptions::group(TensorList params) const {  // the group of Adam's hyperparameters
  AdamOptions adam;
  adam.lr = lr;
  adam.betas = betas;
  adam.eps = eps;
  adam.weight_decay = weight_decay;
  return adam.group(std::move(params));
}

AdamW8bit::AdamW8bit(TensorList params, Options options)
    : AdamW8bit(std::vector<ParamGroup>{options.group(std::move(params))}, options) {}

AdamW8bit::AdamW8bit(std::vector<ParamGroup> groups, Options options)
    : FusedOptimizer(std::move(groups), {options.master_weights, options.stochastic_rounding, options.seed, false}),
      options_(options) {
  check_block_size("AdamW8bit", options_.block_size);
  FLAME_CHECK(options_.min_8bit_size >= 0, "AdamW8bit", "min_8bit_size ", options_.min_8bit_size,
              " is negative (parameters of fewer elements keep f32 state; bitsandbytes' default is 4096)");
  check_groups();
}

bool AdamW8bit::is_8bit(std::size_t index) const {
  FLAME_CHECK(index < params_.size(), "AdamW8bit.is_8bit", "index ", index, " out of range (", params_.size(),
              " parameters)");
  return params_[index].numel() >= options_.min_8bit_size;
}

void AdamW8bit::validate_group(const ParamGroup& g, std::size_t i) const {
  detail::check_common("AdamW8bit", g, i);
  detail::check_betas("AdamW8bit", g, i);
  detail::check_range(g.eps >= 0.0, "AdamW8bit", i, "epsilon value (must be >= 0)", g.eps);
}

std::vector<FusedOptimizer::Slot> AdamW8bit::slots(const ParamGroup&, const Tensor& param) const {
  if (param.numel() < options_.min_8bit_size) return {{"exp_avg", param.sizes()}, {"exp_avg_sq", param.sizes()}};
  const Shape blocks{blocks_of(param.numel(), options_.block_size)};
  return {{kCodes[0], param.sizes(), DType::u8},
          {kAbsmax[0], blocks, DType::f32},
          {kCodes[1], param.sizes(), DType::u8},
          {kAbsmax[1], blocks, DType::f32}};
}

std::vector<std::string> AdamW8bit::group_keys() const { return {"lr", "betas", "eps", "weight_decay"}; }

void AdamW8bit::update_group(std::size_t g, const std::vector<Active>& active) {
  std::vector<Active> f32_state;
  std::vector<const Active*> quantized;
  for (const Active& a : active) {
    if (is_8bit(a.index)) quantized.push_back(&a);
    else f32_state.push_back(a);
  }
  if (!f32_state.empty())
    fused_update(g, f32_state, static_cast<int>(backend::OptimKind::adam), false, false, options_.maximize, true);
  if (quantized.empty()) return;
  const ParamGroup& grp = groups_[g];
  backend::OptimHyper h;
  h.kind = backend::OptimKind::adam;
  h.lr = grp.lr;
  h.weight_decay = grp.weight_decay;
  h.beta1 = grp.beta1;
  h.beta2 = grp.beta2;
  h.eps = grp.eps;
  h.maximize = options_.maximize;
  h.decoupled_weight_decay = true;
  h.stochastic_rounding = precision_.stochastic_rounding;
  h.seed = precision_.seed;
  // One kernel call per (device, dtype, master weights or not) bucket, in first-seen order.
  struct Bucket {
    Device device;
    DType dtype;
    bool master;
    std::vector<backend::Optim8bitTensor> tensors;
  };
  std::vector<Bucket> buckets;
  // Fresh state is all zero codes with absmax 0: every element dequantises to 0, and the step
  // rewrites every code.
  for (const Active* a : quantized) {
    const ParamState& st = state_[a->index];
    backend::Optim8bitTensor e;
    e.param = a->param;
    e.grad = a->grad;
    e.master = st.master;
    for (int s = 0; s < 2; ++s) {
      e.codes[s] = find_slot(a->index, kCodes[s]);
      e.absmax[s] = find_slot(a->index, kAbsmax[s]);
    }
    const double t = static_cast<double>(st.step);
    e.step_size = grp.lr / (1.0 - std::pow(grp.beta1, t));
    e.bias2_sqrt = std::sqrt(1.0 - std::pow(grp.beta2, t));
    e.rng_index = static_cast<uint64_t>(a->index) << 40;
    e.rng_offset = static_cast<uint64_t>(st.step);
    const bool master = st.master.defined();
    Bucket* b = nullptr;
    for (Bucket& x : buckets)
      if (x.device == a->param.device() && x.dtype == a->param.dtype() && x.master == master) b = &x;
    if (b == nullptr) b = &buckets.emplace_back(Bucket{a->param.device(), a->param.dtype(), master, {}});
    b->tensors.push_back(std::move(e));
  }
  for (const Bucket& b : buckets) backend::fused::adamw8bit_step.run(b.device, h, options_.block_size, b.tensors);
}

StateDict AdamW8bit::state_dict() const {
  StateDict sd = FusedOptimizer::state_dict();
  sd.insert(kBlockSizeKey, Tensor::scalar(options_.block_size, DType::i64));
  sd.insert(kMin8bitKey, Tensor::scalar(options_.min_8bit_size, DType::i64));
  return sd;
}

void AdamW8bit::load_state_dict(const StateDict& state) {
  const char* op = "AdamW8bit.load_state_dict";
  auto option = [&](const char* key) {
    const Tensor* t = state.find(key);
    FLAME_CHECK(t != nullptr, op, "missing key \"", key, "\": the state was not saved by AdamW8bit");
    FLAME_CHECK(t->numel() == 1 && is_integral(t->dtype()), op, key, " must be an integer scalar, got shape ",
                t->sizes(), " dtype ", dtype_name(t->dtype()));
    return t->item<int64_t>();
  };
  const int64_t block_size = option(kBlockSizeKey);
  FLAME_CHECK(block_size == options_.block_size, op, "the state was saved with block_size ", block_size,
              "; this optimizer quantises blocks of ", options_.block_size, ": construct it with block_size = ",
              block_size, " to resume from this state");
  const int64_t saved_min = option(kMin8bitKey);
  // Each parameter's kind of state must be this optimizer's (min_8bit_size may differ where it
  // does not change which parameters are 8-bit).
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::string prefix = "state." + std::to_string(i) + ".";
    if (!state.contains(prefix + "step")) continue;
    const bool quantized = is_8bit(i);
    const bool saved_quantized = state.contains(prefix + kCodes[0]);
    const bool saved_f32 = state.contains(prefix + "exp_avg");
    FLAME_CHECK(!(saved_quantized && saved_f32), op, "parameter ", i,
                " has both 8-bit and f32 moments in the state");
    FLAME_CHECK(!(quantized && saved_f32), op, "parameter ", i, " (shape ", params_[i].sizes(), ", ",
                params_[i].numel(), " elements) keeps 8-bit state here (min_8bit_size ", options_.min_8bit_size,
                "), but the state holds f32 exp_avg / exp_avg_sq for it (saved with min_8bit_size ", saved_min,
                ", or by AdamW): construct the optimizer with min_8bit_size = ", saved_min);
    FLAME_CHECK(!(!quantized && saved_quantized), op, "parameter ", i, " (shape ", params_[i].sizes(), ", ",
                params_[i].numel(), " elements) keeps f32 state here (min_8bit_size ", options_.min_8bit_size,
                "), but the state holds 8-bit codes for it (saved with min_8bit_size ", saved_min,
                "): construct the optimizer with min_8bit_size = ", saved_min);
  }
  StateDict rest;
  for (const auto& [k, t] : state)
    if (k != kBlockSizeKey && k != kMin8bitKey) rest.insert(k, t);
  FusedOptimizer::load_state_dict(rest);
}

// ---- block-wise quantisation helpers ----

const std::array<float, 256>& dynamic_map(bool is_signed) { return backend::quant_maps().map[is_signed ? 0 : 1]; }

QuantizedBlocks quantize_blockwise(const Tensor& x, bool is_signed, int64_t block_size) {
  const char* op = "quantize_blockwise";
  FLAME_CHECK(x.defined() && is_floating(x.dtype()), op, "expects a floating tensor, got ",
              x.defined() ? dtype_name(x.dtype()) : "an undefined tensor");
  FLAME_CHECK(block_size > 0, op, "block_size ", block_size, " must be positive");
  const std::vector<float> v = x.to_vec<float>();
  const int64_t n = static_cast<int64_t>(v.size());
  const float* map = dynamic_map(is_signed).data();
  std::vector<uint8_t> codes(v.size());
  std::vector<float> absmax(static_cast<std::size_t>(blocks_of(n, block_size)));
  for (int64_t b = 0; b < static_cast<int64_t>(absmax.size()); ++b) {
    const int64_t begin = b * block_size, end = std::min(n, begin + block_size);
    float a = 0.0f;
    for (int64_t i = begin; i < end; ++i) {
      FLAME_CHECK(is_signed || !(v[i] < 0.0f), op, "element ", i, " is ", v[i],
                  "; the unsigned map holds values >= 0 (pass is_signed = true)");
      a = backend::quant8::absmax_with(a, v[i]);
    }
    for (int64_t i = begin; i < end; ++i) codes[i] = backend::quant8::quantize(map, v[i], a);
    absmax[b] = a;
  }
  return {Tensor::from_vec(codes, x.sizes()).to(x.device()),
          Tensor::from_vec(absmax, {static_cast<int64_t>(absmax.size())}).to(x.device())};
}

Tensor dequantize_blockwise(const Tensor& codes, const Tensor& absmax, bool is_signed, int64_t block_size) {
  const char* op = "dequantize_blockwise";
  FLAME_CHECK(codes.defined() && codes.dtype() == DType::u8, op, "codes must be u8, got ",
              codes.defined() ? dtype_name(codes.dtype()) : "an undefined tensor");
  FLAME_CHECK(block_size > 0, op, "block_size ", block_size, " must be positive");
  const int64_t blocks = blocks_of(codes.numel(), block_size);
  FLAME_CHECK(absmax.defined() && absmax.dim() == 1 && absmax.numel() == blocks && is_floating(absmax.dtype()), op,
              "absmax must be a floating 1-d tensor of ", blocks, " values (", codes.numel(), " codes in blocks of ",
              block_size, "), got shape ", absmax.defined() ? absmax.sizes() : Shape{});
  const std::vector<uint8_t> c = codes.to_vec<uint8_t>();
  const std::vector<float> a = absmax.to_vec<float>();
  const float* map = dynamic_map(is_signed).data();
  std::vector<float> out(c.size());
  for (std::size_t i = 0; i < c.size(); ++i)
    out[i] = backend::quant8::dequantize(map, c[i], a[i / static_cast<std::size_t>(block_size)]);
  return Tensor::from_vec(out, codes.sizes()).to(codes.device());
}

}  // namespace flame::optim
