// CUDA side of Linear's fused epilogues: cuBLASLt GEMMs with bias / GELU / bias-gradient
// epilogues, and one elementwise kernel for dy * gelu_tanh'(pre). Kernels first, launchers after.
// The op layer and the rule of when these apply: Note [Linear epilogues] in
// src/ops/linear_epilogue.cpp.
//
// Note [Epilogue GEMM layouts]
// FLAME is row-major, cuBLAS column-major (Note [Row-major GEMM through cuBLASLt] in matmul.cu):
// a contiguous row-major [R, C] matrix is the column-major [C, R] with leading dimension C.
//  - forward  y [M, N] = x [M, K] @ w [N, K]^T is D [N, M] (ld N) = op(A) B with A = w, stored
//    [K, N] (ld K, op T), and B = x, stored [K, M] (ld K, op N). The bias vector has D's row
//    count N (EPILOGUE_BIAS, GELU_BIAS, GELU_AUX_BIAS); aux (pre) is laid out like D (ld N).
//  - wgrad    dw [N, K] = dy [M, N]^T @ x [M, K] is D [K, N] (ld K) = A op(B) with A = x, stored
//    [K, M] (ld K, op N), and B = dy, stored [N, M] (ld N, op T). The bias gradient has D's
//    column count N and sums over the GEMM's k = M: EPILOGUE_BGRADB.
//  - dgelu    dpre [M, N] = (dy [M, P] @ w [P, N]) * gelu'(pre) is D [N, M] (ld N) = A B with
//    A = w, stored [N, P] (ld N, op N), and B = dy, stored [P, M] (ld P, op N); EPILOGUE_DGELU
//    or DGELU_BGRAD, whose bias gradient has D's row count N; aux (pre) is laid out like D.
// cuBLASLt's GELU is the tanh approximation, as gelu_tanh.
//
// Note [Epilogue plans]
// Layouts and the heuristic's algorithm are cached per device, dtype, compute type, epilogue,
// transposes, sizes and leading dims (the rule in Note [Linear epilogues] fixes every pointer to
// 16-byte alignment, so alignment needs no key). A shape the heuristic offers nothing for is
// cached as unsupported, so the question is asked once and the call returns false from then on
// (as it does when cuBLASLt answers NOT_SUPPORTED at launch, before running anything). The operation
// descriptor carries the bias and aux pointers, so it is made per call (host memory only, safe
// under graph capture) and never shared between threads. The workspace is matmul.cu's
// (Note [Matmul workspace]); under capture it comes from the graph's pool.
#include <cublasLt.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <unordered_map>

#include "flame/cuda.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/epi/lt_shared.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/core/dispatch.h"
#include "src/ops/scalar_math.h"

#define FLAME_EPI_CHECK(op, call)                                                                    \
  do {                                                                                               \
    cublasStatus_t flame_st_ = (call);                                                               \
    if (flame_st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      FLAME_FAIL(op, "cuBLASLt call ", #call, " failed: ", cublasLtGetStatusName(flame_st_), " (",  \
                 cublasLtGetStatusString(flame_st_), ") at ", __FILE__, ":", __LINE__);             \
  } while (0)

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

// ---------------------------------------------------------------------------------------------
// Epilogue GEMM plans (Note [Epilogue plans]).
// ---------------------------------------------------------------------------------------------
struct EpiKey {
  int device;
  int dtype;
  int compute;
  int epilogue;
  bool ta, tb;
  uint64_t m, n, k;
  int64_t lda, ldb, ldc, ld_aux;
  bool operator==(const EpiKey& o) const { return std::memcmp(this, &o, sizeof(EpiKey)) == 0; }
};
struct EpiKeyHash {
  std::size_t operator()(const EpiKey& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the (zero-initialised) bytes
    for (std::size_t i = 0; i < sizeof(EpiKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};
struct EpiPlan {
  bool supported = false;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
};

std::shared_mutex& epi_mutex() {
  static std::shared_mutex mu;
  return mu;
}
std::unordered_map<EpiKey, EpiPlan, EpiKeyHash>& epi_cache() {
  static auto* cache = new std::unordered_map<EpiKey, EpiPlan, EpiKeyHash>();  // never destroyed
  return *cache;
}

// The pointers a call binds to its operation descriptor.
struct EpiPointers {
  const void* bias = nullptr;  // bias (forward) or bias gradient (backward); may be null
  const void* aux = nullptr;   // pre-activation: written by GELU_AUX*, read by DGELU*
};

struct Types {
  cudaDataType_t type;
  cublasComputeType_t compute;
};
Types types_of(DType dt) {
  switch (dt) {
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case DType::f16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
    default:
      return {CUDA_R_32F, flame::cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
  }
}

// A fresh operation descriptor for key with p bound; the caller destroys it.
cublasLtMatmulDesc_t make_desc(const EpiKey& key, const EpiPointers& p) {
  cublasLtMatmulDesc_t op = nullptr;
  FLAME_EPI_CHECK("linear", cublasLtMatmulDescCreate(&op, static_cast<cublasComputeType_t>(key.compute), CUDA_R_32F));
  const cublasOperation_t ta = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const auto epi = static_cast<cublasLtEpilogue_t>(key.epilogue);
  cublasStatus_t st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (st == CUBLAS_STATUS_SUCCESS && p.bias != nullptr)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias));
  if (st == CUBLAS_STATUS_SUCCESS && p.aux != nullptr) {
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux, sizeof(p.aux));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &key.ld_aux, sizeof(key.ld_aux));
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulDescDestroy(op);
    FLAME_FAIL("linear", "cannot describe the epilogue GEMM (epilogue ", key.epilogue,
               "): ", cublasLtGetStatusName(st));
  }
  return op;
}

void destroy_layouts(EpiPlan& plan) {
  if (plan.la) cublasLtMatrixLayoutDestroy(plan.la);
  if (plan.lb) cublasLtMatrixLayoutDestroy(plan.lb);
  if (plan.lc) cublasLtMatrixLayoutDestroy(plan.lc);
  plan.la = plan.lb = plan.lc = nullptr;
}

// The cached plan of key (built on a miss with the heuristic; unsupported when it offers nothing).
const EpiPlan& get_epi_plan(const EpiKey& key, cudaDataType_t type, const EpiPointers& p) {
  {
    std::shared_lock<std::shared_mutex> lock(epi_mutex());
    const auto it = epi_cache().find(key);
    if (it != epi_cache().end()) return it->second;
  }
  EpiPlan plan;
  const uint64_t a_rows = key.ta ? key.k : key.m, a_cols = key.ta ? key.m : key.k;
  const uint64_t b_rows = key.tb ? key.n : key.k, b_cols = key.tb ? key.k : key.n;
  FLAME_EPI_CHECK("linear", cublasLtMatrixLayoutCreate(&plan.la, type, a_rows, a_cols, key.lda));
  FLAME_EPI_CHECK("linear", cublasLtMatrixLayoutCreate(&plan.lb, type, b_rows, b_cols, key.ldb));
  FLAME_EPI_CHECK("linear", cublasLtMatrixLayoutCreate(&plan.lc, type, key.m, key.n, key.ldc));
  cublasLtMatmulDesc_t op = make_desc(key, p);
  cublasLtMatmulPreference_t pref = nullptr;
  FLAME_EPI_CHECK("linear", cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kLtWorkspaceBytes;
  const uint32_t align = 16;
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(shared_lt_handle(key.device), op, plan.la, plan.lb, plan.lc, plan.lc, pref, 1,
                                        &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(op);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan.supported = true;
    plan.algo = result.algo;
    plan.workspace = result.workspaceSize;
  } else {
    destroy_layouts(plan);  // cached as unsupported: the op layer composes this shape
  }
  std::unique_lock<std::shared_mutex> lock(epi_mutex());
  const auto [it, inserted] = epi_cache().emplace(key, plan);
  if (!inserted) destroy_layouts(plan);  // another thread built it meanwhile: keep theirs
  return it->second;
}

// The rule's dtype and layout part (Note [Linear epilogues]): bf16/f16/f32, contiguous, 16-byte
// aligned. Undefined tensors pass.
bool fits(const Tensor& t, DType dt) {
  if (!t.defined()) return true;
  return t.dtype() == dt && t.is_contiguous() && (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15u) == 0;
}
bool epilogue_dtype(DType dt) { return dt == DType::bf16 || dt == DType::f16 || dt == DType::f32; }
bool size_ok(int64_t v) { return v >= 1 && v <= INT32_MAX; }
bool size8_ok(int64_t v) { return size_ok(v) && v % 8 == 0; }

// Runs the GEMM of key with p bound; false (and nothing written) when cuBLASLt cannot.
bool run_epi(CudaBackend& be, const EpiKey& key, cudaDataType_t type, const EpiPointers& p, const void* a,
             const void* b, void* d) {
  const EpiPlan& plan = get_epi_plan(key, type, p);
  if (!plan.supported) return false;
  const cudaStream_t stream = be.stream();
  std::shared_ptr<void> captured_workspace;
  void* workspace = nullptr;
  if (plan.workspace > 0) {
    if (thread_is_capturing(be.device())) {  // Note [Matmul workspace]
      captured_workspace = be.allocate(plan.workspace);
      workspace = captured_workspace.get();
    } else {
      std::size_t have = 0;
      workspace = shared_lt_workspace(be.device(), stream, &have);
      if (have < plan.workspace) return false;
    }
  }
  cublasLtMatmulDesc_t op = make_desc(key, p);
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t st = cublasLtMatmul(shared_lt_handle(be.device()), op, &one, a, plan.la, b, plan.lb, &zero, d,
                                           plan.lc, d, plan.lc, &plan.algo, workspace, plan.workspace, stream);
  cublasLtMatmulDescDestroy(op);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;  // refused before launching: compose instead
  FLAME_EPI_CHECK("linear", st);
  if (launch_blocking()) {  // Note [Launch blocking]: name the GEMM if it faults
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FLAME_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status == cudaStreamCaptureStatusNone) {
      const cudaError_t err = cudaStreamSynchronize(stream);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        FLAME_FAIL("linear", "cuBLASLt epilogue GEMM (epilogue ", key.epilogue, ") m=", key.m, " n=", key.n,
                   " k=", key.k, " failed on the GPU: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
      }
    }
  }
  return true;
}

EpiKey base_key(const CudaBackend& be, DType dt, cublasComputeType_t compute, cublasLtEpilogue_t epi) {
  EpiKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in hashing and comparison
  key.device = be.device();
  key.dtype = static_cast<int>(dt);
  key.compute = static_cast<int>(compute);
  key.epilogue = static_cast<int>(epi);
  return key;
}

}  // namespace

// Note [Epilogue GEMM layouts], forward.
bool CudaBackend::linear_bias_act(const Tensor& y, const Tensor& pre, const Tensor& x, const Tensor& w,
                                  const Tensor& bias, bool gelu) {
  const DType dt = y.dtype();
  if (!epilogue_dtype(dt) || y.dim() != 2 || x.dim() != 2 || w.dim() != 2) return false;
  if (!fits(y, dt) || !fits(pre, dt) || !fits(x, dt) || !fits(w, dt) || !fits(bias, dt)) return false;
  const int64_t M = y.size(0), N = y.size(1), K = x.size(1);
  if (x.size(0) != M || w.size(0) != N || w.size(1) != K) return false;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != N)) return false;
  if (pre.defined() && (!gelu || pre.sizes() != y.sizes())) return false;
  if (!bias.defined() && !gelu) return false;  // a plain GEMM: matmul's business
  if (!size_ok(M) || !size8_ok(N) || !size8_ok(K)) return false;
  DeviceGuard guard(device());
  const Types t = types_of(dt);
  cublasLtEpilogue_t epi;
  if (!gelu) epi = CUBLASLT_EPILOGUE_BIAS;
  else if (pre.defined()) epi = bias.defined() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  else epi = bias.defined() ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  EpiKey key = base_key(*this, dt, t.compute, epi);
  key.ta = true;
  key.tb = false;
  key.m = static_cast<uint64_t>(N);
  key.n = static_cast<uint64_t>(M);
  key.k = static_cast<uint64_t>(K);
  key.lda = K;
  key.ldb = K;
  key.ldc = N;
  key.ld_aux = pre.defined() ? N : 0;
  EpiPointers p;
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.aux = pre.defined() ? pre.data_ptr() : nullptr;
  return run_epi(*this, key, t.type, p, w.data_ptr(), x.data_ptr(), y.data_ptr());
}

// Note [Epilogue GEMM layouts], wgrad.
bool CudaBackend::linear_wgrad_bgrad(const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x) {
  const DType dt = dw.dtype();
  if (!epilogue_dtype(dt) || !dbias.defined() || dw.dim() != 2 || dy.dim() != 2 || x.dim() != 2) return false;
  if (!fits(dw, dt) || !fits(dbias, dt) || !fits(dy, dt) || !fits(x, dt)) return false;
  const int64_t N = dw.size(0), K = dw.size(1), M = dy.size(0);
  if (dy.size(1) != N || x.size(0) != M || x.size(1) != K || dbias.dim() != 1 || dbias.size(0) != N) return false;
  if (!size_ok(M) || !size8_ok(N) || !size8_ok(K)) return false;
  DeviceGuard guard(device());
  const Types t = types_of(dt);
  EpiKey key = base_key(*this, dt, t.compute, CUBLASLT_EPILOGUE_BGRADB);
  key.ta = false;
  key.tb = true;
  key.m = static_cast<uint64_t>(K);
  key.n = static_cast<uint64_t>(N);
  key.k = static_cast<uint64_t>(M);
  key.lda = K;
  key.ldb = N;
  key.ldc = K;
  EpiPointers p;
  p.bias = dbias.data_ptr();
  return run_epi(*this, key, t.type, p, x.data_ptr(), dy.data_ptr(), dw.data_ptr());
}

// Note [Epilogue GEMM layouts], dgelu.
bool CudaBackend::linear_dgelu_bgrad(const Tensor& dpre, const Tensor& dbias, const Tensor& dy, const Tensor& w,
                                     const Tensor& pre) {
  const DType dt = dpre.dtype();
  if (!epilogue_dtype(dt) || dpre.dim() != 2 || dy.dim() != 2 || w.dim() != 2 || !pre.defined()) return false;
  if (!fits(dpre, dt) || !fits(dbias, dt) || !fits(dy, dt) || !fits(w, dt) || !fits(pre, dt)) return false;
  const int64_t M = dpre.size(0), N = dpre.size(1), P = dy.size(1);
  if (dy.size(0) != M || w.size(0) != P || w.size(1) != N || pre.sizes() != dpre.sizes()) return false;
  if (dbias.defined() && (dbias.dim() != 1 || dbias.size(0) != N)) return false;
  if (!size_ok(M) || !size8_ok(N) || !size8_ok(P)) return false;
  DeviceGuard guard(device());
  const Types t = types_of(dt);
  const cublasLtEpilogue_t epi = dbias.defined() ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  EpiKey key = base_key(*this, dt, t.compute, epi);
  key.ta = false;
  key.tb = false;
  key.m = static_cast<uint64_t>(N);
  key.n = static_cast<uint64_t>(M);
  key.k = static_cast<uint64_t>(P);
  key.lda = N;
  key.ldb = P;
  key.ldc = N;
  key.ld_aux = N;
  EpiPointers p;
  p.bias = dbias.defined() ? dbias.data_ptr() : nullptr;
  p.aux = pre.data_ptr();
  return run_epi(*this, key, t.type, p, w.data_ptr(), dy.data_ptr(), dpre.data_ptr());
}

bool CudaBackend::gelu_tanh_backward(const Tensor& dpre, const Tensor& dy, const Tensor& pre) {
  const DType dt = dpre.dtype();
  if (!is_floating(dt) || dy.dtype() != dt || pre.dtype() != dt) return false;
  if (!dpre.is_contiguous() || !dy.is_contiguous() || !pre.is_contiguous()) return false;
  if (dy.sizes() != dpre.sizes() || pre.sizes() != dpre.sizes()) return false;
  const int64_t n = dpre.numel();
  if (n == 0) return true;
  DeviceGuard guard(device());
  constexpr int kThreads = 256;
  dispatch_floating(dt, "gelu_tanh_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = static_cast<int>(16 / sizeof(T));
    auto* out = static_cast<T*>(dpre.data_ptr());
    const auto* g = static_cast<const T*>(dy.data_ptr());
    const auto* x = static_cast<const T*>(pre.data_ptr());
    const bool aligned = ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(g) |
                           reinterpret_cast<uintptr_t>(x)) & 15u) == 0;
    const int64_t cap = static_cast<int64_t>(sm_count(device())) * 8;
    if (aligned && n % V == 0) {
      const int64_t packs = n / V;
      const unsigned blocks = blocks_for(packs, kThreads, cap);
      gelu_tanh_backward_vec<T, V><<<blocks, kThreads, 0, stream()>>>(out, g, x, packs);
    } else {
      const unsigned blocks = blocks_for(n, kThreads, cap);
      gelu_tanh_backward_scalar<T><<<blocks, kThreads, 0, stream()>>>(out, g, x, n);
    }
    FLAME_CUDA_CHECK_LAUNCH();
  });
  return true;
}

}  // namespace flame::backend::cuda
