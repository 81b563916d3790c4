#pragma once
// FLAME's own fused attention for short sequences (Note [Short-sequence attention] in
// sdpa_short.cu): the CUDA backend's sdpa_forward / sdpa_backward run it instead of cuDNN when the
// switch is on (flame::cuda::set_short_attention) and `supports` accepts the call.
#include "flame/tensor.h"

namespace flame::backend::cuda::sdpa_short {

// Whether the kernels take this call: bf16/f16, head dim 64 (q, k, v and out), at most 256
// queries and 256 keys, no bias, not causal, and every pointer 16-byte aligned with batch, head
// and row strides that are multiples of 8 elements (last-dim stride 1). `more` lists further
// operands (out, dout, dq, dk, dv) that must meet the same layout rules.
bool supports(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, bool causal,
              std::initializer_list<const Tensor*> more);

// The backend's contract (Backend::sdpa_forward / sdpa_backward in src/backend/backend.h) on
// `stream`; the caller checked `supports`. With `column_sums`, backward also sets it to the f32
// [3 * H * 64] column sums over all batches and rows of dq, dk and dv, in that order.
void forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
             void* stream);
void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& out, const Tensor& dout, const Tensor& stats, double scale, void* stream,
              Tensor* column_sums);

}  // namespace flame::backend::cuda::sdpa_short
