// CUDA matmul: cuBLASLt for floating dtypes, a tiled kernel for integers. Kernels first,
// launchers after. Performance notes: docs/cuda-kernels.md.
//
// Note [Row-major GEMM through cuBLASLt]
// FLAME is row-major, cuBLAS column-major. A row-major [R, C] matrix with strides (sr, 1) is, read
// column-major, its transpose [C, R] with leading dimension sr; with strides (1, sc) it is the
// column-major [R, C] itself (leading dimension sc), which cuBLAS transposes for us (op T). So
// dst [M, N] = a [M, K] @ b [K, N] is computed as dst^T [N, M] = b^T [N, K] @ a^T [K, M], with b as
// cuBLAS's A operand and a as its B operand, and each op N or T chosen from the operand's strides.
// Transposed views therefore cost no copy; only an operand with neither inner stride 1 (or a
// leading dimension cuBLAS rejects) is made contiguous first. A batch dim with stride 0
// (broadcast) goes to cuBLASLt as a batch stride of 0; when b is shared across the batch and a's
// batch and row dims merge, the batch is folded into M (one larger GEMM, the common Linear case).
//
// Note [cuBLASLt plans]
// One cublasLt handle per device, created on first use (cuBLASLt handles are thread-safe for
// cublasLtMatmul). A plan (operation and layout descriptors plus the heuristic's first algorithm
// and its workspace size) is cached per device, dtype, compute type, transposes, sizes, leading
// dims, batch strides and pointer alignment, in a map under a shared_mutex: lookups of known
// shapes take the shared lock only and run in parallel; a miss builds the plan outside any lock
// and inserts it under the exclusive lock (a racing duplicate is dropped). Plans are never
// erased, so a reference stays valid. No lock is held while cuBLASLt runs.
//
// Note [Matmul workspace]
// The workspace (kMaxWorkspace = 32 MiB, the most the heuristic may ask) is allocated once per
// (device, stream) with cudaMalloc and kept: a stream's matmuls run one after another, so they
// can share it, and no call allocates. Streams are never destroyed (Note [Recycled streams]), so
// the key stays meaningful. Under graph capture the workspace comes from the graph's private
// pool instead (allocate()), because replays may run on another stream than the capture's.
// Compute types: bf16/f16 accumulate in f32 (CUBLAS_COMPUTE_32F); f32 uses TF32 tensor cores only
// when flame::cuda::allow_tf32() is set; f64 uses CUBLAS_COMPUTE_64F.
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>

#include "flame/cuda.h"
#include "src/backend/cuda/common.cuh"
#include "src/core/dispatch.h"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/epi/lt_shared.h"
#include "src/backend/fused/matmul_add.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

#define FLAME_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                    \
    cublasStatus_t flame_st_ = (call);                                                                    \
    if (flame_st_ != CUBLAS_STATUS_SUCCESS)                                                               \
      FLAME_FAIL("matmul", "cuBLASLt call ", #call, " failed: ", cublasLtGetStatusName(flame_st_), " (", \
                 cublasLtGetStatusString(flame_st_), ") at ", __FILE__, ":", __LINE__);                  \
  } while (0)

namespace flame::backend::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Integer matmul: 32x32 output tile per 256-thread block, int64 accumulation, any strides.
// ---------------------------------------------------------------------------------------------
constexpr int kTile = 32;

struct MatStrides {
  int64_t b, r, c;  // batch, row, column strides in elements
};

template <class T>
__global__ void __launch_bounds__(256) matmul_int_kernel(const T* __restrict__ a, MatStrides sa, const T* __restrict__ b,
                                                         MatStrides sb, T* __restrict__ c, int64_t batch, int64_t M,
                                                         int64_t N, int64_t K) {
  __shared__ int64_t as[kTile][kTile + 1];
  __shared__ int64_t bs[kTile][kTile + 1];
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;  // ty in [0, 8): 4 rows each
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t z = blockIdx.z; z < batch; z += gridDim.z) {
    const T* ap = a + z * sa.b;
    const T* bp = b + z * sb.b;
    int64_t acc[4] = {0, 0, 0, 0};
    for (int64_t k0 = 0; k0 < K; k0 += kTile) {
      for (int i = ty; i < kTile; i += 8) {
        const int64_t r = row0 + i, k = k0 + tx;
        as[i][tx] = (r < M && k < K) ? static_cast<int64_t>(ap[r * sa.r + k * sa.c]) : 0;
        const int64_t kk = k0 + i, col = col0 + tx;
        bs[i][tx] = (kk < K && col < N) ? static_cast<int64_t>(bp[kk * sb.r + col * sb.c]) : 0;
      }
      __syncthreads();
#pragma unroll 8
      for (int k = 0; k < kTile; ++k) {
        const int64_t bv = bs[k][tx];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          acc[j] = static_cast<int64_t>(static_cast<uint64_t>(acc[j]) +
                                        static_cast<uint64_t>(as[ty + 8 * j][k]) * static_cast<uint64_t>(bv));
      }
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t r = row0 + ty + 8 * j, col = col0 + tx;
      if (r < M && col < N) c[(z * M + r) * N + col] = convert<T>(acc[j]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// cuBLASLt plumbing
// ---------------------------------------------------------------------------------------------

constexpr int kMaxMatmulDevices = 64;

cublasLtHandle_t lt_handle(int device) {
  static std::array<std::atomic<cublasLtHandle_t>, kMaxMatmulDevices> handles{};
  static std::mutex create_mutex;
  FLAME_CHECK(device >= 0 && device < kMaxMatmulDevices, "matmul", "device index ", device, " out of range");
  cublasLtHandle_t h = handles[device].load(std::memory_order_acquire);
  if (h != nullptr) return h;
  std::lock_guard<std::mutex> lock(create_mutex);
  h = handles[device].load(std::memory_order_acquire);
  if (h == nullptr) {
    FLAME_CUBLAS_CHECK(cublasLtCreate(&h));  // never destroyed
    handles[device].store(h, std::memory_order_release);
  }
  return h;
}

// A row-major [R, C] operand as cuBLAS sees it (Note [Row-major GEMM through cuBLASLt]).
struct Operand {
  bool trans;
  uint64_t rows, cols;  // of the stored column-major matrix
  int64_t ld;
};
std::optional<Operand> describe(int64_t R, int64_t C, int64_t sr, int64_t sc) {
  if (sc == 1 || C == 1) {  // stored as column-major [C, R], ld = sr
    const int64_t ld = R == 1 ? std::max<int64_t>(C, 1) : sr;
    if (ld >= std::max<int64_t>(C, 1)) return Operand{false, static_cast<uint64_t>(C), static_cast<uint64_t>(R), ld};
  }
  if (sr == 1 || R == 1) {  // stored as column-major [R, C], ld = sc; op T
    const int64_t ld = C == 1 ? std::max<int64_t>(R, 1) : sc;
    if (ld >= std::max<int64_t>(R, 1)) return Operand{true, static_cast<uint64_t>(R), static_cast<uint64_t>(C), ld};
  }
  return std::nullopt;
}

// Largest power of two (<= 256) dividing the address and every batch offset in bytes.
uint32_t alignment_of(const void* p, int64_t batch_stride_bytes) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(batch_stride_bytes) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

struct PlanKey {
  int device;
  int dtype;
  int compute;
  bool ta, tb;
  uint64_t m, n, k;
  int64_t lda, ldb, ldc;
  int32_t batch;
  int64_t stride_a, stride_b, stride_c;
  uint32_t align_a, align_b, align_c;
  bool operator==(const PlanKey& o) const { return std::memcmp(this, &o, sizeof(PlanKey)) == 0; }
};
using PlanKeyHash = LtKeyHash<PlanKey>;
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
};

constexpr std::size_t kMaxWorkspace = 32u << 20;

void destroy_plan(Plan& plan) {
  lt_destroy_layouts(plan.la, plan.lb, plan.lc);
  cublasLtMatmulDescDestroy(plan.op);
  plan.op = nullptr;
}

// Note [Matmul workspace]: one per (device, stream), created on first use, never freed.
void* stream_workspace(int device, cudaStream_t stream) {
  struct Key {
    int device;
    cudaStream_t stream;
    bool operator==(const Key& o) const { return device == o.device && stream == o.stream; }
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const { return std::hash<const void*>()(k.stream) ^ std::size_t(k.device); }
  };
  static std::shared_mutex mu;
  static auto* workspaces = new std::unordered_map<Key, void*, KeyHash>();  // never destroyed
  const Key key{device, stream};
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    const auto it = workspaces->find(key);
    if (it != workspaces->end()) return it->second;
  }
  std::unique_lock<std::shared_mutex> lock(mu);
  const auto it = workspaces->find(key);
  if (it != workspaces->end()) return it->second;
  void* ws = nullptr;
  const cudaError_t err = cudaMalloc(&ws, kMaxWorkspace);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    FLAME_FAIL("matmul", "cannot allocate the ", kMaxWorkspace >> 20, " MiB cuBLASLt workspace of cuda:", device, ": ",
               cudaGetErrorName(err));
  }
  workspaces->emplace(key, ws);
  return ws;
}

std::shared_mutex& plan_mutex() {
  static std::shared_mutex mu;
  return mu;
}
std::unordered_map<PlanKey, Plan, PlanKeyHash>& plan_cache() {
  static auto* cache = new std::unordered_map<PlanKey, Plan, PlanKeyHash>();  // never destroyed
  return *cache;
}

const Plan& get_plan(const PlanKey& key, cudaDataType_t type, cublasComputeType_t compute, cudaDataType_t scale) {
  {
    std::shared_lock<std::shared_mutex> lock(plan_mutex());
    const auto it = plan_cache().find(key);
    if (it != plan_cache().end()) return it->second;
  }
  Plan plan;
  FLAME_CUBLAS_CHECK(lt_gemm_desc(&plan.op, compute, scale, key.ta, key.tb));
  const LtGemmShape shape{key.ta,  key.tb,  key.m,     key.n,        key.k,       key.lda,
                          key.ldb, key.ldc, key.batch, key.stride_a, key.stride_b, key.stride_c};
  const cublasStatus_t made = lt_gemm_layouts(type, shape, plan.la, plan.lb, plan.lc);
  if (made != CUBLAS_STATUS_SUCCESS) destroy_plan(plan);
  FLAME_CUBLAS_CHECK(made);
  cublasLtMatmulPreference_t pref = nullptr;
  FLAME_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FLAME_CUBLAS_CHECK(lt_set_preference(pref, kMaxWorkspace, key.align_a, key.align_b, key.align_c));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_handle(key.device), plan.op, plan.la, plan.lb, plan.lc,
                                                           plan.lc, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy_plan(plan);
    FLAME_FAIL("matmul", "cuBLASLt found no algorithm for m=", key.m, " n=", key.n, " k=", key.k, " lda=", key.lda,
               " ldb=", key.ldb, " batch=", key.batch, " (", cublasLtGetStatusName(st), ")");
  }
  plan.algo = result.algo;
  plan.workspace = result.workspaceSize;
  std::unique_lock<std::shared_mutex> lock(plan_mutex());
  const auto [it, inserted] = plan_cache().emplace(key, plan);
  if (!inserted) {  // another thread built the same plan meanwhile: keep theirs
    destroy_plan(plan);
  }
  return it->second;
}

// A contiguous copy of t (same dtype and device), for operands cuBLAS cannot read in place.
Tensor contiguous_copy(CudaBackend& be, const Tensor& t) {
  Tensor c = Tensor::empty(t.sizes(), {t.dtype(), Device::cuda(be.device())});
  be.copy(c, t);
  return c;
}

// dst = a @ b, or c + a @ b when c is defined (beta = 1; c contiguous like dst, possibly dst).
void lt_matmul(CudaBackend& be, const Tensor& dst, Tensor a, Tensor b, const Tensor& c = Tensor()) {
  const int64_t B = dst.sizes()[0], M = dst.sizes()[1], N = dst.sizes()[2], K = a.sizes()[2];
  std::optional<Operand> ob = describe(K, N, b.strides()[1], b.strides()[2]);
  if (!ob) {
    b = contiguous_copy(be, b);
    ob = describe(K, N, N, 1);
  }
  const int64_t b_bs = B == 1 ? 0 : b.strides()[0];
  int64_t a_bs = B == 1 ? 0 : a.strides()[0], a_rs = a.strides()[1], a_cs = a.strides()[2];
  // Fold the batch into M when b is shared and a's [B, M] dims merge into rows of one stride.
  const bool fold = B > 1 && b_bs == 0 && (M == 1 || a_bs == M * a_rs);
  const int64_t Mg = fold ? B * M : M, batch = fold ? 1 : B;
  if (fold && M == 1) a_rs = a_bs;
  std::optional<Operand> oa = describe(Mg, K, a_rs, a_cs);
  if (!oa) {
    a = contiguous_copy(be, a);  // [B, M, K] contiguous: rows of K whether folded or not
    a_bs = B == 1 ? 0 : M * K;
    oa = describe(Mg, K, K, 1);
  }
  FLAME_CHECK(Mg <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX && batch <= INT32_MAX, "matmul",
              "sizes beyond 2^31 are not supported (M=", Mg, ", N=", N, ", K=", K, ", batch=", batch, ")");

  const DType dt = dst.dtype();
  cudaDataType_t type;
  cublasComputeType_t compute;
  cudaDataType_t scale = CUDA_R_32F;
  switch (dt) {
    case DType::bf16: type = CUDA_R_16BF; compute = CUBLAS_COMPUTE_32F; break;
    case DType::f16: type = CUDA_R_16F; compute = CUBLAS_COMPUTE_32F; break;
    case DType::f32:
      type = CUDA_R_32F;
      compute = flame::cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      break;
    case DType::f64: type = CUDA_R_64F; compute = CUBLAS_COMPUTE_64F; scale = CUDA_R_64F; break;
    default: FLAME_FAIL("matmul", "cuBLASLt path got dtype ", dtype_name(dt));
  }
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  PlanKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in hashing and comparison
  key.device = be.device();
  key.dtype = static_cast<int>(dt);
  key.compute = static_cast<int>(compute);
  key.ta = ob->trans;  // cuBLAS A = b^T, B = a^T
  key.tb = oa->trans;
  key.m = static_cast<uint64_t>(N);
  key.n = static_cast<uint64_t>(Mg);
  key.k = static_cast<uint64_t>(K);
  key.lda = ob->ld;
  key.ldb = oa->ld;
  key.ldc = N;
  key.batch = static_cast<int32_t>(batch);
  key.stride_a = batch > 1 ? b_bs : 0;
  key.stride_b = batch > 1 ? a_bs : 0;
  key.stride_c = batch > 1 ? M * N : 0;
  key.align_a = alignment_of(b.data_ptr(), key.stride_a * es);
  key.align_b = alignment_of(a.data_ptr(), key.stride_b * es);
  key.align_c = alignment_of(dst.data_ptr(), key.stride_c * es);
  if (c.defined()) key.align_c = std::min(key.align_c, alignment_of(c.data_ptr(), key.stride_c * es));
  const Plan& plan = get_plan(key, type, compute, scale);

  // Note [Matmul workspace]
  const cudaStream_t stream = be.stream();
  std::shared_ptr<void> captured_workspace;
  void* workspace = nullptr;
  if (plan.workspace > 0) {
    if (thread_is_capturing(be.device())) {
      captured_workspace = be.allocate(plan.workspace);
      workspace = captured_workspace.get();
    } else {
      workspace = stream_workspace(be.device(), stream);
    }
  }
  const float one_f = 1.0f, zero_f = 0.0f;
  const double one_d = 1.0, zero_d = 0.0;
  const void* alpha = dt == DType::f64 ? static_cast<const void*>(&one_d) : static_cast<const void*>(&one_f);
  const void* beta = dt == DType::f64 ? static_cast<const void*>(c.defined() ? &one_d : &zero_d)
                                      : static_cast<const void*>(c.defined() ? &one_f : &zero_f);
  FLAME_CUBLAS_CHECK(cublasLtMatmul(lt_handle(be.device()), plan.op, alpha, b.data_ptr(), plan.la, a.data_ptr(), plan.lb,
                                    beta, c.defined() ? c.data_ptr() : dst.data_ptr(), plan.lc, dst.data_ptr(), plan.lc,
                                    &plan.algo, workspace, plan.workspace, stream));
  if (launch_blocking())
    lt_sync_if_blocking(stream, "matmul",
                        "cuBLASLt GEMM m=" + std::to_string(key.m) + " n=" + std::to_string(key.n) +
                            " k=" + std::to_string(key.k) + " batch=" + std::to_string(key.batch));
}

template <class T>
void int_matmul(CudaBackend& be, const Tensor& dst, const Tensor& a, const Tensor& b) {
  const int64_t B = dst.sizes()[0], M = dst.sizes()[1], N = dst.sizes()[2], K = a.sizes()[2];
  const MatStrides sa{a.strides()[0], a.strides()[1], a.strides()[2]};
  const MatStrides sb{b.strides()[0], b.strides()[1], b.strides()[2]};
  const dim3 grid(static_cast<unsigned>((N + kTile - 1) / kTile), static_cast<unsigned>((M + kTile - 1) / kTile),
                  static_cast<unsigned>(std::min<int64_t>(B, 65535)));
  FLAME_CHECK((N + kTile - 1) / kTile <= INT32_MAX && (M + kTile - 1) / kTile <= 65535, "matmul",
              "integer matmul supports M up to ", 65535 * kTile, " (got M=", M, ")");
  matmul_int_kernel<T><<<grid, 256, 0, be.stream()>>>(static_cast<const T*>(a.data_ptr()), sa,
                                                      static_cast<const T*>(b.data_ptr()), sb,
                                                      static_cast<T*>(dst.data_ptr()), B, M, N, K);
  FLAME_CUDA_CHECK_LAUNCH();
}

// The fused kernel matmul_add (src/backend/fused/matmul_add.h): the cuBLASLt GEMM with beta = 1.
bool matmul_add_cuda(const Tensor& dst, const Tensor& a, const Tensor& b, const Tensor& c) {
  const DType dt = dst.dtype();
  if (dt != DType::bf16 && dt != DType::f16 && dt != DType::f32 && dt != DType::f64) return false;
  if (dst.dim() != 2 || a.dim() != 2 || b.dim() != 2 || c.sizes() != dst.sizes() || !dst.is_contiguous() ||
      !c.is_contiguous() || a.dtype() != dt || b.dtype() != dt || c.dtype() != dt || a.size(0) != dst.size(0) ||
      b.size(1) != dst.size(1) || a.size(1) != b.size(0))
    return false;
  CudaBackend& be = cuda_backend(dst.device().index);
  const int64_t M = dst.size(0), N = dst.size(1), K = a.size(1);
  if (M == 0 || N == 0) return true;
  DeviceGuard guard(be.device());
  if (K == 0) {  // the empty product: dst = c
    if (c.data_ptr() != dst.data_ptr()) be.copy(dst, c);
    return true;
  }
  lt_matmul(be, dst.unsqueeze(0), a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0));
  return true;
}

}  // namespace

void register_matmul_add_kernel() { fused::matmul_add.define(DeviceType::cuda, &matmul_add_cuda); }

// The handle and the per-stream workspace above, shared with the epilogue GEMMs
// (epi/linear_epilogue.cu) so that they need no second handle or workspace.
static_assert(kMaxWorkspace == kLtWorkspaceBytes, "epi/lt_shared.h states the workspace size");
cublasLtHandle_t shared_lt_handle(int device) { return lt_handle(device); }
void lt_sync_if_blocking(cudaStream_t stream, const char* op, const std::string& what) {
  if (!launch_blocking()) return;  // Note [Launch blocking]: name the GEMM if it faults
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FLAME_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return;
  const cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    FLAME_FAIL(op, what, " failed on the GPU: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  }
}
void* shared_lt_workspace(int device, cudaStream_t stream, std::size_t* nbytes) {
  *nbytes = kMaxWorkspace;
  return stream_workspace(device, stream);
}

void prepare_capture(int device) {
  DeviceGuard guard(device);
  (void)lt_handle(device);  // cublasLtCreate allocates: never inside a capture
}

// Contract (Note [Backend seam]): dst [B, M, N] contiguous; a [B, M, K] and b [B, K, N] of dst's
// dtype, any strides (a batch stride of 0 broadcasts).
void CudaBackend::matmul(const Tensor& dst, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(dst.dim() == 3 && a.dim() == 3 && b.dim() == 3 && dst.is_contiguous(), "matmul",
              "the CUDA kernel expects 3-d operands and a contiguous result, got ", a.sizes(), " @ ", b.sizes(), " -> ",
              dst.sizes());
  FLAME_CHECK(a.dtype() == dst.dtype() && b.dtype() == dst.dtype(), "matmul", "dtypes ", dtype_name(a.dtype()), ", ",
              dtype_name(b.dtype()), " and result ", dtype_name(dst.dtype()), " differ");
  const int64_t B = dst.sizes()[0], M = dst.sizes()[1], N = dst.sizes()[2], K = a.sizes()[2];
  FLAME_CHECK(a.sizes()[0] == B && b.sizes()[0] == B && a.sizes()[1] == M && b.sizes()[1] == K && b.sizes()[2] == N,
              "matmul", "shapes ", a.sizes(), " @ ", b.sizes(), " do not give ", dst.sizes());
  if (B == 0 || M == 0 || N == 0) return;
  DeviceGuard guard(device());
  if (K == 0) {  // empty sum: zeros (all-zero bits is 0 in every dtype)
    FLAME_CUDA_CHECK(cudaMemsetAsync(dst.data_ptr(), 0, dst.nbytes(), stream()));
    return;
  }
  switch (dst.dtype()) {
    case DType::f32:
    case DType::f64:
    case DType::bf16:
    case DType::f16: return lt_matmul(*this, dst, a, b);
    case DType::i32: return int_matmul<int32_t>(*this, dst, a, b);
    case DType::i64: return int_matmul<int64_t>(*this, dst, a, b);
    case DType::u8: return int_matmul<uint8_t>(*this, dst, a, b);
    case DType::boolean: return int_matmul<bool>(*this, dst, a, b);
    default: break;
  }
  FLAME_FAIL("matmul", "unsupported dtype ", dtype_name(dst.dtype()), FLAME_FLOAT8_HINT(dst.dtype()));
}

}  // namespace flame::backend::cuda
