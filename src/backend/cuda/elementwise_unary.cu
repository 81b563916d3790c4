// Unary elementwise ops of kinds `same` and `predicate` (Note [Op list]); the `floating` ones are
// compiled in elementwise_unary_float.cu. Kernels: Note [Elementwise kernels].
#include "src/backend/cuda/elementwise.cuh"

namespace flame::backend::cuda {

void CudaBackend::unary(UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) {
  using ew::unary_typed;
#define FLAME_EW_CASE_same(name, Functor) \
  case UnaryOp::name: return unary_typed<fn::Functor, OpKind::same>(*this, dst, src, p);
#define FLAME_EW_CASE_predicate(name, Functor) \
  case UnaryOp::name: return unary_typed<fn::Functor, OpKind::predicate>(*this, dst, src, p);
#define FLAME_EW_CASE_floating(name, Functor) \
  case UnaryOp::name: return ew::unary_floating(*this, op, dst, src, p);
#define FLAME_CASE(name, Functor, kind, ...) FLAME_EW_CASE_##kind(name, Functor)
  switch (op) { FLAME_UNARY_OPS(FLAME_CASE) }
#undef FLAME_CASE
#undef FLAME_EW_CASE_same
#undef FLAME_EW_CASE_predicate
#undef FLAME_EW_CASE_floating
  FLAME_FAIL("cuda unary", "unknown op ", static_cast<int>(op));
}

}  // namespace flame::backend::cuda
