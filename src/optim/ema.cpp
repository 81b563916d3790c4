// EMA of weights (flame/optim/ema.h). The update is Backend::ema_update, one fused launch per
// (device, shadow dtype, parameter dtype) bucket on CUDA.
#include "flame/optim/ema.h"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "flame/autograd.h"
#include "flame/cuda.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/backend/fused/multi_tensor.h"

namespace flame::optim {

namespace {
bool is_half(DType dt) { return dt == DType::bf16 || dt == DType::f16; }
DType shadow_dtype(const Tensor& p) { return is_half(p.dtype()) ? DType::f32 : p.dtype(); }
std::string shadow_key(std::size_t i) { return "shadow." + std::to_string(i); }
}  // namespace

EMA::EMA(TensorList params, EMAOptions options) : options_(options), params_(std::move(params)) {
  FLAME_CHECK(options_.decay >= 0.0 && options_.decay <= 1.0, "EMA", "decay ", options_.decay,
              " must be in [0, 1]");
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    FLAME_CHECK(p.defined() && is_floating(p.dtype()), "EMA", "parameter ", i, " must be a defined floating tensor");
    FLAME_CHECK(is_non_overlapping_and_dense(p), "EMA", "parameter ", i, " (shape ", p.sizes(), ", strides ",
                p.strides(), ") is not dense");
    Tensor s = make_empty_in_layout_of(p, shadow_dtype(p), p.device(), "EMA");
    s.copy_(p);
    shadow_.push_back(std::move(s));
  }
  if (options_.capturable && !params_.empty()) {
    const Device dev = params_.front().device();
    for (std::size_t i = 0; i < params_.size(); ++i)
      FLAME_CHECK(params_[i].device() == dev, "EMA", "capturable: parameter ", i, " is on ", params_[i].device().str(),
                  ", parameter 0 on ", dev.str(), "; a capturable EMA keeps its update count on one device");
    counter_ = Tensor::zeros({}, TensorOptions(DType::f64, dev));
  }
}

int64_t EMA::num_updates() const {
  return counter_.defined() ? static_cast<int64_t>(counter_.item<double>()) : num_updates_;
}

void EMA::update() {
  if (!counter_.defined()) {
    update(num_updates_);
    return;
  }
  update_on_device();
}

double EMA::decay_at(int64_t step) const {
  if (!options_.warmup) return options_.decay;
  const double s = static_cast<double>(step);
  return std::min(options_.decay, (1.0 + s) / (10.0 + s));
}

void EMA::update(int64_t step) {
  FLAME_CHECK(step >= 0, "EMA.update", "step ", step, " is negative");
  FLAME_CHECK(!(counter_.defined() && counter_.device().is_cuda() && cuda::is_capturing(counter_.device().index)),
              "EMA.update", "update(step) while a CUDA graph is being captured would replay the decay of step ", step,
              " forever; call update(), which reads the update count from device memory when it runs");
  const double weight = 1.0 - decay_at(step);
  struct Bucket {
    Device device;
    DType sdt, pdt;
    TensorList shadow, params;
  };
  std::vector<Bucket> buckets;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    const Tensor& s = shadow_[i];
    FLAME_CHECK(p.device() == s.device() && p.sizes() == s.sizes() && same_dense_layout(p, s), "EMA.update",
                "parameter ", i, " changed device, shape or layout since the EMA was made (now ", p.device().str(),
                " ", p.sizes(), ", shadow ", s.device().str(), " ", s.sizes(), ")");
    Bucket* b = nullptr;
    for (Bucket& x : buckets)
      if (x.device == p.device() && x.sdt == s.dtype() && x.pdt == p.dtype()) b = &x;
    if (b == nullptr) b = &buckets.emplace_back(Bucket{p.device(), s.dtype(), p.dtype(), {}, {}});
    b->shadow.push_back(s);
    b->params.push_back(p);
  }
  for (const Bucket& b : buckets) backend::fused::ema_update.run(b.device, b.shadow, b.params, weight);
  for (const Tensor& s : shadow_) bump_version(s);
  if (counter_.defined()) {
    NoGradGuard no_grad;
    counter_.add_(1.0);
  } else {
    ++num_updates_;
  }
}

// Capturable update: the kernel reads the count from counter_, then one add advances it.
void EMA::update_on_device() {
  NoGradGuard no_grad;
  struct Bucket {
    DType sdt, pdt;
    TensorList shadow, params;
  };
  std::vector<Bucket> buckets;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    const Tensor& s = shadow_[i];
    FLAME_CHECK(p.device() == s.device() && p.sizes() == s.sizes() && same_dense_layout(p, s), "EMA.update",
                "parameter ", i, " changed device, shape or layout since the EMA was made (now ", p.device().str(),
                " ", p.sizes(), ", shadow ", s.device().str(), " ", s.sizes(), ")");
    Bucket* b = nullptr;
    for (Bucket& x : buckets)
      if (x.sdt == s.dtype() && x.pdt == p.dtype()) b = &x;
    if (b == nullptr) b = &buckets.emplace_back(Bucket{s.dtype(), p.dtype(), {}, {}});
    b->shadow.push_back(s);
    b->params.push_back(p);
  }
  for (const Bucket& b : buckets)
    backend::fused::ema_update_device.run(counter_.device(), b.shadow, b.params, counter_, options_.decay,
                                          options_.warmup);
  counter_.add_(1.0);
  for (const Tensor& s : shadow_) bump_version(s);
}

void EMA::store() {
  NoGradGuard no_grad;
  TensorList backup;
  for (const Tensor& p : params_) backup.push_back(p.clone());
  backup_ = std::move(backup);
}

void EMA::copy_to() const {
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Tensor p = params_[i];
    p.copy_(shadow_[i]);
  }
}

void EMA::restore() {
  FLAME_CHECK(!backup_.empty() || params_.empty(), "EMA.restore", "no stored parameters (call store() first)");
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Tensor p = params_[i];
    p.copy_(backup_[i]);
  }
  backup_.clear();
}

StateDict EMA::state_dict() const {
  StateDict sd;
  for (std::size_t i = 0; i < shadow_.size(); ++i) sd.insert(shadow_key(i), shadow_[i].clone());
  sd.insert("num_updates", Tensor::scalar(num_updates(), DType::i64));
  return sd;
}

void EMA::load_state_dict(const StateDict& sd) {
  const char* op = "EMA.load_state_dict";
  NoGradGuard no_grad;
  TensorList shadow;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::string key = shadow_key(i);
    const Tensor* t = sd.find(key);
    FLAME_CHECK(t != nullptr, op, "missing key \"", key, "\"");
    const Tensor& mine = shadow_[i];
    FLAME_CHECK(t->sizes() == mine.sizes() && t->dtype() == mine.dtype(), op, key, " has shape ", t->sizes(),
                " dtype ", dtype_name(t->dtype()), ", expected ", mine.sizes(), " ", dtype_name(mine.dtype()));
    Tensor s = make_empty_in_layout_of(mine, mine.dtype(), mine.device(), "EMA");
    s.copy_(*t);
    shadow.push_back(std::move(s));
  }
  const Tensor* n = sd.find("num_updates");
  FLAME_CHECK(n != nullptr, op, "missing key \"num_updates\"");
  FLAME_CHECK(n->numel() == 1 && !is_floating(n->dtype()), op, "num_updates must be an integer scalar");
  const int64_t updates = n->item<int64_t>();
  FLAME_CHECK(updates >= 0, op, "num_updates is negative (", updates, ")");
  FLAME_CHECK(sd.size() == params_.size() + 1, op, "the state has ", sd.size() - 1, " shadow tensors, the EMA has ",
              params_.size(), " parameters");
  // Copy into the live shadow tensors, keeping their identity.
  for (std::size_t i = 0; i < shadow_.size(); ++i) shadow_[i].copy_(shadow[i]);
  num_updates_ = updates;
  if (counter_.defined()) counter_.fill_(static_cast<double>(updates));
}

}  // namespace flame::optim
