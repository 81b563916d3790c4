// CUDA side of Linear's fused epilogues: cuBLASLt GEMMs with bias / GELU / bias-gradient
// epilogues, and one elementwise kernel for dy * gelu_tanh'(pre). Kernels first, launchers after.
// The op layer and the rule of when these apply: Note [Linear epilogues] in
// src/ops/linear_epilogue.cpp.
//
// Note [Epilogue GEMM layouts]
// FLAME is row-major, cuBLAS column-major (Note [Row-major GEMM through cuBLASLt] in matmul.cu):
// a contiguous row-major [R, C] matrix is the column-major [C, R] with leading dimension C.
//  - forward  y [M, N] = x [M, K] @ w [N, K]^T is D [N, M] (ld N) = op(A) B with A = w, stored
//    [K, N] (ld K, or w's row stride for a block of a wider weight's columns; op T), and B = x, stored [K, M] (ld K, op N). The bias vector has D's row
//    count N (EPILOGUE_BIAS, GELU_BIAS, GELU_AUX_BIAS); aux (pre) is laid out like D (ld N).
//  - wgrad    dw [N, K] = dy [M, N]^T @ x [M, K] is D [K, N] (ld K) = A op(B) with A = x, stored
//    [K, M] (ld K, op N), and B = dy, stored [N, M] (ld N, op T). The bias gradient has D's
//    column count N and sums over the GEMM's k = M: EPILOGUE_BGRADB.
//  - dgelu    dpre [M, N] = (dy [M, P] @ w [P, N]) * gelu'(pre) is D [N, M] (ld N) = A B with
//    A = w, stored [N, P] (ld N, op N), and B = dy, stored [P, M] (ld P, op N); EPILOGUE_DGELU
//    or DGELU_BGRAD, whose bias gradient has D's row count N; aux (pre) is laid out like D.
// cuBLASLt's GELU is the tanh approximation, as gelu_tanh. Plans, their cache and their
// autotuning: epi_plan.cpp (Note [Epilogue plans], Note [Epilogue autotuning]).
#include <cublasLt.h>

#include <cstring>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/epi/epi_plan.h"
#include "src/backend/fused/linear_epilogue.h"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// dpre = dy * gelu_tanh'(pre): 16-byte packs where all three pointers and n allow, else scalars.
// ---------------------------------------------------------------------------------------------
template <class T, int V>
struct alignas(sizeof(T) * V) EpiPack {
  T v[V];
};

template <class T>
__global__ void gelu_tanh_backward_scalar(T* __restrict__ dpre, const T* __restrict__ dy, const T* __restrict__ pre,
                                          int64_t n) {
  using C = compute_t<T>;
  const fn::UnaryParams p{};
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    dpre[i] = convert<T>(convert<C>(dy[i]) * fn::GeluTanhGrad{}(convert<C>(pre[i]), p));
}

template <class T, int V>
__global__ void gelu_tanh_backward_vec(T* __restrict__ dpre, const T* __restrict__ dy, const T* __restrict__ pre,
                                       int64_t npacks) {
  using C = compute_t<T>;
  using P = EpiPack<T, V>;
  const fn::UnaryParams p{};
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < npacks; i += step) {
    const P g = reinterpret_cast<const P*>(dy)[i];
    const P x = reinterpret_cast<const P*>(pre)[i];
    P out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = convert<T>(convert<C>(g.v[j]) * fn::GeluTanhGrad{}(convert<C>(x.v[j]), p));
    reinterpret_cast<P*>(dpre)[i] = out;
  }
}

// The rule's dtype and layout part (Note [Linear epilogues]): bf16/f16/f32, contiguous, 16-byte
// aligned. Undefined tensors pass.
bool fits(const Tensor& t, DType dt) {
  if (!t.defined()) return true;
  return t.dtype() == dt && t.is_contiguous() && (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15u) == 0;
}
// A weight [N, K] read in place with unit column stride and a row stride ld >= K (a block of
// columns of a wider weight, e.g. FLUX's single-block proj_out split at the attention's width):
// cuBLASLt takes ld as A's leading dimension; rows start 16-byte aligned when ld % 8 == 0.
bool fits_rows(const Tensor& w, DType dt) {
  if (w.dim() != 2 || w.dtype() != dt) return false;
  if (w.is_contiguous()) return fits(w, dt);
  const int64_t ld = w.stride(0);
  return w.stride(1) == 1 && ld >= w.size(1) && ld % 8 == 0 && ld <= INT32_MAX &&
         (reinterpret_cast<uintptr_t>(w.data_ptr()) & 15u) == 0;
}
bool epilogue_dtype(DType dt) { return dt == DType::bf16 || dt == DType::f16 || dt == DType::f32; }
bool size_ok(int64_t v) { return v >= 1 && v <= INT32_MAX; }
bool size8_ok(int64_t v) { return size_ok(v) && v % 8 == 0; }

EpiKey base_key(const CudaBackend& be, DType dt, cublasComputeType_t compute, cublasLtEpilogue_t epi) {
  EpiKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in hashing and comparison
  key.device = be.device();
  key.dtype = static_cast<int>(dt);
  key.compute = static_cast<int>(compute);
  key.epilogue = static_cast<int>(epi);
  key.out_dtype = static_cast<int>(dt);
  return key;
}

}  // namespace

// Note [Epilogue GEMM layouts], forward.
static bool linear_bias_act_cuda(const Tensor& y, const Tensor& pre, const Tensor& x, const Tensor& w,
                                 const Tensor& bias, bool gelu) {
  CudaBackend& be = cuda_backend(x.device().index);
  const DType dt = y.dtype();
  if (!epilogue_dtype(dt) || y.dim() != 2 || x.dim() != 2 || w.dim() != 2) return false;
  if (!fits(y, dt) || !fits(pre, dt) || !fits(x, dt) || !fits_rows(w, dt) || !fits(bias, dt)) return false;
  const int64_t M = y.size(0), N = y.size(1), K = x.size(1);
  if (x.size(0) != M || w.size(0) != N || w.size(1) != K) return false;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != N)) return false;
  if (pre.defined() && (!gelu || pre.sizes() != y.sizes())) return false;
  if (!bias.defined() && !gelu) return false;  // a plain GEMM: matmul's business
  if (!size_ok(M) || !size8_ok(N) || !size8_ok(K)) return false;
  DeviceGuard guard(be.device());
  const Types t = types_of(dt);
  cublasLtEpilogue_t epi;
  if (!gelu) epi = CUBLASLT_EPILOGUE_BIAS;
  else if (pre.defined()) epi = bias.defined() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  else epi = bias.defined() ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  EpiKey key = base_key(be, dt, t.compute, epi);
  key.ta = true;
  key.tb = false;
  key.m = static_cast<uint64_t>(N);
  key.n = static_cast<uint64_t>(M);
  key.k = static_cast<uint64_t>(K);
  key.lda = w.is_contiguous() ? K : w.stride(0);
  key.ldb = K;
  key.ldc = N;
  key.ld_aux = pre.defined() ? N : 0;
  EpiCall c;
  c.a = w.data_ptr();
  c.b = x.data_ptr();
  c.d = y.data_ptr();
  c.bias = bias.defined() ? bias.data_ptr() : nullptr;
  c.aux = pre.defined() ? pre.data_ptr() : nullptr;
  return run_epi(be, key, t.type, c);
}

// Note [Epilogue GEMM layouts], wgrad.
static bool linear_wgrad_bgrad_cuda(const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x) {
  CudaBackend& be = cuda_backend(dy.device().index);
  // dw and dbias: dy's dtype, or f32 beside half dy (Note [Master-weight epilogues]).
  const DType dt = dy.dtype(), out_dt = dw.dtype();
  if (!epilogue_dtype(dt) || (out_dt != dt && out_dt != DType::f32)) return false;
  // Without a bias gradient this is a plain GEMM, matmul's business, unless it writes f32.
  if (!dbias.defined() && out_dt == dt) return false;
  if (dw.dim() != 2 || dy.dim() != 2 || x.dim() != 2) return false;
  if (!fits(dw, out_dt) || !fits(dbias, out_dt) || !fits(dy, dt) || !fits(x, dt)) return false;
  const int64_t N = dw.size(0), K = dw.size(1), M = dy.size(0);
  if (dy.size(1) != N || x.size(0) != M || x.size(1) != K) return false;
  if (dbias.defined() && (dbias.dim() != 1 || dbias.size(0) != N)) return false;
  if (!size_ok(M) || !size8_ok(N) || !size8_ok(K)) return false;
  DeviceGuard guard(be.device());
  const Types t = types_of(dt);
  EpiKey key =
      base_key(be, dt, t.compute, dbias.defined() ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT);
  key.out_dtype = static_cast<int>(out_dt);
  key.ta = false;
  key.tb = true;
  key.m = static_cast<uint64_t>(K);
  key.n = static_cast<uint64_t>(N);
  key.k = static_cast<uint64_t>(M);
  key.lda = K;
  key.ldb = N;
  key.ldc = K;
  EpiCall c;
  c.a = x.data_ptr();
  c.b = dy.data_ptr();
  c.d = dw.data_ptr();
  if (dbias.defined()) {
    c.bias = dbias.data_ptr();
    c.sum_src = dy.data_ptr();  // db = column sums of dy [M, N]
    c.sum_rows = M;
    c.sum_cols = N;
  }
  return run_epi(be, key, t.type, c);
}

// Note [Epilogue GEMM layouts], dgelu.
static bool linear_dgelu_bgrad_cuda(const Tensor& dpre, const Tensor& dbias, const Tensor& dy, const Tensor& w,
                                    const Tensor& pre) {
  CudaBackend& be = cuda_backend(dy.device().index);
  const DType dt = dpre.dtype();
  if (!epilogue_dtype(dt) || dpre.dim() != 2 || dy.dim() != 2 || w.dim() != 2 || !pre.defined()) return false;
  if (!fits(dpre, dt) || !fits(dbias, dt) || !fits(dy, dt) || !fits(w, dt) || !fits(pre, dt)) return false;
  const int64_t M = dpre.size(0), N = dpre.size(1), P = dy.size(1);
  if (dy.size(0) != M || w.size(0) != P || w.size(1) != N || pre.sizes() != dpre.sizes()) return false;
  if (dbias.defined() && (dbias.dim() != 1 || dbias.size(0) != N)) return false;
  if (!size_ok(M) || !size8_ok(N) || !size8_ok(P)) return false;
  DeviceGuard guard(be.device());
  const Types t = types_of(dt);
  const cublasLtEpilogue_t epi = dbias.defined() ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  EpiKey key = base_key(be, dt, t.compute, epi);
  key.ta = false;
  key.tb = false;
  key.m = static_cast<uint64_t>(N);
  key.n = static_cast<uint64_t>(M);
  key.k = static_cast<uint64_t>(P);
  key.lda = N;
  key.ldb = P;
  key.ldc = N;
  key.ld_aux = N;
  EpiCall c;
  c.a = w.data_ptr();
  c.b = dy.data_ptr();
  c.d = dpre.data_ptr();
  c.bias = dbias.defined() ? dbias.data_ptr() : nullptr;
  c.aux = pre.data_ptr();
  if (dbias.defined()) {  // db = column sums of dpre [M, N], the GEMM's own output
    c.sum_src = dpre.data_ptr();
    c.sum_rows = M;
    c.sum_cols = N;
  }
  return run_epi(be, key, t.type, c);
}

static bool gelu_tanh_backward_cuda(const Tensor& dpre, const Tensor& dy, const Tensor& pre) {
  CudaBackend& be = cuda_backend(dy.device().index);
  const DType dt = dpre.dtype();
  if (!is_floating(dt) || dy.dtype() != dt || pre.dtype() != dt) return false;
  if (!dpre.is_contiguous() || !dy.is_contiguous() || !pre.is_contiguous()) return false;
  if (dy.sizes() != dpre.sizes() || pre.sizes() != dpre.sizes()) return false;
  const int64_t n = dpre.numel();
  if (n == 0) return true;
  DeviceGuard guard(be.device());
  constexpr int kThreads = 256;
  dispatch_floating(dt, "gelu_tanh_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = static_cast<int>(16 / sizeof(T));
    auto* out = static_cast<T*>(dpre.data_ptr());
    const auto* g = static_cast<const T*>(dy.data_ptr());
    const auto* x = static_cast<const T*>(pre.data_ptr());
    const bool aligned = ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(g) |
                           reinterpret_cast<uintptr_t>(x)) & 15u) == 0;
    const int64_t cap = static_cast<int64_t>(sm_count(be.device())) * 8;
    if (aligned && n % V == 0) {
      const int64_t packs = n / V;
      const unsigned blocks = blocks_for(packs, kThreads, cap);
      gelu_tanh_backward_vec<T, V><<<blocks, kThreads, 0, be.stream()>>>(out, g, x, packs);
    } else {
      const unsigned blocks = blocks_for(n, kThreads, cap);
      gelu_tanh_backward_scalar<T><<<blocks, kThreads, 0, be.stream()>>>(out, g, x, n);
    }
    FLAME_CUDA_CHECK_LAUNCH();
  });
  return true;
}

void register_epilogue_kernels() {
  fused::linear_bias_act.define(DeviceType::cuda, &linear_bias_act_cuda);
  fused::linear_wgrad_bgrad.define(DeviceType::cuda, &linear_wgrad_bgrad_cuda);
  fused::linear_dgelu_bgrad.define(DeviceType::cuda, &linear_dgelu_bgrad_cuda);
  fused::gelu_tanh_backward.define(DeviceType::cuda, &gelu_tanh_backward_cuda);
}

}  // namespace flame::backend::cuda
