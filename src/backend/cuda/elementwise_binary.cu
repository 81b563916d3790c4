// Binary elementwise ops (add, mul, comparisons, ...). Kernels: Note [Elementwise kernels].
#include "src/backend/cuda/elementwise.cuh"

namespace flame::backend::cuda {

void CudaBackend::binary(BinaryOp op, const Tensor& dst, const Tensor& a, const Tensor& b) {
  switch (op) {
#define FLAME_CASE(name, Functor, kind, ...) \
  case BinaryOp::name: return ew::binary_typed<fn::Functor, OpKind::kind>(*this, dst, a, b);
    FLAME_BINARY_OPS(FLAME_CASE)
#undef FLAME_CASE
  }
  FLAME_FAIL("cuda binary", "unknown op ", static_cast<int>(op));
}

}  // namespace flame::backend::cuda
