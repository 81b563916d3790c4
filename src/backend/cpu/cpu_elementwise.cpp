// CPU reference: copies, fills, elementwise unary/binary/where, random numbers. Copies, fills,
// unary, binary and where run over the CPU pool above kParallelGrain elements (Note [CPU threads]).
// The unary and binary kernels themselves are compiled in parts (cpu_elementwise_parts.h).
#include <algorithm>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_elementwise_parts.h"
#include "src/random/philox.h"

namespace flame::backend::cpu {

namespace {

template <class Dst, class Src>
void copy_typed(const Tensor& dst, const Tensor& src) {
  if (dst.is_contiguous() && src.is_contiguous() && src.numel() == dst.numel()) {
    auto* d = static_cast<Dst*>(dst.data_ptr());
    const auto* s = static_cast<const Src*>(src.data_ptr());
    parallel_for(dst.numel(), kParallelGrain, [&](int64_t i0, int64_t i1) {
      if constexpr (std::is_same_v<Dst, Src>) {
        std::memcpy(d + i0, s + i0, static_cast<std::size_t>(i1 - i0) * sizeof(Dst));
      } else {
        for (int64_t i = i0; i < i1; ++i) d[i] = convert<Dst>(s[i]);
      }
    });
    return;
  }
  parallel_for_each_element<2>(dst.sizes(), {bytes(dst), bytes(src)}, {&dst.strides(), &src.strides()},
                      {sizeof(Dst), sizeof(Src)}, [](std::array<char*, 2> p) {
                        *reinterpret_cast<Dst*>(p[0]) = convert<Dst>(*reinterpret_cast<const Src*>(p[1]));
                      });
}

}  // namespace

void CpuBackend::copy(const Tensor& dst, const Tensor& src) {
  dispatch_storage_dtype(dst.dtype(), "copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_storage_dtype(src.dtype(), "copy",
                           [&](auto stag) { copy_typed<D, typename decltype(stag)::type>(dst, src); });
  });
}

void CpuBackend::copy_from_host(const Tensor& dst, const void* host) { std::memcpy(dst.data_ptr(), host, dst.nbytes()); }
void CpuBackend::copy_to_host(void* host, const Tensor& src) { std::memcpy(host, src.data_ptr(), src.nbytes()); }

void CpuBackend::fill(const Tensor& dst, Scalar value) {
  dispatch_storage_dtype(dst.dtype(), "fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T v;
    if constexpr (std::is_integral_v<T>) {
      v = convert<T>(value.to_int());
    } else {
      v = convert<T>(value.to_double());
    }
    if (dst.is_contiguous()) {
      T* d = static_cast<T*>(dst.data_ptr());
      parallel_for(dst.numel(), kParallelGrain, [&](int64_t i0, int64_t i1) { std::fill(d + i0, d + i1, v); });
      return;
    }
    parallel_for_each_element<1>(dst.sizes(), {bytes(dst)}, {&dst.strides()}, {sizeof(T)},
                                 [&](std::array<char*, 1> p) { *reinterpret_cast<T*>(p[0]) = v; });
  });
}

void CpuBackend::iota(const Tensor& dst, double start, double step) {
  dispatch_dtype(dst.dtype(), "iota", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto* d = static_cast<T*>(dst.data_ptr());
    for (int64_t i = 0, n = dst.numel(); i < n; ++i) d[i] = convert<T>(start + static_cast<double>(i) * step);
  });
}

// Note [Elementwise parts]: the ops' kernels are compiled in parts (cpu_elementwise_parts.h).
void CpuBackend::unary(UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) {
  static_assert(ew::kUnaryParts == 4 && ew::kBinaryParts == 2, "route every part below");
  switch (ew::unary_part_of(op)) {
    case 0: return ew::unary_part<0>(op, dst, src, p);
    case 1: return ew::unary_part<1>(op, dst, src, p);
    case 2: return ew::unary_part<2>(op, dst, src, p);
    default: return ew::unary_part<3>(op, dst, src, p);
  }
}

void CpuBackend::binary(BinaryOp op, const Tensor& dst, const Tensor& a, const Tensor& b) {
  if (ew::binary_part_of(op) == 0) return ew::binary_part<0>(op, dst, a, b);
  return ew::binary_part<1>(op, dst, a, b);
}

void CpuBackend::where(const Tensor& dst, const Tensor& cond, const Tensor& a, const Tensor& b) {
  dispatch_dtype(dst.dtype(), "where", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_for_each_element<4>(dst.sizes(), {bytes(dst), bytes(cond), bytes(a), bytes(b)},
                        {&dst.strides(), &cond.strides(), &a.strides(), &b.strides()},
                        {sizeof(T), 1, sizeof(T), sizeof(T)}, [](std::array<char*, 4> p) {
                          *reinterpret_cast<T*>(p[0]) = *reinterpret_cast<const bool*>(p[1])
                                                            ? *reinterpret_cast<const T*>(p[2])
                                                            : *reinterpret_cast<const T*>(p[3]);
                        });
  });
}

void CpuBackend::random(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset, double a, double b) {
  dispatch_dtype(dst.dtype(), "random", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
    auto* d = static_cast<T*>(dst.data_ptr());
    const int64_t n = dst.numel();
    for (int64_t i = 0; i < n; ++i) {
      const philox::Words w = philox::generate(seed, static_cast<uint64_t>(i), offset);
      if (kind == RandomKind::integer) {
        d[i] = convert<T>(philox::integer(w, static_cast<int64_t>(a), static_cast<int64_t>(b)));
      } else if (kind == RandomKind::uniform) {
        d[i] = convert<T>(static_cast<C>(a) + philox::uniform01<C>(w) * static_cast<C>(b - a));
      } else {
        d[i] = convert<T>(static_cast<C>(a) + static_cast<C>(b) * philox::normal<C>(w));
      }
    }
  });
}

}  // namespace flame::backend::cpu
