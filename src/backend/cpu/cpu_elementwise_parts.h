#pragma once
// The CPU elementwise kernels of every unary and binary op (the rows of flame/op_table.h), compiled
// in parts.
//
// Note [Elementwise parts]
// Each op's kernel is instantiated for every dtype, for a bool or same-dtype result, contiguous and
// strided: one translation unit holding all of them took three minutes to compile, the longest of
// the whole build (and alone on its critical path on a many-core machine). The ops are dealt into
// kUnaryParts / kBinaryParts parts by their index in the op table; part K is instantiated only in
// cpu_unary_part<K>.cpp / cpu_binary_part<K>.cpp, and CpuBackend::unary / binary
// (cpu_elementwise.cpp) route an op to its part. A new row of the op table lands in some part with
// no other change.
#include <array>
#include <cstring>

#include "src/backend/cpu/cpu_backend.h"

namespace flame::backend::cpu::ew {

inline constexpr int kUnaryParts = 4;
inline constexpr int kBinaryParts = 2;
constexpr int unary_part_of(UnaryOp op) { return static_cast<int>(op) % kUnaryParts; }
constexpr int binary_part_of(BinaryOp op) { return static_cast<int>(op) % kBinaryParts; }

template <class F, class T, class O>
void unary_typed(const Tensor& dst, const Tensor& src, const UnaryParams& prm) {
  using C = compute_t<T>;
  const F f{};
  if (dst.is_contiguous() && src.is_contiguous()) {
    auto* d = static_cast<O*>(dst.data_ptr());
    const auto* s = static_cast<const T*>(src.data_ptr());
    parallel_for(dst.numel(), kParallelGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) d[i] = convert<O>(f(convert<C>(s[i]), prm));
    });
    return;
  }
  parallel_for_each_element<2>(dst.sizes(), {bytes(dst), bytes(src)}, {&dst.strides(), &src.strides()},
                      {sizeof(O), sizeof(T)}, [&](std::array<char*, 2> p) {
                        *reinterpret_cast<O*>(p[0]) =
                            convert<O>(f(convert<C>(*reinterpret_cast<const T*>(p[1])), prm));
                      });
}

template <class F>
void unary_dispatch(const Tensor& dst, const Tensor& src, const UnaryParams& p) {
  dispatch_dtype(src.dtype(), "unary", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (dst.dtype() == DType::boolean) {
      unary_typed<F, T, bool>(dst, src, p);
    } else {
      unary_typed<F, T, T>(dst, src, p);
    }
  });
}

template <class F, class T, class O>
void binary_typed(const Tensor& dst, const Tensor& a, const Tensor& b) {
  using C = compute_t<T>;
  const F f{};
  if (dst.is_contiguous() && a.is_contiguous() && b.is_contiguous()) {
    auto* d = static_cast<O*>(dst.data_ptr());
    const auto* x = static_cast<const T*>(a.data_ptr());
    const auto* y = static_cast<const T*>(b.data_ptr());
    parallel_for(dst.numel(), kParallelGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) d[i] = convert<O>(f(convert<C>(x[i]), convert<C>(y[i])));
    });
    return;
  }
  parallel_for_each_element<3>(dst.sizes(), {bytes(dst), bytes(a), bytes(b)},
                      {&dst.strides(), &a.strides(), &b.strides()}, {sizeof(O), sizeof(T), sizeof(T)},
                      [&](std::array<char*, 3> p) {
                        *reinterpret_cast<O*>(p[0]) = convert<O>(f(convert<C>(*reinterpret_cast<const T*>(p[1])),
                                                                   convert<C>(*reinterpret_cast<const T*>(p[2]))));
                      });
}

template <class F>
void binary_dispatch(const Tensor& dst, const Tensor& a, const Tensor& b) {
  dispatch_dtype(a.dtype(), "binary", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (dst.dtype() == DType::boolean) {
      binary_typed<F, T, bool>(dst, a, b);
    } else {
      binary_typed<F, T, T>(dst, a, b);
    }
  });
}

// The ops of part Part (unary_part_of(op) == Part); another op raises (a routing error).
template <int Part>
void unary_part(UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) {
  switch (op) {
#define FLAME_CASE(name, Functor, kind, ...)                                \
  case UnaryOp::name:                                                        \
    if constexpr (unary_part_of(UnaryOp::name) == Part) {                    \
      unary_dispatch<fn::Functor>(dst, src, p);                              \
      return;                                                                \
    }                                                                        \
    break;
    FLAME_UNARY_OPS(FLAME_CASE)
#undef FLAME_CASE
  }
  FLAME_CHECK(false, "unary", "internal: op ", static_cast<int>(op), " is not in part ", Part);
}

template <int Part>
void binary_part(BinaryOp op, const Tensor& dst, const Tensor& a, const Tensor& b) {
  switch (op) {
#define FLAME_CASE(name, Functor, kind, ...)                                \
  case BinaryOp::name:                                                       \
    if constexpr (binary_part_of(BinaryOp::name) == Part) {                  \
      binary_dispatch<fn::Functor>(dst, a, b);                               \
      return;                                                                \
    }                                                                        \
    break;
    FLAME_BINARY_OPS(FLAME_CASE)
#undef FLAME_CASE
  }
  FLAME_CHECK(false, "binary", "internal: op ", static_cast<int>(op), " is not in part ", Part);
}

// Each part is instantiated in its own translation unit only.
extern template void unary_part<0>(UnaryOp, const Tensor&, const Tensor&, const UnaryParams&);
extern template void unary_part<1>(UnaryOp, const Tensor&, const Tensor&, const UnaryParams&);
extern template void unary_part<2>(UnaryOp, const Tensor&, const Tensor&, const UnaryParams&);
extern template void unary_part<3>(UnaryOp, const Tensor&, const Tensor&, const UnaryParams&);
extern template void binary_part<0>(BinaryOp, const Tensor&, const Tensor&, const Tensor&);
extern template void binary_part<1>(BinaryOp, const Tensor&, const Tensor&, const Tensor&);

}  // namespace flame::backend::cpu::ew
