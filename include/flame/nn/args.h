#pragma once
// Argument helpers shared by the layer constructors and the functional ops:
//  - Ints: an argument that PyTorch takes as "an int or a tuple" (kernel_size, stride, dilation,
//    normalized_shape): `3`, `{3, 1}` or a Shape all bind to it;
//  - FLAME_NN_ARGS_CHECK: a readable compile error for a layer constructed with arguments that
//    match none of its constructors, instead of a page of errors from inside std::make_shared.
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

#include "flame/tensor.h"

namespace flame::nn {

// One value for every spatial dim (`3`), or one per dim (`{3, 1}`, a Shape). An empty list is
// what a caller gave as `{}`; the op decides what that means (most reject it).
struct Ints {
  Shape values;
  Ints() = default;
  Ints(std::initializer_list<int64_t> v) : values(v) {}  // NOLINT: {3, 1} as torch's tuple
  Ints(const Shape& v) : values(v) {}                     // NOLINT
  Ints(Shape&& v) : values(std::move(v)) {}               // NOLINT
  template <DimIndex I>
  Ints(I v) : values{static_cast<int64_t>(v)} {}  // NOLINT: 3 as torch's int
  operator const Shape&() const { return values; }  // NOLINT: passes on where a Shape is taken
};

namespace detail {

template <class...>
inline constexpr bool always_false = false;

// True when arguments of types Args bind to the first sizeof...(Args) of Params (copy
// initialisation, as a call does) and at least `required` were given.
template <std::size_t required, class Params, class... Args>
struct args_bind : std::false_type {};
template <std::size_t required, class... Params, class... Args>
  requires(sizeof...(Args) >= required && sizeof...(Args) <= sizeof...(Params))
struct args_bind<required, std::tuple<Params...>, Args...> {
  template <std::size_t... I>
  static constexpr bool check(std::index_sequence<I...>) {
    return (std::is_convertible_v<Args, std::tuple_element_t<I, std::tuple<Params...>>> && ...);
  }
  static constexpr bool value = check(std::index_sequence_for<Args...>{});
};

}  // namespace detail
}  // namespace flame::nn

// Inside a layer class: a constructor template that takes part only when the arguments do not fit
// the layer's constructor (parameter types listed, the first `required` of them without a
// default), and then fails with `signature` in the message. The layer's own constructor and this
// template list the same parameters. Example, in class Linear:
//   FLAME_NN_ARGS_CHECK(Linear, "nn::Linear(in_features, out_features, bias = true, opts = {})", 2,
//                       int64_t, int64_t, bool, TensorOptions)
#define FLAME_NN_ARGS_CHECK(Name, signature, required, ...)                                              \
  template <class... Args>                                                                              \
    requires(!::flame::nn::detail::args_bind<required, std::tuple<__VA_ARGS__>, Args&&...>::value)      \
  explicit Name(Args&&...) {                                                                            \
    static_assert(::flame::nn::detail::always_false<Args...>,                                           \
                  "these arguments match no constructor of " signature);                                \
  }
