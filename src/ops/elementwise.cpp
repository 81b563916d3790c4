// Elementwise ops: dtype rules (Note [Op list]), broadcasting, scalar forms, in-place forms.
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>

#include "flame/ops.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/autocast_hooks.h"
#include "src/core/grad_state.h"
#include "src/ops/grad_hooks.h"
#include "src/ops/invoke.h"
#include "src/ops/trace_hooks.h"
#include "src/ops/alpha.h"
#include "src/ops/elementwise.h"
#include "src/opdef/scalar_math.h"

namespace flame {
using backend::BinaryOp;
using backend::OpKind;
using backend::UnaryOp;
using backend::UnaryParams;

namespace {

struct OpInfo {
  const char* name;
  OpKind kind;
};

// Each op's name and kind, by its enum value (a table lookup: this is the per-op path).
#define FLAME_INFO(name, Functor, kind, ...) OpInfo{#name, OpKind::kind},
constexpr OpInfo kUnaryInfo[] = {FLAME_UNARY_OPS(FLAME_INFO)};
constexpr OpInfo kBinaryInfo[] = {FLAME_BINARY_OPS(FLAME_INFO)};
#undef FLAME_INFO
inline OpInfo info(UnaryOp op) { return kUnaryInfo[static_cast<std::size_t>(op)]; }
inline OpInfo info(BinaryOp op) { return kBinaryInfo[static_cast<std::size_t>(op)]; }

void check_defined(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "got an undefined tensor");
}

// The dtype of `t op s` (PyTorch: a Python number never widens a tensor of the same category).
DType promote_with_scalar(DType t, Scalar s) {
  if (s.is_floating() && !is_floating(t)) return kDefaultFloat;
  if (s.is_integral() && is_bool(t)) return DType::i64;
  return t;
}

// Note [Exact integer scalars]
// Scalar kernels take their operand as a double (UnaryParams), exact only up to 2^53: an i64
// tensor plus 2^53 + 1 would add 2^53. An integral scalar beyond that on an integer tensor takes
// the exact path instead: a 0-d i64 tensor filled from the Scalar's int64 (fill is exact) and the
// binary kernel, computed in i64 and converted to the tensor's dtype (wrapping, as the scalar
// kernels do). Every smaller value keeps the one-kernel scalar path.
bool exact_in_double(int64_t v) {
  constexpr int64_t lim = int64_t{1} << 53;
  return v >= -lim && v <= lim;
}

// True when `t op s` in dtype dt must not go through a double (Note [Exact integer scalars]).
bool needs_exact_int(DType dt, Scalar s) {
  return !is_floating(dt) && !s.is_floating() && !exact_in_double(s.to_int());
}

Tensor i64_scalar(Scalar s, Device device) { return Tensor::full({}, s, {DType::i64, device}); }

// -s; an integer scalar wraps (-INT64_MIN == INT64_MIN, Note [Defined integer math]).
Scalar negated(Scalar s) {
  return s.is_floating() ? Scalar(-s.to_double()) : Scalar(math::wrap_neg(s.to_int()));
}

// Arithmetic that PyTorch refuses on bool tensors.
bool rejects_bool(BinaryOp op) {
  return op == BinaryOp::sub || op == BinaryOp::pow || op == BinaryOp::fmod || op == BinaryOp::atan2;
}

// The ops PyTorch's autocast runs in f32: the op table's autocast column (Note [Autocast policy]),
// as tables made at compile time (a string compare per call otherwise: this is the per-op path).
#define FLAME_AUTOCAST_F32(name, Functor, kind, surface, autocast, ...) std::string_view(#autocast) == "f32",
constexpr bool kUnaryAutocastF32[] = {FLAME_UNARY_OPS(FLAME_AUTOCAST_F32)};
constexpr bool kBinaryAutocastF32[] = {FLAME_BINARY_OPS(FLAME_AUTOCAST_F32)};
#undef FLAME_AUTOCAST_F32
bool autocast_f32(UnaryOp op) { return kUnaryAutocastF32[static_cast<std::size_t>(op)]; }
bool autocast_f32(BinaryOp op) { return kBinaryAutocastF32[static_cast<std::size_t>(op)]; }

// Note [Elementwise definitions]
// The elementwise ops are op definitions (Note [Invoke]) of the `elementwise` trace kind: invoke
// applies their autocast policy (the op table's column), runs the kernel, then reports the op to
// flame::compile's tracer as a node its fused kernels take in, and records the gradient rule
// (src/autograd/rules/elementwise.cpp, through Note [Gradient hooks]).

// y = op(x, p). `dtype` set: x is computed in it and y is of it (the scalar forms, clamp and pow
// work out their promotion themselves); unset: the op's kind decides (Note [Op list]) and its
// table row the autocast policy.
struct UnaryCall {
  UnaryOp op;
  op_detail::Kept<Tensor> x;
  UnaryParams p;
  std::optional<DType> dtype;
};

struct UnaryDef : op_detail::OpDefaults<UnaryCall> {
  struct Prep {
    Tensor in;  // x in the compute dtype (what the kernel reads and the backward sees)
    DType out;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static constexpr op_detail::TraceKind trace_kind = op_detail::TraceKind::elementwise;
  static op_detail::Autocast autocast_of(const Args& a) {
    return !a.dtype && autocast_f32(a.op) ? op_detail::Autocast::f32 : op_detail::Autocast::none;
  }
  static const char* name(const Args& a) { return info(a.op).name; }
  static Prep prepare(const Args& a) {
    const Tensor& x = a.x.get();
    const OpInfo oi = info(a.op);
    check_defined(x, oi.name);
    if (a.dtype) return {x.to(*a.dtype), *a.dtype};
    const DType dt = x.dtype();
    switch (oi.kind) {
      case OpKind::same:
        FLAME_CHECK(!is_bool(dt), oi.name, "not supported for bool tensors (shape ", x.sizes(), ")");
        return {x, dt};
      case OpKind::floating: {
        const DType f = is_floating(dt) ? dt : kDefaultFloat;
        return {x.to(f), f};
      }
      case OpKind::predicate: return {x, DType::boolean};
    }
    return {x, dt};
  }
  static Result run(const Args& a, Prep& p) {
    const Tensor& x = a.x.get();
    Tensor out = make_empty(x.sizes(), p.out, x.device(), info(a.op).name);
    if (out.numel() > 0) backend::backend_for(x.device()).unary(a.op, out, p.in, a.p);
    return {std::move(out)};
  }
  static void trace(compile_detail::Tracer& t, const Result& r, const Args& a, const Prep& p) {
    compile_detail::trace_unary(t, r.out, a.op, p.in, a.p);
  }
  static void record(Result& r, const Args& a, const Prep& p) { rules::unary(r.out, a.op, a.x.get(), p.in, a.p); }
};

Tensor run_unary(UnaryOp op, const Tensor& x, DType dtype, const UnaryParams& p) {
  return op_detail::invoke<UnaryDef>({op, x, p, dtype});
}

// y = op(a, b), broadcast, in the common dtype (Note [Op list]).
struct BinaryCall {
  BinaryOp op;
  op_detail::Kept<Tensor> a, b;
};

struct BinaryDef : op_detail::OpDefaults<BinaryCall> {
  struct Prep {
    Tensor ac, bc;  // the operands in the common dtype, not broadcast
    DType out;
    bool same_shape;  // a and b have one shape (the usual case): no broadcast shape is made
    Shape shape;      // the broadcast shape where they differ
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static constexpr op_detail::TraceKind trace_kind = op_detail::TraceKind::elementwise;
  static op_detail::Autocast autocast_of(const Args& a) {
    return autocast_f32(a.op) ? op_detail::Autocast::f32 : op_detail::Autocast::none;
  }
  static const char* name(const Args& a) { return info(a.op).name; }
  static TensorList inputs(const Args& x) { return {x.a.get(), x.b.get()}; }
  static const Tensor& lead(const Args& x) { return x.a.get(); }
  static Args with_inputs(Args x, const TensorList& in) {
    x.a.set(in[0]);
    x.b.set(in[1]);
    return x;
  }
  static Prep prepare(const Args& x) {
    const Tensor &a = x.a.get(), &b = x.b.get();
    const OpInfo oi = info(x.op);
    check_defined(a, oi.name);
    check_defined(b, oi.name);
    check_same_device(oi.name, a, b);
    DType common = result_type(a, b);
    if (oi.kind == OpKind::floating && !is_floating(common)) common = kDefaultFloat;
    FLAME_CHECK(!(is_bool(common) && rejects_bool(x.op)), oi.name, "not supported for bool tensors");
    Prep p;
    p.out = oi.kind == OpKind::predicate ? DType::boolean : common;
    p.same_shape = a.sizes() == b.sizes();
    if (!p.same_shape) p.shape = broadcast_shapes(a.sizes(), b.sizes(), oi.name);
    p.ac = a.to(common);
    p.bc = b.to(common);
    return p;
  }
  static Result run(const Args& x, Prep& p) {
    const Tensor &a = x.a.get(), &b = x.b.get();
    Tensor out = make_empty(p.same_shape ? a.sizes() : p.shape, p.out, a.device(), info(x.op).name);
    if (out.numel() > 0) {
      // Operands of the output's shape go as they are; only the others need a broadcast view.
      const Shape& shape = out.sizes();
      backend::backend_for(a.device())
          .binary(x.op, out, p.same_shape || p.ac.sizes() == shape ? p.ac : p.ac.expand(shape),
                  p.same_shape || p.bc.sizes() == shape ? p.bc : p.bc.expand(shape));
    }
    return {std::move(out)};
  }
  static void trace(compile_detail::Tracer& t, const Result& r, const Args& x, const Prep& p) {
    compile_detail::trace_binary(t, r.out, x.op, p.ac, p.bc);
  }
  static void record(Result& r, const Args& x, const Prep& p) {
    if (info(x.op).kind != OpKind::predicate) rules::binary(r.out, x.op, x.a.get(), x.b.get(), p.ac, p.bc);
  }
};

// out = cond ? a : b, broadcast, in a's and b's common dtype.
struct WhereCall {
  Tensor cond, a, b;
};

struct WhereDef : op_detail::OpDefaults<WhereCall> {
  struct Prep {
    Tensor ac, bc;  // a and b in the common dtype, not broadcast
    Shape shape;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static constexpr op_detail::TraceKind trace_kind = op_detail::TraceKind::elementwise;
  static const char* name(const Args&) { return "where"; }
  static TensorList inputs(const Args& w) { return {w.cond, w.a, w.b}; }
  static const Tensor& lead(const Args& w) { return w.a; }
  static Args with_inputs(Args w, const TensorList& in) {
    w.cond = in[0];
    w.a = in[1];
    w.b = in[2];
    return w;
  }
  static Prep prepare(const Args& w) {
    check_defined(w.cond, "where");
    check_defined(w.a, "where");
    check_defined(w.b, "where");
    check_same_device("where", w.cond, w.a);
    check_same_device("where", w.a, w.b);
    FLAME_CHECK(is_bool(w.cond.dtype()), "where", "condition must be bool, got ", dtype_name(w.cond.dtype()));
    const DType dt = result_type(w.a, w.b);
    Shape shape = broadcast_shapes(broadcast_shapes(w.cond.sizes(), w.a.sizes(), "where"), w.b.sizes(), "where");
    return {w.a.to(dt), w.b.to(dt), std::move(shape)};
  }
  static Result run(const Args& w, Prep& p) {
    Tensor out = make_empty(p.shape, p.ac.dtype(), w.a.device(), "where");
    if (out.numel() > 0) {
      backend::backend_for(w.a.device()).where(out, w.cond.expand(p.shape), p.ac.expand(p.shape), p.bc.expand(p.shape));
    }
    return {std::move(out)};
  }
  static void trace(compile_detail::Tracer& t, const Result& r, const Args& w, const Prep& p) {
    compile_detail::trace_where(t, r.out, w.cond, p.ac, p.bc);
  }
  static void record(Result& r, const Args& w, const Prep&) { rules::where(r.out, w.cond, w.a, w.b); }
};

}  // namespace


Tensor unary_op(UnaryOp op, const Tensor& x, const UnaryParams& p) {
  return op_detail::invoke<UnaryDef>({op, x, p, std::nullopt});
}

Tensor scalar_op(UnaryOp op, const Tensor& x, Scalar s) {
  const OpInfo oi = info(op);
  check_defined(x, oi.name);
  DType dt = promote_with_scalar(x.dtype(), s);
  if (oi.kind == OpKind::floating && !is_floating(dt)) dt = kDefaultFloat;
  if (needs_exact_int(dt, s) && (op == UnaryOp::add_scalar || op == UnaryOp::mul_scalar ||
                                 op == UnaryOp::rsub_scalar || op == UnaryOp::pow_scalar)) {
    const Tensor xs = x.to(DType::i64), ss = i64_scalar(s, x.device());
    Tensor r;
    switch (op) {
      case UnaryOp::add_scalar: r = binary_op(BinaryOp::add, xs, ss); break;
      case UnaryOp::mul_scalar: r = binary_op(BinaryOp::mul, xs, ss); break;
      case UnaryOp::rsub_scalar: r = binary_op(BinaryOp::sub, ss, xs); break;
      default: r = binary_op(BinaryOp::pow, xs, ss); break;
    }
    return r.to(dt);
  }
  UnaryParams p;
  p.a = s.to_double();
  return run_unary(op, x, dt, p);
}

Tensor binary_op(BinaryOp op, const Tensor& a, const Tensor& b) {
  return op_detail::invoke<BinaryDef>({op, a, b});
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    FLAME_CHECK(da == db || da == 1 || db == 1, op, "shapes ", a, " and ", b, " are not broadcastable");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

DType result_type(const Tensor& a, const Tensor& b) {
  const bool da = a.dim() > 0, db = b.dim() > 0;
  if (da == db) return promote_types(a.dtype(), b.dtype());
  // A 0-d tensor only takes part when it is of a higher category (bool < integer < floating).
  const DType dim_t = da ? a.dtype() : b.dtype(), zero_t = da ? b.dtype() : a.dtype();
  auto category = [](DType t) { return is_bool(t) ? 0 : (is_integral(t) ? 1 : 2); };
  return category(zero_t) > category(dim_t) ? zero_t : dim_t;
}

// ---- unary ----
// The `fn` rows of the op table (Note [Op table]).
#define FLAME_SIMPLE_UNARY(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface(Tensor name(const Tensor& x) { return unary_op(UnaryOp::name, x, {}); })
FLAME_UNARY_OPS(FLAME_SIMPLE_UNARY)
#undef FLAME_SIMPLE_UNARY

Tensor leaky_relu(const Tensor& x, double negative_slope) {
  return unary_op(UnaryOp::leaky_relu, x, {negative_slope});
}
Tensor gelu(const Tensor& x, bool tanh_approximation) {
  return unary_op(tanh_approximation ? UnaryOp::gelu_tanh : UnaryOp::gelu, x, {});
}
Tensor softplus(const Tensor& x, double beta, double threshold) {
  FLAME_CHECK(beta != 0.0, "softplus", "beta must be non-zero");
  return unary_op(UnaryOp::softplus, x, {beta, threshold});
}
Tensor elu(const Tensor& x, double alpha) { return unary_op(UnaryOp::elu, x, {alpha}); }

Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max) {
  FLAME_CHECK(min || max, "clamp", "at least one of min and max must be given");
  check_defined(x, "clamp");
  FLAME_CHECK(!is_bool(x.dtype()), "clamp", "not supported for bool tensors");
  // Bounds take part in type promotion as in PyTorch: an integer tensor clamped by a floating
  // bound becomes f32.
  DType dt = x.dtype();
  if (min) dt = promote_with_scalar(dt, *min);
  if (max) dt = promote_with_scalar(dt, *max);
  if ((min && needs_exact_int(dt, *min)) || (max && needs_exact_int(dt, *max))) {
    // Note [Exact integer scalars]: bounds beyond 2^53 compared exactly, in i64.
    Tensor r = x.to(DType::i64);
    if (min) r = maximum(r, i64_scalar(*min, x.device()));
    if (max) r = minimum(r, i64_scalar(*max, x.device()));
    return r.to(dt);
  }
  UnaryParams p{min ? min->to_double() : -INFINITY, max ? max->to_double() : INFINITY};
  if (!is_floating(dt)) {
    // An absent bound must stay inside int64 after the kernel's cast from double (2^63 is not).
    p.a = min ? static_cast<double>(min->to_int()) : -9.2e18;
    p.b = max ? static_cast<double>(max->to_int()) : 9.2e18;
  }
  return run_unary(UnaryOp::clamp, x, dt, p);
}

Tensor pow(const Tensor& x, Scalar exponent) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return pow(amp::detail::cast_f32(x), exponent);
  }
  check_defined(x, "pow");
  if (!exponent.is_floating() && !is_floating(x.dtype())) {
    FLAME_CHECK(exponent.to_int() >= 0, "pow", "integers to negative integer powers are not allowed (",
                dtype_name(x.dtype()), " tensor, exponent ", exponent.to_int(), ")");
  }
  DType dt = promote_with_scalar(x.dtype(), exponent);
  if (is_bool(dt)) dt = DType::i64;
  if (needs_exact_int(dt, exponent)) return scalar_op(UnaryOp::pow_scalar, x, exponent);  // exact path
  UnaryParams p{exponent.to_double()};
  return run_unary(UnaryOp::pow_scalar, x, dt, p);
}

Tensor nan_to_num(const Tensor& x, double nan, std::optional<double> posinf, std::optional<double> neginf) {
  check_defined(x, "nan_to_num");
  if (!is_floating(x.dtype())) return x.clone();
  double hi = std::numeric_limits<float>::max();
  if (x.dtype() == DType::f64) hi = std::numeric_limits<double>::max();
  if (x.dtype() == DType::f16) hi = 65504.0;
  if (x.dtype() == DType::bf16) hi = 3.3895313892515355e38;
  return unary_op(UnaryOp::nan_to_num, x, {nan, posinf.value_or(hi), neginf.value_or(-hi)});
}

// ---- binary ----
#define FLAME_SIMPLE_BINARY(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface(Tensor name(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::name, a, b); })
FLAME_BINARY_OPS(FLAME_SIMPLE_BINARY)
#undef FLAME_SIMPLE_BINARY

Tensor add_scalar(const Tensor& a, Scalar s) { return scalar_op(UnaryOp::add_scalar, a, s); }
Tensor sub_scalar(const Tensor& a, Scalar s) {
  FLAME_CHECK(a.defined() && !is_bool(a.dtype()), "sub", "not supported for bool tensors");
  return scalar_op(UnaryOp::add_scalar, a, negated(s));
}
Tensor mul_scalar(const Tensor& a, Scalar s) { return scalar_op(UnaryOp::mul_scalar, a, s); }
Tensor div_scalar(const Tensor& a, Scalar s) { return scalar_op(UnaryOp::div_scalar, a, s); }
Tensor rsub_scalar(const Tensor& a, Scalar s) {
  FLAME_CHECK(a.defined() && !is_bool(a.dtype()), "rsub", "not supported for bool tensors");
  return scalar_op(UnaryOp::rsub_scalar, a, s);
}
Tensor rdiv_scalar(const Tensor& a, Scalar s) { return scalar_op(UnaryOp::rdiv_scalar, a, s); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  return op_detail::invoke<WhereDef>({cond, a, b});
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, Scalar value) {
  check_defined(x, "masked_fill");
  check_defined(mask, "masked_fill");
  check_same_device("masked_fill", x, mask);
  FLAME_CHECK(is_bool(mask.dtype()), "masked_fill", "mask must be bool, got ", dtype_name(mask.dtype()));
  FLAME_CHECK(broadcast_shapes(x.sizes(), mask.sizes(), "masked_fill") == x.sizes(), "masked_fill",
              "mask of shape ", mask.sizes(), " does not broadcast to the input's shape ", x.sizes());
  FLAME_CHECK(is_floating(x.dtype()) || !value.is_floating(), "masked_fill", "cannot fill a ",
              dtype_name(x.dtype()), " tensor with the floating value ", value.to_double());
  return where(mask, Tensor::full({}, value, {x.dtype(), x.device()}), x);
}

// ---- in-place ----
namespace {
bool can_cast(DType from, DType to) {
  if (is_floating(from) && !is_floating(to)) return false;
  if (!is_bool(from) && is_bool(to)) return false;
  return true;
}

// `src` as an operand for an in-place write into `self`: on self's device, broadcast to self's
// shape, and copied first when it overlaps self without being exactly self.
Tensor inplace_operand(const Tensor& self, const Tensor& src, const char* op) {
  check_defined(src, op);
  check_same_device(op, self, src);
  const bool same_shape = src.sizes() == self.sizes();
  FLAME_CHECK(same_shape || broadcast_shapes(self.sizes(), src.sizes(), op) == self.sizes(), op, "output of shape ",
              self.sizes(), " does not match the broadcast shape with ", src.sizes());
  Tensor s = src;
  const bool identical = src.impl()->offset == self.impl()->offset && same_shape && src.strides() == self.strides();
  if (src.shares_storage(self) && !identical) s = src.clone();
  return same_shape ? s : s.expand(self.sizes());  // an operand of self's shape needs no view
}

Tensor& inplace_binary(Tensor& self, BinaryOp op, const Tensor& other, const char* name) {
  const OpInfo oi = info(op);
  check_defined(self, name);
  check_no_internal_overlap(self, name);
  const bool recorded = rules::inplace_records(self, {other}, name);
  Tensor o = inplace_operand(self, other, name);
  DType common = result_type(self, other);
  if (oi.kind == OpKind::floating && !is_floating(common)) common = kDefaultFloat;
  FLAME_CHECK(can_cast(common, self.dtype()), name, "result type ", dtype_name(common),
              " cannot be written in place into a ", dtype_name(self.dtype()), " tensor");
  FLAME_CHECK(!(is_bool(self.dtype()) && rejects_bool(op)), name, "not supported for bool tensors");
  if (recorded) {  // Note [In-place recording]
    // Rules that read the old value get a clone of it (the write is about to overwrite it); the
    // add and sub rules read no operand, so `h += a` costs no extra copy.
    Tensor old = rules::inplace_current(self);
    if (op == BinaryOp::add || op == BinaryOp::sub) {
      rules::inplace_commit(self, binary_op(op, old, other), name);
      return self;
    }
    old = old.clone();
    // An operand in the destination's memory (self itself, or a view of its storage) would be
    // saved by the rule while the destination's new history runs through that rule: a reference
    // cycle that leaks the graph, and a saved value the write invalidates. The rule reads a copy
    // taken before the write instead (the old value itself when the operand is self: `h.mul_(h)`);
    // a clone keeps the operand's own history, so its gradient still reaches it.
    Tensor operand = other;
    if (other.shares_storage(self)) operand = other.impl() == self.impl() ? old : other.clone();
    rules::inplace_commit(self, binary_op(op, old, operand), name);
    return self;
  }
  if (self.numel() == 0) return self;
  if (common == self.dtype()) {
    backend::backend_for(self.device()).binary(op, self, self, o.to(common));
  } else {
    self.copy_(binary_op(op, self, other));
    return self;
  }
  bump_version(self);
  return self;
}

Tensor& inplace_scalar(Tensor& self, UnaryOp op, Scalar s, const char* name) {
  const OpInfo oi = info(op);
  check_defined(self, name);
  check_no_internal_overlap(self, name);
  const bool recorded = rules::inplace_records(self, {}, name);
  DType dt = promote_with_scalar(self.dtype(), s);
  if (oi.kind == OpKind::floating && !is_floating(dt)) dt = kDefaultFloat;
  FLAME_CHECK(can_cast(dt, self.dtype()), name, "result type ", dtype_name(dt),
              " cannot be written in place into a ", dtype_name(self.dtype()), " tensor");
  if (recorded) {  // Note [In-place recording]
    rules::inplace_commit(self, scalar_op(op, rules::inplace_current(self).clone(), s), name);
    return self;
  }
  if (self.numel() == 0) return self;
  if (needs_exact_int(dt, s)) {  // Note [Exact integer scalars]; an integer dt is self's dtype here
    return self.copy_(scalar_op(op, self, s));
  }
  backend::backend_for(self.device()).unary(op, self, self, UnaryParams{s.to_double()});
  bump_version(self);
  return self;
}
}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  check_defined(*this, "copy_");
  check_defined(src, "copy_");
  check_no_internal_overlap(*this, "copy_");
  FLAME_CHECK(broadcast_shapes(sizes(), src.sizes(), "copy_") == sizes(), "copy_", "source of shape ",
              src.sizes(), " does not broadcast to the destination's shape ", sizes());
  if (rules::inplace_records(*this, {src}, "copy_")) {  // Note [In-place recording]
    Tensor s = src.device() == device() ? src : src.to(device());
    if (s.dtype() != dtype()) s = s.to(dtype());
    rules::inplace_commit(*this, s.sizes() == sizes() ? s : s.expand(sizes()), "copy_");
    return *this;
  }
  if (numel() == 0) return *this;
  Tensor s = src.device() == device() ? src : src.to(device());
  const bool identical = s.impl()->offset == impl()->offset && s.sizes() == sizes() && s.strides() == strides();
  if (s.shares_storage(*this)) {
    if (identical && s.dtype() == dtype()) return *this;
    s = s.clone();
  }
  backend::backend_for(device()).copy(*this, s.expand(sizes()));
  bump_version(*this);
  return *this;
}

Tensor& Tensor::fill_(Scalar value) {
  check_defined(*this, "fill_");
  check_no_internal_overlap(*this, "fill_");
  if (rules::inplace_records(*this, {}, "fill_")) {  // the old value gets no gradient
    rules::inplace_commit(*this, Tensor::full(sizes(), value, {dtype(), device()}), "fill_");
    return *this;
  }
  if (numel() > 0) backend::backend_for(device()).fill(*this, value);
  bump_version(*this);
  return *this;
}
Tensor& Tensor::zero_() { return fill_(0); }

Tensor& Tensor::add_(const Tensor& o, Scalar alpha) {
  return inplace_binary(*this, BinaryOp::add, alpha_scaled("add_", *this, o, alpha), "add_");
}
Tensor& Tensor::sub_(const Tensor& o) { return inplace_binary(*this, BinaryOp::sub, o, "sub_"); }
Tensor& Tensor::mul_(const Tensor& o) { return inplace_binary(*this, BinaryOp::mul, o, "mul_"); }
Tensor& Tensor::div_(const Tensor& o) { return inplace_binary(*this, BinaryOp::div, o, "div_"); }
Tensor& Tensor::add_(Scalar s) { return inplace_scalar(*this, UnaryOp::add_scalar, s, "add_"); }
Tensor& Tensor::sub_(Scalar s) {
  return inplace_scalar(*this, UnaryOp::add_scalar, negated(s), "sub_");
}
Tensor& Tensor::mul_(Scalar s) { return inplace_scalar(*this, UnaryOp::mul_scalar, s, "mul_"); }
Tensor& Tensor::div_(Scalar s) { return inplace_scalar(*this, UnaryOp::div_scalar, s, "div_"); }
Tensor& Tensor::clamp_(std::optional<Scalar> min, std::optional<Scalar> max) {
  check_defined(*this, "clamp_");
  check_no_internal_overlap(*this, "clamp_");
  if (rules::inplace_records(*this, {}, "clamp_")) {  // Note [In-place recording]
    rules::inplace_commit(*this, flame::clamp(rules::inplace_current(*this).clone(), min, max), "clamp_");
    return *this;
  }
  return copy_(flame::clamp(*this, min, max));
}

// ---- operators ----
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, Scalar b) { return add_scalar(a, b); }
Tensor operator-(const Tensor& a, Scalar b) { return sub_scalar(a, b); }
Tensor operator*(const Tensor& a, Scalar b) { return mul_scalar(a, b); }
Tensor operator/(const Tensor& a, Scalar b) { return div_scalar(a, b); }
Tensor operator+(Scalar a, const Tensor& b) { return add_scalar(b, a); }
Tensor operator-(Scalar a, const Tensor& b) { return rsub_scalar(b, a); }
Tensor operator*(Scalar a, const Tensor& b) { return mul_scalar(b, a); }
Tensor operator/(Scalar a, const Tensor& b) { return rdiv_scalar(b, a); }
Tensor& operator+=(Tensor& a, const Tensor& b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, const Tensor& b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, const Tensor& b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, const Tensor& b) { return a.div_(b); }
Tensor& operator+=(Tensor& a, Scalar b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, Scalar b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, Scalar b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, Scalar b) { return a.div_(b); }

}  // namespace flame
