// Default bodies of the "graph" block of Backend (capturable EMA, sync-free gradient norm and
// clipping): a backend that does not implement them says so instead of failing to build.
#include "src/backend/backend.h"

namespace flame::backend {

void Backend::ema_update_device(const TensorList&, const TensorList&, const Tensor&, double, bool) {
  FLAME_FAIL("ema_update_device", "not supported by this backend");
}

void Backend::foreach_norm_accumulate(const TensorList&, double, const Tensor&) {
  FLAME_FAIL("foreach_norm_accumulate", "not supported by this backend");
}

void Backend::foreach_clip_scale(const TensorList&, const Tensor&, double) {
  FLAME_FAIL("foreach_clip_scale", "not supported by this backend");
}

}  // namespace flame::backend
