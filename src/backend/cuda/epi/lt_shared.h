#pragma once
// What the epilogue GEMMs borrow from matmul.cu: its cuBLASLt handle (created on first use, never
// destroyed) and its per-(device, stream) workspace (Note [Matmul workspace]; outside capture only).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace flame::backend::cuda {
// The workspace's size (matmul.cu's kMaxWorkspace): the most an epilogue plan may ask for.
constexpr std::size_t kLtWorkspaceBytes = 32u << 20;
cublasLtHandle_t shared_lt_handle(int device);
void* shared_lt_workspace(int device, cudaStream_t stream, std::size_t* nbytes);
}  // namespace flame::backend::cuda
