// Part 0 of the CPU binary kernels (Note [Elementwise parts] in cpu_elementwise_parts.h).
#include "src/backend/cpu/cpu_elementwise_parts.h"

namespace flame::backend::cpu::ew {
template void binary_part<0>(BinaryOp, const Tensor&, const Tensor&, const Tensor&);
}  // namespace flame::backend::cpu::ew
