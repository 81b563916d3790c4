#pragma once
// Op definition of the fused attention core (Note [Invoke] in src/ops/invoke.h; Note [SDPA paths]
// in src/ops/attention.cpp): one fused forward over 4-d q, k, v (and an additive bias), or the same
// over kv chunks merged by their logsumexp (Note [cuDNN capture of long kv]), with one node for the
// whole product. scaled_dot_product_attention composes it after its own autocast and trace steps;
// run is in src/ops/attention.cpp, record, the gradient rule, in src/autograd/rules/attention.cpp.
// Also the op layer's attention helpers that the rules share.
#include <cstdint>

#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

// `t` itself when the fused kernels can read it in place (last-dim stride 1, other strides
// positive multiples of 8 elements, 16-byte aligned start: cuDNN's layout rules), else a
// contiguous copy (autograd-aware, as Tensor::contiguous).
Tensor fused_operand(const Tensor& t);

struct SdpaCoreArgs {
  Tensor q, k, v, bias;  // [B, H, L or S, D]; bias: undefined or [B or 1, H or 1, L, S]
  double scale = 1.0;
  bool causal = false;
  int64_t kv_chunk = 0;  // > 0: over kv chunks of this many keys (not causal)
};
struct SdpaCoreDef : OpDefaults<SdpaCoreArgs> {
  struct Prep {};
  struct Result {
    Tensor out, stats;  // stats: the f32 (f64) logsumexp rows [B, H, L, 1] the backward reads
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "scaled_dot_product_attention"; }
  static TensorList inputs(const Args& a) { return {a.q, a.k, a.v, a.bias}; }
  static const Tensor& lead(const Args& a) { return a.q; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.q = in[0];
    a.k = in[1];
    a.v = in[2];
    a.bias = in[3];
    return a;
  }
  static bool traceable(const Args&) { return false; }  // the public op is the trace step
  static Prep prepare(const Args&) { return {}; }       // the public op validated (and cast)
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

}  // namespace flame::op_detail

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
