#pragma once
// What the epilogue GEMMs borrow from matmul.cu: its cuBLASLt handle (created on first use, never
// destroyed) and its per-(device, stream) workspace (Note [Matmul workspace]; outside capture only);
// and the descriptor setup both build their plans with (the layouts of a row-major GEMM's
// column-major view, Note [Row-major GEMM through cuBLASLt], the transposes, the preference).
// The setup helpers return cuBLASLt's status so that each caller reports in its own op's name;
// on failure they leave nothing created.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace flame::backend::cuda {
// The workspace's size (matmul.cu's kMaxWorkspace): the most an epilogue plan may ask for.
constexpr std::size_t kLtWorkspaceBytes = 32u << 20;
cublasLtHandle_t shared_lt_handle(int device);
void* shared_lt_workspace(int device, cudaStream_t stream, std::size_t* nbytes);
// Under FLAME_CUDA_LAUNCH_BLOCKING (Note [Launch blocking]) and outside a capture: waits for the
// GEMM just queued on `stream` and raises in `op`'s name, with `what` (its shape), if it faulted.
void lt_sync_if_blocking(cudaStream_t stream, const char* op, const std::string& what);

// The plan caches' hash: FNV-1a over a key's bytes (keys are zero-initialised, padding included,
// and compared with memcmp).
template <class Key>
struct LtKeyHash {
  std::size_t operator()(const Key& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;
    for (std::size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

// A column-major GEMM D [m, n] = op(A) op(B): A stored [ta ? k : m, ta ? m : k] with leading
// dimension lda, B stored [tb ? n : k, tb ? k : n] (ldb), C = D [m, n] (ldc); batch > 1 adds
// strided batches (stride_* elements apart).
struct LtGemmShape {
  bool ta = false, tb = false;
  uint64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int32_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

inline void lt_destroy_layouts(cublasLtMatrixLayout_t& la, cublasLtMatrixLayout_t& lb, cublasLtMatrixLayout_t& lc) {
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  la = lb = lc = nullptr;
}

// Runs create() and, when it worked, configure() (both return a status); on failure *obj is
// destroyed if it was made and left null, so that nothing stays created.
template <class Obj, class Create, class Configure>
cublasStatus_t lt_create(Obj* obj, cublasStatus_t (*destroy)(Obj), Create&& create, Configure&& configure) {
  cublasStatus_t st = create();
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = configure();
    if (st != CUBLAS_STATUS_SUCCESS) destroy(*obj);
  }
  if (st != CUBLAS_STATUS_SUCCESS) *obj = nullptr;
  return st;
}

inline cublasStatus_t lt_make_layout(cublasLtMatrixLayout_t* l, cudaDataType_t type, uint64_t rows, uint64_t cols,
                                     int64_t ld, int32_t batch, int64_t stride) {
  return lt_create(
      l, cublasLtMatrixLayoutDestroy, [&] { return cublasLtMatrixLayoutCreate(l, type, rows, cols, ld); },
      [&] {
        if (batch <= 1) return CUBLAS_STATUS_SUCCESS;
        const cublasStatus_t st =
            cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch));
        if (st != CUBLAS_STATUS_SUCCESS) return st;
        return cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                sizeof(stride));
      });
}

// The layouts of A, B and C = D for s (the caller destroys them, lt_destroy_layouts); C and D
// take ctype where given (a half GEMM writing f32), else type.
inline cublasStatus_t lt_gemm_layouts(cudaDataType_t type, const LtGemmShape& s, cublasLtMatrixLayout_t& la,
                                      cublasLtMatrixLayout_t& lb, cublasLtMatrixLayout_t& lc,
                                      std::optional<cudaDataType_t> ctype = std::nullopt) {
  la = lb = lc = nullptr;
  cublasStatus_t st = lt_make_layout(&la, type, s.ta ? s.k : s.m, s.ta ? s.m : s.k, s.lda, s.batch, s.stride_a);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt_make_layout(&lb, type, s.tb ? s.n : s.k, s.tb ? s.k : s.n, s.ldb, s.batch, s.stride_b);
  if (st == CUBLAS_STATUS_SUCCESS) st = lt_make_layout(&lc, ctype.value_or(type), s.m, s.n, s.ldc, s.batch, s.stride_c);
  if (st != CUBLAS_STATUS_SUCCESS) lt_destroy_layouts(la, lb, lc);
  return st;
}

// An operation descriptor with the compute and scale types and the transposes of A and B (the
// caller adds any epilogue and destroys it).
inline cublasStatus_t lt_gemm_desc(cublasLtMatmulDesc_t* op, cublasComputeType_t compute, cudaDataType_t scale,
                                   bool ta, bool tb) {
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  return lt_create(
      op, cublasLtMatmulDescDestroy, [&] { return cublasLtMatmulDescCreate(op, compute, scale); },
      [&] {
        const cublasStatus_t st = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa));
        if (st != CUBLAS_STATUS_SUCCESS) return st;
        return cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb));
      });
}

// Sets a heuristic preference's workspace cap and the alignments (bytes) of A, B and C; D is
// C's (both are the output).
inline cublasStatus_t lt_set_preference(cublasLtMatmulPreference_t pref, uint64_t max_workspace, uint32_t align_a,
                                        uint32_t align_b, uint32_t align_c) {
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                           sizeof(max_workspace));
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    uint32_t bytes;
  } aligns[] = {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
                {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
                {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
                {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}};
  for (const auto& a : aligns)
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, a.attr, &a.bytes, sizeof(a.bytes));
  return st;
}
}  // namespace flame::backend::cuda
