#include "src/backend/cpu/cpu_backend.h"
namespace flame::backend::cpu {
void CpuBackend::reduce(ReduceOp, const Tensor&, const Tensor&, int64_t) { FLAME_FAIL("reduce", "not implemented"); }
void CpuBackend::cumsum(const Tensor&, const Tensor&, int64_t) { FLAME_FAIL("cumsum", "not implemented"); }
void CpuBackend::softmax(const Tensor&, const Tensor&, int64_t, bool) { FLAME_FAIL("softmax", "not implemented"); }
}  // namespace flame::backend::cpu
