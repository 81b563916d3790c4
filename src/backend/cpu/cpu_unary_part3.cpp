// Part 3 of the CPU unary kernels (Note [Elementwise parts] in cpu_elementwise_parts.h).
#include "src/backend/cpu/cpu_elementwise_parts.h"

namespace flame::backend::cpu::ew {
template void unary_part<3>(UnaryOp, const Tensor&, const Tensor&, const UnaryParams&);
}  // namespace flame::backend::cpu::ew
