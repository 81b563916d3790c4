// CPU reference: reductions (sum, mean, prod, max, min, argmax, argmin, any, all), cumsum and
// fused softmax / log_softmax.
//
// Note [CPU reduction accumulation]
// Floating inputs (half types included) accumulate in double, integers and bool in int64; the
// result is converted to dst's dtype once, at the end. So a bf16 mean is one rounding of the exact
// double mean, not a rounded sum divided afterwards. Integer sums and products wrap on overflow
// (computed in uint64 to keep that defined). max/min propagate NaN; argmax/argmin return the first
// NaN, else the first occurrence of the extreme value.
#include <cmath>
#include <type_traits>

#include "src/backend/cpu/cpu_backend.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {
namespace {

template <class T>
using acc_t = std::conditional_t<std::is_integral_v<T>, int64_t, double>;

template <class A>
bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return std::isnan(v);
  else return false;
}

// Writes v, converted, into one element of dtype dt (once per output element, so a switch is fine).
template <class V>
void store(DType dt, char* p, V v) {
  dispatch_dtype(dt, "reduce", [&](auto tag) {
    using D = typename decltype(tag)::type;
    *reinterpret_cast<D*>(p) = convert<D>(v);
  });
}

int64_t wrapping_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
int64_t wrapping_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

// Reduces the elements reached from `base` over (shape, strides) into one value and stores it.
template <ReduceOp Op, class T>
void reduce_one(char* out, DType out_dtype, char* base, const Shape& shape, const Shape& strides) {
  using A = acc_t<T>;
  int64_t n = 0;  // elements seen, in row-major order of the reduced dims
  A acc{};
  int64_t best = 0;
  bool flag = Op == ReduceOp::all;
  if constexpr (Op == ReduceOp::prod) acc = A(1);
  for_each_element<1>(shape, {base}, {&strides}, {sizeof(T)}, [&](std::array<char*, 1> p) {
    const A v = convert<A>(*reinterpret_cast<const T*>(p[0]));
    if constexpr (Op == ReduceOp::sum || Op == ReduceOp::mean) {
      if constexpr (std::is_integral_v<A>) acc = wrapping_add(acc, v);
      else acc += v;
    } else if constexpr (Op == ReduceOp::prod) {
      if constexpr (std::is_integral_v<A>) acc = wrapping_mul(acc, v);
      else acc *= v;
    } else if constexpr (Op == ReduceOp::max || Op == ReduceOp::argmax) {
      if (n == 0 || (!is_nan(acc) && (is_nan(v) || v > acc))) {
        acc = v;
        best = n;
      }
    } else if constexpr (Op == ReduceOp::min || Op == ReduceOp::argmin) {
      if (n == 0 || (!is_nan(acc) && (is_nan(v) || v < acc))) {
        acc = v;
        best = n;
      }
    } else if constexpr (Op == ReduceOp::any) {
      flag = flag || v != A(0);
    } else if constexpr (Op == ReduceOp::all) {
      flag = flag && v != A(0);
    }
    ++n;
  });
  if constexpr (Op == ReduceOp::mean) {
    store(out_dtype, out, static_cast<double>(acc) / static_cast<double>(n));  // n = 0 gives nan
  } else if constexpr (Op == ReduceOp::argmax || Op == ReduceOp::argmin) {
    store(out_dtype, out, best);
  } else if constexpr (Op == ReduceOp::any || Op == ReduceOp::all) {
    store(out_dtype, out, flag);
  } else {
    store(out_dtype, out, acc);
  }
}

template <ReduceOp Op>
void reduce_typed(const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  const int64_t keep = src.dim() - reduce_ndim;
  const Shape outer_strides(src.strides().begin(), src.strides().begin() + keep);
  const Shape inner_shape(src.sizes().begin() + keep, src.sizes().end());
  const Shape inner_strides(src.strides().begin() + keep, src.strides().end());
  const DType out_dtype = dst.dtype();
  dispatch_dtype(src.dtype(), "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_each_element<2>(dst.sizes(), {bytes(dst), bytes(src)}, {&dst.strides(), &outer_strides},
                        {dst.element_size(), sizeof(T)}, [&](std::array<char*, 2> p) {
                          reduce_one<Op, T>(p[0], out_dtype, p[1], inner_shape, inner_strides);
                        });
  });
}

template <class T, class O>
void cumsum_typed(const Tensor& dst, const Tensor& src, int64_t dim) {
  using A = acc_t<T>;
  Shape rows = src.sizes();
  const int64_t len = rows[dim];
  rows[dim] = 1;
  const int64_t ds = dst.strides()[dim] * static_cast<int64_t>(sizeof(O));
  const int64_t ss = src.strides()[dim] * static_cast<int64_t>(sizeof(T));
  for_each_element<2>(rows, {bytes(dst), bytes(src)}, {&dst.strides(), &src.strides()}, {sizeof(O), sizeof(T)},
                      [&](std::array<char*, 2> p) {
                        A acc{};
                        for (int64_t i = 0; i < len; ++i) {
                          const A v = convert<A>(*reinterpret_cast<const T*>(p[1] + i * ss));
                          if constexpr (std::is_integral_v<A>) acc = wrapping_add(acc, v);
                          else acc += v;
                          *reinterpret_cast<O*>(p[0] + i * ds) = convert<O>(acc);
                        }
                      });
}

// One pass for the row max, one for the sum of exponentials, one to write (all in double).
template <class T>
void softmax_typed(const Tensor& dst, const Tensor& src, int64_t dim, bool log) {
  Shape rows = src.sizes();
  const int64_t len = rows[dim];
  rows[dim] = 1;
  const int64_t ds = dst.strides()[dim] * static_cast<int64_t>(sizeof(T));
  const int64_t ss = src.strides()[dim] * static_cast<int64_t>(sizeof(T));
  for_each_element<2>(rows, {bytes(dst), bytes(src)}, {&dst.strides(), &src.strides()}, {sizeof(T), sizeof(T)},
                      [&](std::array<char*, 2> p) {
                        auto x = [&](int64_t i) { return convert<double>(*reinterpret_cast<const T*>(p[1] + i * ss)); };
                        double m = -INFINITY;
                        for (int64_t i = 0; i < len; ++i) m = std::isnan(x(i)) || x(i) > m ? x(i) : m;
                        double s = 0.0;
                        for (int64_t i = 0; i < len; ++i) s += std::exp(x(i) - m);
                        const double log_s = std::log(s);
                        for (int64_t i = 0; i < len; ++i) {
                          const double y = log ? x(i) - m - log_s : std::exp(x(i) - m) / s;
                          *reinterpret_cast<T*>(p[0] + i * ds) = convert<T>(y);
                        }
                      });
}

}  // namespace

// Contract (Note [Backend seam]): src's last reduce_ndim dims are reduced (any dtype, any strides);
// dst is contiguous with src's leading dims. dst's dtype is the op layer's choice (sum/prod of
// integers: i64; mean: floating; argmax/argmin: i64; any/all: bool); the result is converted to it.
// A reduced extent of zero elements gives the identity (sum 0, prod 1, any false, all true, mean nan);
// max/min/argmax/argmin over it are rejected by the op layer.
void CpuBackend::reduce(ReduceOp op, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  FLAME_CHECK(reduce_ndim >= 0 && reduce_ndim <= src.dim(), "reduce", "reduce_ndim ", reduce_ndim,
              " out of range for a source of shape ", src.sizes());
  switch (op) {
    case ReduceOp::sum: return reduce_typed<ReduceOp::sum>(dst, src, reduce_ndim);
    case ReduceOp::mean: return reduce_typed<ReduceOp::mean>(dst, src, reduce_ndim);
    case ReduceOp::prod: return reduce_typed<ReduceOp::prod>(dst, src, reduce_ndim);
    case ReduceOp::max: return reduce_typed<ReduceOp::max>(dst, src, reduce_ndim);
    case ReduceOp::min: return reduce_typed<ReduceOp::min>(dst, src, reduce_ndim);
    case ReduceOp::argmax: return reduce_typed<ReduceOp::argmax>(dst, src, reduce_ndim);
    case ReduceOp::argmin: return reduce_typed<ReduceOp::argmin>(dst, src, reduce_ndim);
    case ReduceOp::any: return reduce_typed<ReduceOp::any>(dst, src, reduce_ndim);
    case ReduceOp::all: return reduce_typed<ReduceOp::all>(dst, src, reduce_ndim);
  }
}

// dst (contiguous, src's shape, src's dtype or i64 for integer/bool sources) = running sum along dim.
void CpuBackend::cumsum(const Tensor& dst, const Tensor& src, int64_t dim) {
  dispatch_dtype(src.dtype(), "cumsum", [&](auto stag) {
    using T = typename decltype(stag)::type;
    dispatch_dtype(dst.dtype(), "cumsum", [&](auto dtag) { cumsum_typed<T, typename decltype(dtag)::type>(dst, src, dim); });
  });
}

// dst (contiguous, src's shape and floating dtype) = softmax or log_softmax of src along dim.
void CpuBackend::softmax(const Tensor& dst, const Tensor& src, int64_t dim, bool log) {
  dispatch_floating(src.dtype(), log ? "log_softmax" : "softmax",
                    [&](auto tag) { softmax_typed<typename decltype(tag)::type>(dst, src, dim, log); });
}

}  // namespace flame::backend::cpu
