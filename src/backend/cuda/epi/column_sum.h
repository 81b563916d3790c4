#pragma once
// FLAME's bias-gradient kernel for the epilogue GEMMs (Note [Epilogue column sum] in
// column_sum.cu): out[c] = sum over r of g[r, c], the alternative to cuBLASLt's BGRADB epilogue.
#include <cstdint>

#include "flame/dtype.h"

namespace flame::backend::cuda {

class CudaBackend;

// g [rows, cols] contiguous on be's device, bf16/f16/f32, 16-byte aligned with cols a multiple
// of 16 / element size; out [cols] of dtype out_dt: g's dtype, or f32 (the sums are float
// either way). Queued on be.stream(); no host wait, legal under graph capture (the partial sums
// come from be.allocate).
void epi_column_sum(CudaBackend& be, DType dt, const void* g, int64_t rows, int64_t cols, void* out, DType out_dt);

// Whether epi_column_sum takes this dtype/layout (the 16-byte rule above).
bool epi_column_sum_fits(DType dt, const void* g, int64_t cols, const void* out, DType out_dt);

}  // namespace flame::backend::cuda
