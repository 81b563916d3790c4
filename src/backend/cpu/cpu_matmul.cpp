#include "src/backend/cpu/cpu_backend.h"
namespace flame::backend::cpu {
void CpuBackend::matmul(const Tensor&, const Tensor&, const Tensor&) { FLAME_FAIL("matmul", "not implemented"); }
}  // namespace flame::backend::cpu
