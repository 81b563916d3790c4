// CUDA reductions (sum, mean, prod, max, min, argmax, argmin, any, all): the op dispatch. The
// kernels and their launcher are in reduce_kernels.cuh, instantiated per family in reduce_sum.cu,
// reduce_minmax.cu, reduce_arg.cu and reduce_anyall.cu (split so that they compile in parallel);
// cumsum is in cumsum.cu, softmax in softmax*.cu. Performance notes: docs/cuda-kernels.md.
//
// Note [CUDA reduction paths]
// The op layer hands us src whose last reduce_ndim dims are reduced. On the host we first drop
// size-1 dims and merge dims that are contiguous with each other, separately for kept and reduced
// dims (for order-free ops the reduced dims are also sorted by stride so a permuted tensor still
// merges; argmax/argmin keep the logical order because their result is a logical index). Then:
//  (a) row path: the reduced extent is one dim of stride 1 (length >= 32). A warp (short rows) or a
//      256-thread block (long rows) reduces one row with 16-byte vector loads and shuffles;
//  (b) column path: the reduced extent is one strided dim. Threads run over outputs (consecutive
//      outputs are adjacent in memory for a contiguous tensor, so loads coalesce), a block's
//      threadIdx.y splits the reduced extent and shared memory combines the pieces. When the
//      outputs are one unit-stride dim and alignment allows, a thread owns V = min(4, 16 bytes /
//      element) adjacent outputs and loads them as one vector per reduced index;
//  (c) general path: like (b) but the reduced offset comes from StridedInfo (divisions per element).
// When there are too few outputs to fill the GPU, each output's reduced extent is split into
// `splits` chunks reduced by different blocks into a float/double/int64 partial buffer, and a
// second kernel combines them in a fixed order (deterministic, no atomics). Accumulation: float for
// f32/bf16/f16, double for f64, int64 for integers and bool (wrapping), like compute_t; the CPU
// reference accumulates floating types in double, so results agree to rounding, not bit for bit.
// argmax/argmin carry (value, index) pairs; the combine prefers NaN, then the larger (smaller)
// value, then the smaller index, which is associative and commutative, so the answer is the
// CPU's "first NaN, else first extreme" whatever order the pieces are combined in.
#include "src/backend/cuda/reduce_kernels.cuh"

namespace flame::backend::cuda {

void CudaBackend::reduce(ReduceOp op, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  FLAME_CHECK(reduce_ndim >= 0 && reduce_ndim <= src.dim(), "reduce", "reduce_ndim ", reduce_ndim,
              " out of range for a source of shape ", src.sizes());
  FLAME_CHECK(dst.is_contiguous(), "reduce", "the CUDA kernel expects a contiguous destination");
  DeviceGuard guard(device());
  switch (op) {
    case ReduceOp::sum: return reduce_op<ReduceOp::sum>(*this, dst, src, reduce_ndim);
    case ReduceOp::mean: return reduce_op<ReduceOp::mean>(*this, dst, src, reduce_ndim);
    case ReduceOp::prod: return reduce_op<ReduceOp::prod>(*this, dst, src, reduce_ndim);
    case ReduceOp::max: return reduce_op<ReduceOp::max>(*this, dst, src, reduce_ndim);
    case ReduceOp::min: return reduce_op<ReduceOp::min>(*this, dst, src, reduce_ndim);
    case ReduceOp::argmax: return reduce_op<ReduceOp::argmax>(*this, dst, src, reduce_ndim);
    case ReduceOp::argmin: return reduce_op<ReduceOp::argmin>(*this, dst, src, reduce_ndim);
    case ReduceOp::any: return reduce_op<ReduceOp::any>(*this, dst, src, reduce_ndim);
    case ReduceOp::all: return reduce_op<ReduceOp::all>(*this, dst, src, reduce_ndim);
  }
}

}  // namespace flame::backend::cuda
