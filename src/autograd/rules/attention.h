#pragma once
// Gradient rules of the fused scaled dot-product attention (src/ops/attention.cpp): the record
// member of SdpaCoreDef (src/ops/attention_def.h), and the backward the packed-QKV rule shares.
#include <cstdint>

#include "flame/tensor.h"
#include "src/ops/attention_def.h"  // the op definition whose record member is the rule

namespace flame::rules {

// The gradients of the fused forward, over kv chunks of `kv_chunk` keys (0: one call). Chunks
// share the global out and stats, so each chunk's probabilities are the global ones restricted to
// its keys and the chunks' dq add up to the whole (Note [cuDNN capture of long kv]).
TensorList sdpa_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& stats, const Tensor& bias, double scale, bool causal, int64_t kv_chunk);

}  // namespace flame::rules
