// Random factories. Each draws one generator offset; see random.h and src/random/philox.h.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "flame/ops.h"
#include "flame/random.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/backend/graph_rng.h"

namespace flame {

Generator& default_generator() {
  static Generator gen(0x5eed);
  return gen;
}
void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

namespace random_detail {
GraphRng*& current_graph_rng() {
  thread_local GraphRng* rng = nullptr;
  return rng;
}
}  // namespace random_detail

namespace {
Tensor random_tensor(backend::RandomKind kind, const Shape& shape, DType dt, Device dev, Generator* gen,
                     const char* op, double a, double b) {
  Generator& g = gen ? *gen : default_generator();
  Tensor t = make_empty(shape, dt, dev, op);
  // Note [Graph-safe RNG]: under capture the draw reads its seed and offset from device memory.
  random_detail::GraphRng* capture = random_detail::current_graph_rng();
  if (capture != nullptr && dev.is_cuda() && dev.index == capture->device()) {
    if (t.numel() > 0) {
      capture->random(kind, t, g, a, b);
    } else {
      (void)g.next_offset();  // an empty draw still advances the generator, as in eager mode
    }
    return t;
  }
  const uint64_t seed = g.seed(), offset = g.next_offset();
  if (t.numel() > 0) backend::backend_for(dev).random(kind, t, seed, offset, a, b);
  return t;
}
}  // namespace

namespace {
// Tensor::rand and Tensor::uniform; `op` is the public name in errors.
Tensor uniform_tensor(const Shape& shape, double low, double high, TensorOptions opts, Generator* gen,
                      const char* op) {
  const DType dt = opts.dtype_or(DType::f32);
  FLAME_CHECK(is_floating(dt), op, "expected a floating dtype, got ", dtype_name(dt));
  FLAME_CHECK(!std::isnan(low) && !std::isnan(high), op, std::isnan(low) ? "low" : "high",
              " is NaN; the bounds must be numbers with low <= high (got low ", low, ", high ", high, ")");
  FLAME_CHECK(low <= high, op, "low (", low, ") must not exceed high (", high, ")");
  return random_tensor(backend::RandomKind::uniform, shape, dt, opts.device, gen, op, low, high);
}
}  // namespace

Tensor Tensor::rand(const Shape& shape, TensorOptions opts, Generator* gen) {
  return uniform_tensor(shape, 0.0, 1.0, opts, gen, "rand");
}
Tensor Tensor::rand(const Shape& shape, double low, double high, TensorOptions opts, Generator* gen) {
  return uniform_tensor(shape, low, high, opts, gen, "rand");
}

Tensor Tensor::uniform(const Shape& shape, double low, double high, TensorOptions opts, Generator* gen) {
  return uniform_tensor(shape, low, high, opts, gen, "uniform");
}

Tensor Tensor::randn(const Shape& shape, double mean, double std, TensorOptions opts, Generator* gen) {
  const DType dt = opts.dtype_or(DType::f32);
  FLAME_CHECK(is_floating(dt), "randn", "expected a floating dtype, got ", dtype_name(dt));
  FLAME_CHECK(!std::isnan(std), "randn", "std is NaN; it must be a non-negative number");
  FLAME_CHECK(!std::isnan(mean), "randn", "mean is NaN; it must be a number");
  FLAME_CHECK(std >= 0, "randn", "std must be non-negative, got ", std);
  return random_tensor(backend::RandomKind::normal, shape, dt, opts.device, gen, "randn", mean, std);
}

Tensor Tensor::randint(int64_t low, int64_t high, const Shape& shape, TensorOptions opts, Generator* gen) {
  FLAME_CHECK(high > low, "randint", "empty range [", low, ", ", high, ")");
  const DType dt = opts.dtype_or(DType::i64);
  FLAME_CHECK(!is_bool(dt), "randint", "bool dtype is not supported");
  // The backends take the bounds as doubles: they must survive the round trip exactly, or two
  // distinct bounds could meet (a range of 0) and samples could leave [low, high).
  constexpr int64_t kExact = int64_t(1) << 53;
  FLAME_CHECK(low >= -kExact && high <= kExact, "randint", "bounds [", low, ", ", high,
              ") must lie within [-2^53, 2^53]");
  if (!is_floating(dt)) {  // as PyTorch: every value of [low, high) must fit the dtype
    int64_t lo = 0, hi = 0;
    switch (dt) {
      case DType::u8: lo = 0, hi = 255; break;
      case DType::i32: lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max(); break;
      default: lo = -kExact, hi = kExact; break;
    }
    FLAME_CHECK(low >= lo && high - 1 <= hi, "randint", "range [", low, ", ", high, ") does not fit dtype ",
                dtype_name(dt), " ([", lo, ", ", hi, "])");
  }
  return random_tensor(backend::RandomKind::integer, shape, dt, opts.device, gen, "randint",
                       static_cast<double>(low), static_cast<double>(high));
}

Tensor Tensor::bernoulli(const Shape& shape, double p, TensorOptions opts, Generator* gen) {
  FLAME_CHECK(p >= 0.0 && p <= 1.0, "bernoulli", "p must be in [0, 1], got ", p);
  Tensor u = rand(shape, opts.device, gen);
  return u.lt(Tensor::scalar(p, {DType::f32, opts.device})).to(opts.dtype_or(DType::f32));
}

Tensor Tensor::randperm(int64_t n, TensorOptions opts, Generator* gen) {
  FLAME_CHECK(n >= 0, "randperm", "n must be non-negative, got ", n);
  const DType dt = opts.dtype_or(DType::i64);
  FLAME_CHECK(!is_bool(dt), "randperm", "bool dtype is not supported: use an integer or floating dtype");
  // Every value 0..n-1 must be exact in the dtype (as PyTorch's check).
  int64_t max_exact = 0;
  switch (dt) {
    case DType::u8: max_exact = 255; break;
    case DType::i32: max_exact = std::numeric_limits<int32_t>::max(); break;
    case DType::i64: max_exact = std::numeric_limits<int64_t>::max(); break;
    case DType::f16: max_exact = int64_t{1} << 11; break;
    case DType::bf16: max_exact = int64_t{1} << 8; break;
    case DType::f32: max_exact = int64_t{1} << 24; break;
    default: max_exact = int64_t{1} << 53; break;
  }
  FLAME_CHECK(n == 0 || n - 1 <= max_exact, "randperm", "n = ", n, " does not fit dtype ", dtype_name(dt),
              ": its values 0..n-1 must be exact (at most ", max_exact, "); use i64");
  // Drawn on the host: a device copy of host values cannot be captured into a CUDA graph.
  FLAME_CHECK(!(opts.device.is_cuda() && random_detail::current_graph_rng() != nullptr), "randperm",
              "draws its permutation on the host and cannot run inside CUDA graph capture; draw it before capture");
  Generator& g = gen ? *gen : default_generator();
  const uint64_t seed = g.seed(), offset = g.next_offset();
  std::vector<int64_t> perm(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[static_cast<std::size_t>(i)] = i;
  HostRng rng(HostRng::mix(seed, offset));
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(perm[static_cast<std::size_t>(i)], perm[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  Tensor t = Tensor::from_vec(perm, {n});
  if (dt != DType::i64) t = t.to(dt);
  return t.to(opts.device);
}

Tensor randperm(int64_t n, TensorOptions opts, Generator* gen) { return Tensor::randperm(n, opts, gen); }

Tensor bernoulli(const Tensor& p, Generator* gen) {
  FLAME_CHECK(p.defined() && is_floating(p.dtype()), "bernoulli", "p must be a floating tensor");
  Tensor u = Tensor::rand(p.sizes(), {p.dtype() == DType::f64 ? DType::f64 : DType::f32, p.device()}, gen);
  return u.lt(p).to(p.dtype());
}

Tensor empty_like(const Tensor& t, std::optional<DType> dtype) {
  return Tensor::empty(t.sizes(), {dtype.value_or(t.dtype()), t.device()});
}
Tensor zeros_like(const Tensor& t, std::optional<DType> dtype) {
  return Tensor::zeros(t.sizes(), {dtype.value_or(t.dtype()), t.device()});
}
Tensor ones_like(const Tensor& t, std::optional<DType> dtype) {
  return Tensor::ones(t.sizes(), {dtype.value_or(t.dtype()), t.device()});
}
Tensor full_like(const Tensor& t, Scalar value, std::optional<DType> dtype) {
  return Tensor::full(t.sizes(), value, {dtype.value_or(t.dtype()), t.device()});
}
Tensor rand_like(const Tensor& t, Generator* gen) { return Tensor::rand(t.sizes(), {t.dtype(), t.device()}, gen); }
Tensor randn_like(const Tensor& t, Generator* gen) {
  return Tensor::randn(t.sizes(), 0.0, 1.0, {t.dtype(), t.device()}, gen);
}
Tensor randint_like(const Tensor& t, int64_t low, int64_t high, Generator* gen) {
  return Tensor::randint(low, high, t.sizes(), {t.dtype(), t.device()}, gen);
}

}  // namespace flame
