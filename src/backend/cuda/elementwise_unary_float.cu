// Unary elementwise ops of kind `floating` (Note [Op list]): exp, log, gelu, silu, ... on
// f32/f64/bf16/f16. Kernels: Note [Elementwise kernels].
#include "src/backend/cuda/elementwise.cuh"

namespace flame::backend::cuda::ew {

void unary_floating(CudaBackend& be, UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) {
#define FLAME_EW_CASE_same(name, Functor)
#define FLAME_EW_CASE_predicate(name, Functor)
#define FLAME_EW_CASE_floating(name, Functor) \
  case UnaryOp::name: return unary_typed<fn::Functor, OpKind::floating>(be, dst, src, p);
#define FLAME_CASE(name, Functor, kind, ...) FLAME_EW_CASE_##kind(name, Functor)
  switch (op) {
    FLAME_UNARY_OPS(FLAME_CASE)
    default: break;
  }
#undef FLAME_CASE
#undef FLAME_EW_CASE_same
#undef FLAME_EW_CASE_predicate
#undef FLAME_EW_CASE_floating
  FLAME_FAIL("cuda unary", "op ", static_cast<int>(op), " is not a floating op");
}

}  // namespace flame::backend::cuda::ew
