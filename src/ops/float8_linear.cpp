// The 8-bit float Linear's forward (Note [Float8 Linear] in flame/nn/float8.h) and the row casts
// it is made of (float8_quantize_rows of flame/ops.h); the gradient rule is in
// src/autograd/rules/float8_linear.cpp.
#include "flame/nn/linear_float8.h"

#include <map>
#include <mutex>

#include "flame/cuda.h"
#include "flame/grad_mode.h"
#include "flame/ops.h"
#include "src/backend/fused/float8.h"
#include "src/core/tensor_impl.h"
#include "src/ops/autocast_hooks.h"
#include "src/ops/float8_linear_def.h"
#include "src/ops/linear_epilogue.h"

namespace flame {

std::pair<Tensor, Tensor> float8_quantize_rows(const Tensor& x, DType f8, const Tensor& col) {
  const char* op = "float8_quantize_rows";
  FLAME_CHECK(is_float8(f8), op, "expected an 8-bit float dtype (f8_e4m3fn or f8_e5m2), got ", dtype_name(f8));
  FLAME_CHECK(x.defined() && is_floating(x.dtype()), op, "expected a floating tensor, got ",
              x.defined() ? dtype_name(x.dtype()) : "an undefined tensor");
  FLAME_CHECK(x.dim() >= 1, op, "expected at least 1 dim (rows of the last dim), got a 0-d tensor");
  const int64_t cols = x.size(-1);
  Tensor colf;
  if (col.defined()) {
    FLAME_CHECK(is_floating(col.dtype()) && col.dim() == 1 && col.size(0) == cols, op,
                "col must be a floating [", cols, "] tensor for x of shape ", x.sizes(), ", got ",
                dtype_name(col.dtype()), " ", col.sizes());
    FLAME_CHECK(col.device() == x.device(), op, "col is on ", col.device().str(), " but x is on ",
                x.device().str());
    colf = col.detach().to(DType::f32).contiguous();
  }
  NoGradGuard no_grad;
  const Tensor xc = x.detach().contiguous();
  Tensor q = make_empty(x.sizes(), f8, x.device(), op);
  Shape rows_shape(x.sizes().begin(), x.sizes().end() - 1);
  Tensor scale = make_empty(rows_shape, DType::f32, x.device(), op);
  backend::fused::float8_quantize_rows.run(x.device(), q, scale, xc, colf);
  return {q, scale};
}

namespace op_detail {
namespace {
constexpr const char* kOp = "linear_float8";

// q as the kernels read it: in place when it is contiguous or a column block of a wider weight
// whose rows start 16 bytes apart (q.narrow(1, ...) of a layer's weight; Note [Float8 Linear]),
// else a contiguous copy.
Tensor rows_in_place(const Tensor& q) {
  return q.is_contiguous() || (q.stride(1) == 1 && q.stride(0) % 16 == 0) ? q : q.contiguous();
}
}  // namespace

Tensor float8_dense(const Tensor& q, const Tensor& scale, DType dtype) {
  NoGradGuard no_grad;
  Tensor w = make_empty(q.sizes(), dtype, q.device(), kOp);
  backend::fused::float8_dequantize_rows.run(q.device(), w, rows_in_place(q), scale);
  return w;
}

Tensor float8_matmul(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, const Tensor& bias,
                     DType dtype) {
  NoGradGuard no_grad;
  Tensor out = make_empty({a.size(0), b.size(0)}, dtype, a.device(), kOp);
  if (backend::fused::float8_gemm.try_run(a.device(), out, a, a_scale, b, b_scale, bias)) return out;
  // The reference: the products of the 8-bit values (exact in f32) summed in f32, then the scales.
  Tensor y = a.to(DType::f32).matmul(b.to(DType::f32).t()) * a_scale.unsqueeze(1) * b_scale.unsqueeze(0);
  if (bias.defined()) y = y + bias.to(DType::f32);
  return y.to(dtype);
}

// Note [Float8 input reuse]
// Attention's to_q, to_k and to_v (and FLUX's proj_mlp beside them) read one input: in fp8 mode
// each would cast it to 8 bits again. The forward keeps its thread's last cast (one entry): x's
// storage (weakly: the entry keeps no activation alive), element offset, shape, dtype and the
// storage's version when it was cast, with the codes and row scales. A call whose x matches
// every field reads them instead of casting again; an in-place write to x bumps the version and
// a freed storage no longer locks, so a stale entry is never read. The entry holds the last
// codes (1 byte per element) until the next cast, which drops them before allocating its own. It
// is neither read nor written while the thread captures a CUDA graph: a cast made outside a graph
// would not be replayed inside it, and one made inside lives in the graph's memory.
namespace {
struct LastInputCast {
  std::weak_ptr<Storage> storage;
  int64_t offset = 0;
  Shape sizes;
  DType dtype = DType::f32;
  uint64_t version = 0;
  Tensor q, scale;
};
thread_local LastInputCast t_last_cast;

std::pair<Tensor, Tensor> cast_input_once(const Tensor& x2) {
  const Device dev = x2.device();
  if (dev.is_cuda() && cuda::is_capturing(dev.index)) return float8_quantize_rows(x2, DType::f8_e4m3fn);
  const TensorImpl* impl = x2.impl();
  const std::shared_ptr<Storage>& st = impl->storage;
  const uint64_t version = st->version.load(std::memory_order_relaxed);
  LastInputCast& e = t_last_cast;
  if (e.q.defined() && e.storage.lock() == st && e.offset == impl->offset && e.sizes == impl->sizes &&
      e.dtype == impl->dtype && e.version == version)
    return {e.q, e.scale};
  e = LastInputCast{};  // the old codes go back to the pool before the new ones are allocated
  auto [q, scale] = float8_quantize_rows(x2, DType::f8_e4m3fn);
  e.storage = st;
  e.offset = impl->offset;
  e.sizes = impl->sizes;
  e.dtype = impl->dtype;
  e.version = version;
  e.q = q;
  e.scale = scale;
  return {q, scale};
}
}  // namespace

Float8LinearDef::Prep Float8LinearDef::prepare(const Args& a) {
  const Tensor &x = a.x, &q = a.q, &scale = a.scale, &bias = a.bias;
  FLAME_CHECK(x.defined() && q.defined() && scale.defined(), kOp, "x, the 8-bit weight and its scale must be defined");
  FLAME_CHECK(is_floating(x.dtype()), kOp, "x must be floating, got ", dtype_name(x.dtype()), " (shape ", x.sizes(),
              ")");
  FLAME_CHECK(is_float8(q.dtype()) && q.dim() == 2, kOp,
              "the weight must be a 2-d 8-bit float tensor [out_features, in_features], got ", dtype_name(q.dtype()),
              " ", q.sizes(), "; quantise a weight with nn::quantize_float8 or Linear::to_float8");
  const int64_t out = q.size(0), in = q.size(1);
  FLAME_CHECK(x.dim() >= 1 && x.size(-1) == in, kOp, "input of shape ", x.sizes(), " does not end in in_features = ",
              in, " (weight shape ", q.sizes(), ")");
  FLAME_CHECK(is_floating(scale.dtype()) && (scale.numel() == out || scale.numel() == 1), kOp,
              "scale must be floating with one value per output row (", out, ") or one in all, got ",
              dtype_name(scale.dtype()), " ", scale.sizes());
  FLAME_CHECK(!scale.requires_grad(), kOp, "the weight's scale gets no gradient; detach it");
  for (const Tensor* t : {&q, &scale, &bias}) {
    if (!t->defined()) continue;
    FLAME_CHECK(t->device() == x.device(), kOp, (t == &q ? "the weight" : t == &scale ? "scale" : "bias"), " is on ",
                t->device().str(), " but x is on ", x.device().str());
  }
  if (bias.defined())
    FLAME_CHECK(is_floating(bias.dtype()) && bias.dim() == 1 && bias.size(0) == out, kOp, "bias must be floating [",
                out, "], got ", dtype_name(bias.dtype()), " ", bias.sizes());
  FLAME_CHECK(is_float8(a.grad_dtype), kOp, "grad_dtype must be f8_e4m3fn or f8_e5m2, got ", dtype_name(a.grad_dtype));
  Prep p;
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) rows *= x.size(i);
  p.out_shape = Shape(x.sizes().begin(), x.sizes().end() - 1);
  p.out_shape.push_back(out);
  p.x2 = x.detach().reshape({rows, in}).contiguous();
  p.scale = scale.detach().to(DType::f32).reshape({-1}).expand({out}).contiguous();
  if (bias.defined()) p.bias = bias.detach().to(x.dtype()).contiguous();
  return p;
}

Float8LinearDef::Result Float8LinearDef::run(const Args& a, Prep& p) {
  NoGradGuard no_grad;
  const DType dt = a.x.dtype();
  Result r;
  if (a.compute == nn::Float8Compute::fp8) {
    const auto [xq, xs] = cast_input_once(p.x2);  // Note [Float8 input reuse]
    r.out = float8_matmul(xq, xs, rows_in_place(a.q), p.scale, p.bias, dt).view(p.out_shape);
  } else {
    // The ordinary GEMM (with its fused bias where the device has it) over the weight rebuilt for
    // this call.
    const Tensor w = float8_dense(a.q, p.scale, dt);
    if (auto y = flame::detail::linear_bias_fused(p.x2, w, p.bias)) {
      r.out = y->view(p.out_shape);
    } else {
      const Tensor y2 = p.x2.matmul(w.t());
      r.out = (p.bias.defined() ? y2 + p.bias : y2).view(p.out_shape);
    }
  }
  return r;
}

}  // namespace op_detail

namespace nn {

Float8Compute parse_float8_compute(const std::string& s) {
  if (s == "dequantize") return Float8Compute::dequantize;
  if (s == "fp8") return Float8Compute::fp8;
  FLAME_FAIL("float8", "unknown 8-bit compute mode '", s, "': expected dequantize (8-bit storage, the ordinary GEMM) "
             "or fp8 (FP8 GEMMs)");
}

const char* float8_compute_name(Float8Compute c) { return c == Float8Compute::fp8 ? "fp8" : "dequantize"; }

bool float8_gemm_supported(Device device) {
  if (!device.is_cuda()) return false;
  static std::mutex mu;
  static std::map<int, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = known.find(device.index); it != known.end()) return it->second;
  NoGradGuard no_grad;
  const TensorOptions f32(DType::f32, device);
  const Tensor a = Tensor::ones({16, 16}, f32).to(DType::f8_e4m3fn), s = Tensor::ones({16}, f32);
  Tensor out = Tensor::empty({16, 16}, TensorOptions(DType::bf16, device));
  const bool ok = backend::fused::float8_gemm.try_run(device, out, a, s, a, s, Tensor()) &&
                  (out.to(DType::f32) == 16.0).all().item<bool>();
  known[device.index] = ok;
  return ok;
}

const char* float8_gemm_path(Device device) {
  if (!float8_gemm_supported(device)) return "reference";
  const int path = backend::fused::float8_gemm_path.run(device, device.index);
  return path == 1 ? "cublaslt-outer-vector-scales" : "cublaslt-then-scale-pass";
}

Tensor functional::linear_float8(const Tensor& x, const Tensor& q, const Tensor& scale, const Tensor& bias,
                                 Float8Compute compute, DType grad_dtype) {
  if (amp::detail::should_autocast(x)) {  // x and the bias in the low dtype; q and scale as they are
    amp::detail::AutocastOpScope scope;
    return op_detail::invoke<op_detail::Float8LinearDef>(
        {amp::detail::cast_low(x), q, scale, amp::detail::cast_low(bias), compute, grad_dtype});
  }
  return op_detail::invoke<op_detail::Float8LinearDef>({x, q, scale, bias, compute, grad_dtype});
}

}  // namespace nn
}  // namespace flame
