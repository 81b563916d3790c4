#pragma once
// The plans of the epilogue GEMMs (Note [Epilogue plans], Note [Epilogue autotuning] in
// epi_plan.cpp): host code, shared by the launchers in linear_epilogue.cu.
#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "flame/dtype.h"
#include "src/backend/cuda/epi/lt_shared.h"

namespace flame::backend::cuda {

class CudaBackend;

struct EpiKey {
  int device;
  int dtype;
  int compute;
  int epilogue;
  int plan;       // kPlanHeuristic or kPlanTuned: a shape may have both
  int bias_grad;  // the cuda::EpilogueBiasGrad asked for (bias-gradient epilogues; else 0)
  int out_dtype;  // C/D's and the bias gradient's dtype: dtype, or f32 for a half wgrad GEMM
                  // writing f32 (Note [Master-weight epilogues] in src/ops/linear_epilogue.cpp)
  bool ta, tb;
  uint64_t m, n, k;
  int64_t lda, ldb, ldc, ld_aux;
  bool operator==(const EpiKey& o) const { return std::memcmp(this, &o, sizeof(EpiKey)) == 0; }
};
using EpiKeyHash = LtKeyHash<EpiKey>;

// The operands of one call.
struct EpiCall {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;  // bias (forward) or bias gradient (backward, written); may be null
  const void* aux = nullptr;   // pre-activation: written by GELU_AUX*, read by DGELU*
  // Bias-gradient epilogues: the matrix whose column sums the bias gradient is, for column-sum
  // plans (dy for wgrad; dpre, the GEMM's own output, for dgelu).
  const void* sum_src = nullptr;
  int64_t sum_rows = 0, sum_cols = 0;
};

struct Types {
  cudaDataType_t type;
  cublasComputeType_t compute;
};
// The cuBLASLt element and compute types of a dtype (f32: TF32 when flame::cuda::allow_tf32()).
Types types_of(DType dt);

// Runs the call with its plan (made on a miss, tuned when autotuning is on and nothing is being
// captured); false (and nothing written) when cuBLASLt cannot.
bool run_epi(CudaBackend& be, const EpiKey& key, cudaDataType_t type, const EpiCall& c);

}  // namespace flame::backend::cuda
