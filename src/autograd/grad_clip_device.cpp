// Sync-free gradient norm and clipping (flame/autograd.h: clip_grad_norm, grad_norm).
//
// Note [Device gradient clipping]
// clip_grad_norm_ returns a double, so it waits for the GPU every step and cannot run inside a
// captured CUDA graph. clip_grad_norm keeps everything on the gradients' device, as PyTorch's
// foreach clip_grad_norm_ does: the gradients are bucketed by dtype (first-seen order); one f64
// accumulator (0-d) is zeroed, each bucket adds its sum of |g|^p (or folds its max |g|) with one
// multi-tensor pass (Backend::foreach_norm_accumulate: double accumulation, a fixed reduction
// order), the norm is acc^(1/p) as a 0-d f64, and each bucket is scaled in place by
// min(1, max_norm / (norm + 1e-6)) read from device memory by the kernel
// (Backend::foreach_clip_scale). Non-finite norms follow error_if_nonfinite=False: a NaN norm
// makes every gradient NaN, an Inf norm scales by 0. The returned norm is that 0-d f64 converted
// to f32 (f64 when a gradient is f64). Every step is a FLAME op or a backend call on the current
// stream: nothing reads back, so a training step with clipping can be captured and replayed.
// The CPU backend runs the same arithmetic, so the CPU path is a reference for the CUDA one.
#include <cmath>
#include <vector>

#include "flame/autograd.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/backend/fused/multi_tensor.h"

namespace flame {

namespace {

struct DTypeBucket {
  DType dtype;
  TensorList tensors;
};

// The gradients of `keys` present in the store, bucketed by dtype; all must share one device.
// The handles share the store's buffers (get()), so scaling them scales the store's gradients.
std::vector<DTypeBucket> bucket_grads(const Gradients& grads, const TensorList& keys, const char* op,
                                      Device* device) {
  std::vector<DTypeBucket> buckets;
  bool have_device = false;
  for (const Tensor& k : keys) {
    const Tensor g = grads.try_get(k);
    if (!g.defined() || g.numel() == 0) continue;
    FLAME_CHECK(is_floating(g.dtype()), op, "gradient of dtype ", dtype_name(g.dtype()), " (shape ", g.sizes(),
                "); gradients are floating");
    if (!have_device) {
      *device = g.device();
      have_device = true;
    }
    FLAME_CHECK(g.device() == *device, op, "gradients on ", device->str(), " and ", g.device().str(),
                "; the device version needs every gradient on one device (use clip_grad_norm_)");
    DTypeBucket* b = nullptr;
    for (DTypeBucket& x : buckets)
      if (x.dtype == g.dtype()) b = &x;
    if (b == nullptr) b = &buckets.emplace_back(DTypeBucket{g.dtype(), {}});
    b->tensors.push_back(g);
  }
  return buckets;
}

void check_norm_type(double norm_type, const char* op) {
  FLAME_CHECK(norm_type > 0 && !std::isnan(norm_type), op, "norm_type must be > 0 or infinity, got ", norm_type);
}

// The total norm as a 0-d f64 on `device` (0 when there is nothing).
Tensor total_norm_f64(const std::vector<DTypeBucket>& buckets, double norm_type, Device device) {
  Tensor acc = Tensor::zeros({}, TensorOptions(DType::f64, device));
  for (const DTypeBucket& b : buckets) backend::fused::foreach_norm_accumulate.run(device, b.tensors, norm_type, acc);
  if (std::isinf(norm_type) || norm_type == 1.0) return acc;
  return norm_type == 2.0 ? acc.sqrt() : acc.pow(1.0 / norm_type);
}

Tensor result_of(const Tensor& norm64, const std::vector<DTypeBucket>& buckets) {
  for (const DTypeBucket& b : buckets)
    if (b.dtype == DType::f64) return norm64;
  return norm64.to(DType::f32);
}

Tensor clip_on_device(Gradients& grads, const TensorList& keys, double max_norm, double norm_type) {
  const char* op = "clip_grad_norm";
  check_norm_type(norm_type, op);
  FLAME_CHECK(!std::isnan(max_norm), op, "max_norm is NaN");
  NoGradGuard no_grad;
  Device device = Device::cpu();
  const std::vector<DTypeBucket> buckets = bucket_grads(grads, keys, op, &device);
  if (buckets.empty()) return Tensor::zeros({}, TensorOptions(DType::f32, device));
  const Tensor norm = total_norm_f64(buckets, norm_type, device);
  for (const DTypeBucket& b : buckets) backend::fused::foreach_clip_scale.run(device, b.tensors, norm, max_norm);
  for (const DTypeBucket& b : buckets)
    for (const Tensor& g : b.tensors) bump_version(g);
  return result_of(norm, buckets);
}

TensorList keys_of(const Gradients& grads) {
  TensorList keys;
  for (const auto& e : grads.entries()) keys.push_back(e.tensor);
  return keys;
}

}  // namespace

Tensor clip_grad_norm(Gradients& grads, double max_norm, double norm_type) {
  return clip_on_device(grads, keys_of(grads), max_norm, norm_type);
}

Tensor clip_grad_norm(Gradients& grads, const TensorList& params, double max_norm, double norm_type) {
  return clip_on_device(grads, params, max_norm, norm_type);
}

Tensor grad_norm(const Gradients& grads, double norm_type) {
  const char* op = "grad_norm";
  check_norm_type(norm_type, op);
  NoGradGuard no_grad;
  Device device = Device::cpu();
  const std::vector<DTypeBucket> buckets = bucket_grads(grads, keys_of(grads), op, &device);
  if (buckets.empty()) return Tensor::zeros({}, TensorOptions(DType::f32, device));
  return result_of(total_norm_f64(buckets, norm_type, device), buckets);
}

}  // namespace flame
