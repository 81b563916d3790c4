#pragma once
// Gradient rule of the fused scaled dot-product attention (src/ops/attention.cpp).
#include <cstdint>

#include "flame/tensor.h"

namespace flame::rules {

// `t` itself when the fused kernels can read it in place (last-dim stride 1, other strides
// positive multiples of 8 elements, 16-byte aligned start: cuDNN's layout rules), else a
// contiguous copy (autograd-aware, as Tensor::contiguous).
Tensor fused_operand(const Tensor& t);

// Records the node of out = fused_sdpa(q, k, v, bias) on `out` ([B, H, L, Dv]) when q, k or v needs a
// gradient. Saves q, k, v, out, stats (the f32 logsumexp rows) and bias (when defined): O(L + S)
// memory besides the bias. The rule calls Backend::sdpa_backward, over kv chunks of `kv_chunk`
// keys when sdpa_kv_chunk() asks for it at backward time (Note [cuDNN capture of long kv]).
void sdpa_fused(Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                double scale, bool causal);

// The gradients of the fused forward, over kv chunks of `kv_chunk` keys (0: one call). Chunks
// share the global out and stats, so each chunk's probabilities are the global ones restricted to
// its keys and the chunks' dq add up to the whole (Note [cuDNN capture of long kv]).
TensorList sdpa_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& stats, const Tensor& bias, double scale, bool causal, int64_t kv_chunk);

}  // namespace flame::rules

namespace flame::nn::functional::detail {
// Keys per chunk the fused path must use for these sizes now (0: no chunking): the test override
// when set, else 1024 when the device is capturing a CUDA graph, the mask is not causal and S > 1024.
int64_t sdpa_kv_chunk(const Tensor& q, int64_t s_kv, bool causal);
// Why the fused path cannot take these operands (q, k, v of >= 2 dims, validated), or nullptr
// when it can: the predicate of `automatic` (Note [SDPA paths]), shared with attention_qkv_packed.
const char* sdpa_fused_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                   double dropout_p);
// Sets what sdpa_last_path() reports (a static string), for ops built on the fused kernels.
void set_sdpa_last_path(const char* path);
}  // namespace flame::nn::functional::detail
