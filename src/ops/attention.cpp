// scaled_dot_product_attention: validation, the choice between the math path and the fused path,
// and the routes around known cuDNN failures. docs/nn-attention.md is the user-facing summary.
//
// Note [SDPA paths]
// The math path is a composite of FLAME ops (matmul, masked_fill, softmax, bernoulli dropout,
// matmul), so it runs on every device and dtype and its gradient is free; it holds the L x S
// probabilities. The fused path calls Backend::sdpa_forward/backward (cuDNN's flash-class SDPA on
// CUDA, a reference loop on the CPU) and saves only the output and the logsumexp rows. `automatic`
// takes the fused path on CUDA for bf16/f16 with head dim E == Ev, E % 8 == 0, E <= 128, q/k/v of
// equal leading dims, dropout_p == 0 (cuDNN's dropout would not draw FLAME's Philox mask, so
// dropout runs on the math path, which is reproducible per seed on CPU and CUDA) and a mask that
// needs no gradient; everything else takes the math path.
//
// Note [Fused SDPA contract]
// The fused kernels see q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev] (leading dims merged or
// padded to two), last-dim stride 1, and an optional additive bias [B or 1, H or 1, L, S] in q's
// dtype: a bool mask becomes 0 / lowest-finite (never -inf, whose fully hidden rows would give
// NaN in the kernel). The output is allocated in q's layout (make_output): for q split from a
// fused [B, L, 3, H, E] projection that is [B, L, H, Ev] memory, so out.transpose(1, 2).reshape(B,
// L, H*Ev) costs no copy and the gradient coming back needs no layout change either.
//
// Note [SDPA fully hidden rows]
// A query row whose every key the mask hides gets output 0 and passes no gradient, on every path
// and device: PyTorch's answer since 2.5 (_safe_softmax, pytorch/pytorch#131060 and #133882: "fully
// masked rows return 0 instead of NaN"), for a bool mask and for a float mask whose row is all
// -inf. The math path zeroes such rows' probabilities. The fused kernels see an additive bias of
// lowest-finite values (never -inf), so there such a row would average V; fused_path zeroes the
// rows after the kernel (a where over the output in its own memory order), which also zeroes
// their incoming gradient, and with it their share of dq, dk and dv.
//
// Note [cuDNN masked backward at seq % 128 == 64]
// cuDNN's sm90 SDPA backward has given NaN dQ with an explicit bias when a sequence length is
// 64 mod 128. With a bias and a gradient wanted, such a length is padded up to the next multiple
// of 128 (padded keys get a lowest-finite bias, padded query rows are sliced away); the pad and
// slice are ordinary ops, so autograd needs nothing special. sdpa_last_path() reports
// "fused_padded".
//
// Note [cuDNN capture of long kv]
// cuDNN 9.13-9.14 crashes when a non-causal SDPA with s_kv > 1024 is captured into a CUDA graph.
// While capturing, such a call runs over kv chunks of 1024 keys: each chunk's forward gives its
// output o_c and logsumexp m_c, merged as m = logsumexp_c(m_c), o = sum_c exp(m_c - m) o_c (in
// f32). Backward passes every chunk the global out and m (rules/attention.cpp), so it is exact.
// sdpa_last_path() reports "fused_chunked".
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>

#include "flame/grad_mode.h"
#include "flame/cuda.h"
#include "flame/nn/attention.h"
#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/ops/invoke.h"
#include "src/core/grad_state.h"
#include "src/ops/attention_def.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"

namespace flame::nn::functional {

namespace {
constexpr const char* kOp = "scaled_dot_product_attention";
thread_local SdpaBackend t_backend = SdpaBackend::automatic;
thread_local const char* t_last_path = "none";
thread_local detail::SdpaRouteOverride t_routes;

std::string describe(const Tensor& t) {
  std::ostringstream os;
  flame::detail::append(os, t.sizes(), " ", dtype_name(t.dtype()), " on ", t.device());
  return os.str();
}

// Sizes of a validated call.
struct Dims {
  Shape lead;  // broadcast leading dims of q, k, v
  int64_t l = 0, s = 0, e = 0, ev = 0;
};

Dims validate(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, double dropout_p, bool causal,
              std::optional<double> scale) {
  FLAME_CHECK(q.defined() && k.defined() && v.defined(), kOp, "query, key and value must be defined tensors");
  FLAME_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, kOp,
              "query, key and value need at least 2 dims ([..., L, E]), got query ", describe(q), ", key ",
              describe(k), ", value ", describe(v));
  FLAME_CHECK(q.device() == k.device() && q.device() == v.device(), kOp, "query, key and value must be on one device, got query ",
              describe(q), ", key ", describe(k), ", value ", describe(v));
  FLAME_CHECK(is_floating(q.dtype()) && q.dtype() == k.dtype() && q.dtype() == v.dtype(), kOp,
              "query, key and value must have one floating dtype, got query ", describe(q), ", key ", describe(k),
              ", value ", describe(v));
  Dims d;
  d.l = q.size(-2);
  d.e = q.size(-1);
  d.s = k.size(-2);
  d.ev = v.size(-1);
  FLAME_CHECK(k.size(-1) == d.e, kOp, "query and key must have the same last dim (E), got query ", describe(q),
              ", key ", describe(k));
  FLAME_CHECK(v.size(-2) == d.s, kOp, "key and value must have the same sequence length (dim -2), got key ",
              describe(k), ", value ", describe(v));
  auto lead = [](const Tensor& t) { return Shape(t.sizes().begin(), t.sizes().end() - 2); };
  d.lead = broadcast_shapes(broadcast_shapes(lead(q), lead(k), kOp), lead(v), kOp);
  FLAME_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, kOp, "dropout_p must be in [0, 1], got ", dropout_p);
  FLAME_CHECK(!scale || std::isfinite(*scale), kOp, "scale must be finite, got ", scale.value_or(0.0));
  if (mask.defined()) {
    FLAME_CHECK(!causal, kOp, "an explicit attn_mask cannot be combined with is_causal=true (got mask ",
                describe(mask), ")");
    FLAME_CHECK(mask.device() == q.device(), kOp, "attn_mask must be on the query's device, got mask ",
                describe(mask), ", query ", describe(q));
    FLAME_CHECK(is_bool(mask.dtype()) || mask.dtype() == q.dtype(), kOp,
                "attn_mask must be bool or the query's dtype, got mask ", describe(mask), ", query ", describe(q));
    Shape full = d.lead;
    full.push_back(d.l);
    full.push_back(d.s);
    bool fits = mask.dim() <= static_cast<int64_t>(full.size());
    for (int64_t i = 1; fits && i <= mask.dim(); ++i) {
      const int64_t m = mask.size(-i), f = full[full.size() - static_cast<std::size_t>(i)];
      fits = m == 1 || m == f;
    }
    FLAME_CHECK(fits, kOp, "attn_mask of shape ", mask.sizes(), " does not broadcast to the scores' shape ", full);
  }
  return d;
}

double default_scale(const Dims& d, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d.e));
}

Scalar lowest_finite(DType dt) {
  switch (dt) {
    case DType::f16: return Scalar(-65504.0);
    case DType::bf16: return Scalar(-3.3895313892515355e38);
    case DType::f32: return Scalar(static_cast<double>(std::numeric_limits<float>::lowest()));
    default: return Scalar(std::numeric_limits<double>::lowest());
  }
}

// ---------------------------------------------------------------------------------------------
// Math path (Note [SDPA paths]).
// ---------------------------------------------------------------------------------------------
// row0: the first query row of q (a chunk of a longer query, Note [Math path in query chunks]).
Tensor math_path(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, double dropout_p, bool causal,
                 double scale, Generator* gen, int64_t row0 = 0) {
  const int64_t l = q.size(-2), s = k.size(-2);
  const Device dev = q.device();
  Tensor scores = mul_scalar(matmul(q, k.transpose(-2, -1)), scale);
  if (causal) {
    const Tensor i = Tensor::arange(row0, row0 + l, 1, {DType::i64, dev}).unsqueeze(-1);
    const Tensor j = Tensor::arange(s, {DType::i64, dev});
    scores = masked_fill(scores, lt(i, j), -std::numeric_limits<double>::infinity());
  }
  Tensor dead;  // query rows whose every key is hidden: 0 out, no NaN (PyTorch's _safe_softmax)
  if (mask.defined()) {
    if (is_bool(mask.dtype())) {
      // masked_fill needs the mask at most the scores' shape; broadcast scores first if needed.
      const Shape full = broadcast_shapes(scores.sizes(), mask.sizes(), kOp);
      if (full != scores.sizes()) scores = scores.expand(full);
      scores = masked_fill(scores, logical_not(mask), -std::numeric_limits<double>::infinity());
    } else {
      scores = add(scores, mask);
    }
    const Tensor row_max = amax(scores.detach(), Shape{-1}, /*keepdim=*/true);
    dead = logical_and(isinf(row_max), lt(row_max, Tensor::scalar(0.0, {row_max.dtype(), dev})));
    scores = masked_fill(scores, dead, 0.0);
  }
  Tensor p = softmax(scores, -1);
  if (dead.defined()) p = masked_fill(p, dead, 0.0);
  if (dropout_p > 0.0) {
    if (dropout_p >= 1.0) {
      p = mul_scalar(p, 0.0);
    } else {
      const Tensor keep = Tensor::bernoulli(p.sizes(), 1.0 - dropout_p, {p.dtype(), dev}, gen);
      p = mul_scalar(mul(p, keep), 1.0 / (1.0 - dropout_p));
    }
  }
  return matmul(p, v);
}

// Note [Math path in query chunks]
// The math path holds the [..., L, S] scores and probabilities: for a VAE's mid-block attention at
// 1024² (16,384 tokens, head dim 512, which the fused kernels do not take) that is 0.5 GiB each in
// bf16. When nothing is recorded for a backward (no gradient wanted, or grad mode off) and dropout
// is off, the math path runs over chunks of query rows so that one chunk's scores hold at most
// kMathChunkElements values; each row's softmax sees all its keys, so the result is the
// unchunked one (up to the GEMMs' summation order). With a gradient the chunks would save all
// their probabilities anyway, so the path stays whole. sdpa_last_path() reports "math_chunked".
constexpr int64_t kMathChunkElements = int64_t{1} << 26;

Tensor math_path_in_chunks(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                           double scale, int64_t rows) {
  const int64_t l = q.size(-2);
  TensorList outs;
  for (int64_t r0 = 0; r0 < l; r0 += rows) {
    const int64_t n = std::min(rows, l - r0);
    // A mask with a query dim of L is cut with q; one of size 1 (or none) broadcasts to every chunk.
    const bool cut_mask = mask.defined() && mask.dim() >= 2 && mask.size(-2) == l && l > 1;
    const Tensor mc = cut_mask ? mask.narrow(mask.dim() - 2, r0, n) : mask;
    outs.push_back(math_path(q.narrow(q.dim() - 2, r0, n), k, v, mc, 0.0, causal, scale, nullptr, r0));
  }
  return cat(outs, q.dim() - 2);
}

// The query rows per chunk of the math path, or 0 to run it whole (Note [Math path in query chunks]).
int64_t math_chunk_rows(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, double dropout_p) {
  if (dropout_p > 0.0) return 0;
  const bool records = grad_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                          (mask.defined() && mask.requires_grad()));
  if (records) return 0;
  int64_t lead = 1;
  for (int64_t i = 0; i + 2 < q.dim(); ++i) lead *= std::max(q.size(i), k.size(i));
  const int64_t l = q.size(-2), s = k.size(-2);
  if (lead * l * s <= kMathChunkElements || l < 2) return 0;
  return std::max<int64_t>(1, kMathChunkElements / std::max<int64_t>(1, lead * s));
}

// ---------------------------------------------------------------------------------------------
// Fused path (Note [Fused SDPA contract]).
// ---------------------------------------------------------------------------------------------

// Why the fused path cannot take this call, or nullptr when it can.
const char* fused_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, double dropout_p,
                              const Dims& d) {
  if (dropout_p > 0.0) return "dropout_p > 0 runs on the math path (FLAME's Philox mask)";
  if (d.l == 0 || d.s == 0 || q.numel() == 0 || v.numel() == 0) return "empty inputs";
  const Shape lead(q.sizes().begin(), q.sizes().end() - 2);
  if (Shape(k.sizes().begin(), k.sizes().end() - 2) != lead || Shape(v.sizes().begin(), v.sizes().end() - 2) != lead)
    return "query, key and value must have equal leading dims (no broadcasting)";
  if (mask.defined() && mask.requires_grad() && grad_enabled()) return "a mask that needs a gradient";
  if (q.device().is_cuda()) {
    if (q.dtype() != DType::bf16 && q.dtype() != DType::f16) return "the CUDA fused path takes bf16 and f16 only";
    if (d.e != d.ev) return "the CUDA fused path needs E == Ev";
    if (d.e % 8 != 0 || d.e > 128) return "the CUDA fused path needs a head dim that is a multiple of 8, at most 128";
    if (d.l == 1 && d.s == 1) return "cuDNN rejects s_q = s_kv = 1";
  }
  return nullptr;
}

// [..., N, X] with leading dims `lead` as [B, H, N, X] (merging leading dims; may copy).
Tensor as4d(const Tensor& t) {
  if (t.dim() == 4) return t;
  if (t.dim() < 4) {
    Tensor r = t;
    while (r.dim() < 4) r = r.unsqueeze(0);
    return r;
  }
  return t.reshape({-1, t.size(-3), t.size(-2), t.size(-1)});
}

// The additive bias of the fused kernels for `mask` (bool or q's dtype): [B or 1, H or 1, L, S].
Tensor make_bias(const Tensor& mask, const Dims& d, DType dtype) {
  Tensor m = mask;
  const int64_t nd = static_cast<int64_t>(d.lead.size()) + 2;
  while (m.dim() < nd) m = m.unsqueeze(0);
  Shape shape = m.sizes();
  shape[nd - 2] = d.l;
  shape[nd - 1] = d.s;
  if (nd > 4) {
    // Merged leading dims: keep them broadcast only when all of the merged ones are.
    bool all_one = true;
    for (int64_t i = 0; i < nd - 3; ++i) all_one = all_one && shape[i] == 1;
    if (!all_one)
      for (int64_t i = 0; i < nd - 3; ++i) shape[i] = d.lead[i];
  }
  m = m.expand(shape);
  // Rows of the bias start 16-byte aligned (cuDNN's requirement for its strides): the buffer's
  // last dim is S rounded up to 8 elements, and the bias is its [..., :S] view.
  Shape padded = shape;
  padded[nd - 1] = (d.s + 7) / 8 * 8;
  Tensor buf = make_empty(padded, dtype, m.device(), kOp);
  Tensor bias = buf.narrow(nd - 1, 0, d.s);
  // -inf in a float mask becomes lowest-finite too (Note [SDPA fully hidden rows]).
  const Tensor values = is_bool(m.dtype())
                            ? masked_fill(Tensor::zeros(m.sizes(), {dtype, m.device()}), logical_not(m), lowest_finite(dtype))
                            : maximum(m.detach(), Tensor::full({}, lowest_finite(dtype), {dtype, m.device()}));
  backend::backend_for(m.device()).copy(bias, values);
  return as4d(bias);
}

// Output buffer in q's layout (as PyTorch's cuDNN path): [B, H, L, Ev] when q's heads are outer
// to its rows, else [B, L, H, Ev] memory returned as its [B, H, L, Ev] view. The upstream gradient
// then usually arrives in the output's layout (a contiguous one for contiguous q; the
// [B, L, H*Ev] merge of heads for a q split from a fused projection), and backward copies nothing.
Tensor make_output(const Tensor& q4, int64_t ev) {
  if (q4.size(1) == 1 || q4.size(2) == 1 || q4.stride(1) >= q4.stride(2))
    return make_empty({q4.size(0), q4.size(1), q4.size(2), ev}, q4.dtype(), q4.device(), kOp);
  const Tensor blhd = make_empty({q4.size(0), q4.size(2), q4.size(1), ev}, q4.dtype(), q4.device(), kOp);
  return blhd.transpose(1, 2);
}

// The logsumexp rows: f32, or f64 for f64 inputs (the CPU reference), as the kernels accumulate.
DType stats_dtype(const Tensor& q) { return q.dtype() == DType::f64 ? DType::f64 : DType::f32; }

Tensor last_dim_dense(const Tensor& t) { return op_detail::fused_operand(t); }

// One fused call on 4-d operands, with its autograd node (SdpaCoreDef, src/ops/attention_def.h).
Tensor fused_core(const Tensor& q4, const Tensor& k4, const Tensor& v4, const Tensor& bias4, double scale, bool causal) {
  return op_detail::invoke<op_detail::SdpaCoreDef>({q4, k4, v4, bias4, scale, causal, 0});
}

// Note [cuDNN capture of long kv]: forward over kv chunks, one node whose rule chunks backward too.
Tensor fused_chunked(const Tensor& q4, const Tensor& k4, const Tensor& v4, const Tensor& bias4, double scale,
                     int64_t chunk) {
  return op_detail::invoke<op_detail::SdpaCoreDef>({q4, k4, v4, bias4, scale, false, chunk});
}

// The kernels of fused_core: the output and its logsumexp rows.
op_detail::SdpaCoreDef::Result fused_core_kernel(const Tensor& q4, const Tensor& k4, const Tensor& v4,
                                                 const Tensor& bias4, double scale, bool causal) {
  auto& be = backend::backend_for(q4.device());
  op_detail::SdpaCoreDef::Result r;
  r.out = make_output(q4, v4.size(3));
  r.stats = make_empty({q4.size(0), q4.size(1), q4.size(2), 1}, stats_dtype(q4), q4.device(), kOp);
  be.sdpa_forward(r.out, r.stats, q4, k4, v4, bias4, scale, causal);
  return r;
}

// The kernels of fused_chunked: each chunk's output merged by the running logsumexp.
op_detail::SdpaCoreDef::Result fused_chunked_kernel(const Tensor& q4, const Tensor& k4, const Tensor& v4,
                                                    const Tensor& bias4, double scale, int64_t chunk) {
  auto& be = backend::backend_for(q4.device());
  const int64_t s = k4.size(2);
  const DType acc_dt = q4.dtype() == DType::f64 ? DType::f64 : DType::f32;  // the merge's precision
  Tensor m, acc;  // running logsumexp and output
  {
    NoGradGuard no_grad;
    for (int64_t s0 = 0; s0 < s; s0 += chunk) {
      const int64_t len = std::min(chunk, s - s0);
      Tensor o_c = make_output(q4, v4.size(3));
      const Tensor m_f = make_empty({q4.size(0), q4.size(1), q4.size(2), 1}, stats_dtype(q4), q4.device(), kOp);
      be.sdpa_forward(o_c, m_f, q4, k4.narrow(2, s0, len), v4.narrow(2, s0, len),
                      bias4.defined() ? bias4.narrow(3, s0, len) : Tensor(), scale, false);
      const Tensor m_c = m_f.to(acc_dt);
      const Tensor of = o_c.to(acc_dt);
      if (!m.defined()) {
        m = m_c;
        acc = of.clone();
        continue;
      }
      // Rescale both sides to the new logsumexp. A row hidden in every chunk so far has
      // m_new = -inf; its weights use 0 in place of m_new (exp(-inf) = 0, never -inf - -inf).
      const Tensor m_new = logsumexp(stack({m, m_c}, 0), Shape{0});
      const Tensor m_ref = masked_fill(m_new, isinf(m_new), 0.0);
      acc = add(mul(acc, exp(sub(m, m_ref))), mul(of, exp(sub(m_c, m_ref))));
      m = m_new;
    }
  }
  // A fully hidden row has m = -inf; its output is 0 as on the unchunked path.
  acc = masked_fill(acc, isinf(m), 0.0);
  op_detail::SdpaCoreDef::Result r;
  r.out = make_output(q4, v4.size(3));
  be.copy(r.out, acc);
  r.stats = m.to(stats_dtype(q4)).contiguous();
  return r;
}

// The query rows `mask` hides entirely, [..., L or 1, 1] (Note [SDPA fully hidden rows]).
Tensor hidden_rows(const Tensor& mask) {
  const Tensor m = mask.detach();
  if (is_bool(m.dtype())) return logical_not(any(m, Shape{-1}, /*keepdim=*/true));
  const Tensor row_max = amax(m, Shape{-1}, /*keepdim=*/true);
  return logical_and(isinf(row_max), lt(row_max, Tensor::scalar(0.0, {row_max.dtype(), m.device()})));
}

// out with the rows in `dead` set to 0, computed in out's memory order so that a [B, L, H, Ev]
// output (Note [Fused SDPA contract]) keeps its layout.
Tensor zero_rows(const Tensor& out, Tensor dead) {
  const Tensor zero = Tensor::scalar(0.0, {out.dtype(), out.device()});
  if (out.dim() != 4 || out.size(1) == 1 || out.size(2) == 1 || out.stride(1) >= out.stride(2))
    return where(dead, zero, out);
  while (dead.dim() < 4) dead = dead.unsqueeze(0);
  return where(dead.transpose(1, 2), zero, out.transpose(1, 2)).transpose(1, 2);
}

Tensor fused_path(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                  const Dims& d) {
  const Tensor q4 = last_dim_dense(as4d(q)), k4 = last_dim_dense(as4d(k)), v4 = last_dim_dense(as4d(v));
  Tensor bias4 = mask.defined() ? make_bias(mask, d, q.dtype()) : Tensor();
  const Tensor dead = mask.defined() ? hidden_rows(mask) : Tensor();
  const bool wants_grad = needs_grad({q, k, v});
  auto restore = [&](const Tensor& out4) {
    Shape shape = d.lead;
    shape.push_back(d.l);
    shape.push_back(d.ev);
    const Tensor out = q.dim() == 4 ? out4 : out4.reshape(shape);
    return dead.defined() ? zero_rows(out, dead) : out;
  };

  // Note [cuDNN masked backward at seq % 128 == 64]
  const bool trap_device = q.device().is_cuda() || t_routes.pad_to_128;
  if (bias4.defined() && wants_grad && trap_device && (d.l % 128 == 64 || d.s % 128 == 64 || t_routes.pad_to_128)) {
    const int64_t lp = d.l % 128 == 64 || t_routes.pad_to_128 ? (d.l + 127) / 128 * 128 : d.l;
    const int64_t sp = d.s % 128 == 64 || t_routes.pad_to_128 ? (d.s + 127) / 128 * 128 : d.s;
    const Tensor qp = pad(q4, {0, 0, 0, lp - d.l});
    const Tensor kp = pad(k4, {0, 0, 0, sp - d.s});
    const Tensor vp = pad(v4, {0, 0, 0, sp - d.s});
    const Tensor bl = bias4.expand({bias4.size(0), bias4.size(1), d.l, d.s});
    const Tensor bp = pad(pad(bl, {0, sp - d.s}, PadMode::constant, lowest_finite(q.dtype()).to_double()),
                          {0, 0, 0, lp - d.l});
    const int64_t chunk = detail::sdpa_kv_chunk(q4, sp, causal);
    Tensor outp = chunk > 0 ? fused_chunked(qp, kp, vp, bp.contiguous(), scale, chunk)
                            : fused_core(qp, kp, vp, bp.contiguous(), scale, causal);
    t_last_path = "fused_padded";
    return restore(outp.narrow(2, 0, d.l));
  }
  const int64_t chunk = detail::sdpa_kv_chunk(q4, d.s, causal);
  if (chunk > 0) {
    t_last_path = "fused_chunked";
    return restore(fused_chunked(q4, k4, v4, bias4, scale, chunk));
  }
  t_last_path = "fused";
  return restore(fused_core(q4, k4, v4, bias4, scale, causal));
}

}  // namespace

namespace detail {
const char* sdpa_fused_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                   double dropout_p) {
  Dims d;
  d.l = q.size(-2);
  d.s = k.size(-2);
  d.e = q.size(-1);
  d.ev = v.size(-1);
  return fused_unsupported(q, k, v, mask, dropout_p, d);
}

void set_sdpa_last_path(const char* path) { t_last_path = path; }

int64_t sdpa_kv_chunk(const Tensor& q, int64_t s_kv, bool causal) {
  if (causal) return 0;
  if (t_routes.kv_chunk > 0) return t_routes.kv_chunk < s_kv ? t_routes.kv_chunk : 0;
  if (q.device().is_cuda() && s_kv > 1024 && flame::cuda::is_capturing(q.device().index)) return 1024;
  return 0;
}

SdpaRouteGuard::SdpaRouteGuard(SdpaRouteOverride routes) : previous_(t_routes) { t_routes = routes; }
SdpaRouteGuard::~SdpaRouteGuard() { t_routes = previous_; }
}  // namespace detail

SdpaBackendGuard::SdpaBackendGuard(SdpaBackend backend) : previous_(t_backend) { t_backend = backend; }
SdpaBackendGuard::~SdpaBackendGuard() { t_backend = previous_; }
SdpaBackend sdpa_backend() { return t_backend; }
const char* sdpa_last_path() { return t_last_path; }

namespace {
// The public op as an op definition (Note [Invoke]): low precision under autocast (a float mask
// too), one opaque step of a flame::compile trace. It routes to the fused core (SdpaCoreDef, which
// records the fused node) or composes the math path (whose ops record their own nodes).
struct SdpaCall {
  Tensor q, k, v, attn_mask;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  Generator* gen = nullptr;
};
struct SdpaDef : op_detail::OpDefaults<SdpaCall> {
  struct Prep {
    Dims d;
    double scale = 1.0;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static constexpr op_detail::Autocast autocast = op_detail::Autocast::low;
  static const char* name(const Args&) { return "scaled_dot_product_attention"; }
  static TensorList inputs(const Args& a) { return {a.q, a.k, a.v, a.attn_mask}; }
  static const Tensor& lead(const Args& a) { return a.q; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.q = in[0];
    a.k = in[1];
    a.v = in[2];
    a.attn_mask = in[3];
    return a;
  }
  static Prep prepare(const Args& a) {
    Prep p{validate(a.q, a.k, a.v, a.attn_mask, a.dropout_p, a.is_causal, a.scale)};
    p.scale = default_scale(p.d, a.scale);
    return p;
  }
  static Result run(const Args& a, Prep& p);
  static void record(Result&, const Args&, const Prep&) {}  // the routes record their own nodes
};
}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    double dropout_p, bool is_causal, std::optional<double> scale, Generator* gen) {
  return op_detail::invoke<SdpaDef>({q, k, v, attn_mask, dropout_p, is_causal, scale, gen});
}

SdpaDef::Result SdpaDef::run(const Args& a, Prep& p) {
  const Tensor &q = a.q, &k = a.k, &v = a.v, &attn_mask = a.attn_mask;
  const double dropout_p = a.dropout_p;
  const bool is_causal = a.is_causal;
  const Dims& d = p.d;
  const double sc = p.scale;
  const SdpaBackend choice = t_backend;
  if (choice != SdpaBackend::math) {
    const char* why = fused_unsupported(q, k, v, attn_mask, dropout_p, d);
    FLAME_CHECK(why == nullptr || choice != SdpaBackend::fused, kOp, "the fused path was requested but cannot run: ",
                why ? why : "", " (query ", describe(q), ", key ", describe(k), ", value ", describe(v), ")");
    const bool take_fused = why == nullptr && (choice == SdpaBackend::fused || q.device().is_cuda());
    if (take_fused) {
      if (choice == SdpaBackend::fused) return {fused_path(q, k, v, attn_mask, is_causal, sc, d)};
      // automatic: a configuration this cuDNN rejects (its support check runs when the plan is
      // built, in the forward) falls back to the math path; sdpa_last_path() then says "math".
      try {
        return {fused_path(q, k, v, attn_mask, is_causal, sc, d)};
      } catch (const Error&) {
      }
    }
  }
  if (const int64_t rows = math_chunk_rows(q, k, v, attn_mask, dropout_p); rows > 0) {
    t_last_path = "math_chunked";
    return {math_path_in_chunks(q, k, v, attn_mask, is_causal, sc, rows)};
  }
  t_last_path = "math";
  return {math_path(q, k, v, attn_mask, dropout_p, is_causal, sc, a.gen)};
}

}  // namespace flame::nn::functional

namespace flame::op_detail {

Tensor fused_operand(const Tensor& t) {
  bool ok = t.stride(-1) == 1 && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; ok && d + 1 < t.dim(); ++d) ok = t.size(d) == 1 || (t.stride(d) > 0 && t.stride(d) % 8 == 0);
  return ok ? t : t.contiguous();
}

SdpaCoreDef::Result SdpaCoreDef::run(const Args& a, Prep&) {
  if (a.kv_chunk > 0) return nn::functional::fused_chunked_kernel(a.q, a.k, a.v, a.bias, a.scale, a.kv_chunk);
  return nn::functional::fused_core_kernel(a.q, a.k, a.v, a.bias, a.scale, a.causal);
}

}  // namespace flame::op_detail
