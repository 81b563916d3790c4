#include "src/backend/cpu/cpu_backend.h"
namespace flame::backend::cpu {
void CpuBackend::index_select(const Tensor&, const Tensor&, int64_t, const Tensor&) { FLAME_FAIL("index_select", "not implemented"); }
void CpuBackend::gather(const Tensor&, const Tensor&, int64_t, const Tensor&) { FLAME_FAIL("gather", "not implemented"); }
void CpuBackend::scatter(const Tensor&, int64_t, const Tensor&, const Tensor&, bool) { FLAME_FAIL("scatter", "not implemented"); }
Tensor CpuBackend::masked_select(const Tensor&, const Tensor&) { FLAME_FAIL("masked_select", "not implemented"); }
void CpuBackend::sort(const Tensor&, const Tensor&, const Tensor&, int64_t, bool) { FLAME_FAIL("sort", "not implemented"); }
}  // namespace flame::backend::cpu
