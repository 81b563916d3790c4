#pragma once
// Element types and PyTorch-style type promotion.
//
// Note [Compute types]
// Kernels load each element, convert it to its compute type, do the math and convert back:
// f64 -> double; f32, bf16, f16 -> float; integers and bool -> int64_t. Reductions accumulate in
// the compute type (the CPU reference accumulates floating types in double).
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "flame/float8.h"
#include "flame/half.h"

namespace flame {

// Note [Float8 dtypes]
// f8_e4m3fn and f8_e5m2 (PyTorch's float8_e4m3fn and float8_e5m2; flame/float8.h) are storage
// dtypes: tensors of them are made, copied, viewed, cast (to() and copy_ to or from any dtype, with
// the formats' rounding and saturation), filled, printed and saved, and the scaled casts of
// flame/ops.h (to_float8, from_float8, float8_scale) quantise with per-tensor or per-channel
// scales; the ops that only move elements (cat, index_select, ...) take them too. Arithmetic
// raises, naming the dtype: cast to a wider dtype first (as PyTorch, whose float8 tensors take few
// ops); the ops that make an integer input floating (exp, true division) read their exact values
// in f32 as they do an integer's. They do not promote with other dtypes. kAllDTypes lists the
// dtypes every op takes; kFloat8DTypes these two.
enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, boolean, f8_e4m3fn, f8_e5m2 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                       DType::i32, DType::i64, DType::u8,   DType::boolean};
inline constexpr DType kFloat8DTypes[] = {DType::f8_e4m3fn, DType::f8_e5m2};

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);
std::string to_string(DType t);
// Prints dtype_name(t): std::cout << x.dtype() shows "f32".
inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }
bool is_floating(DType t);  // f32, f64, bf16, f16
bool is_integral(DType t);  // i32, i64, u8 (not bool)
inline bool is_float8(DType t) { return t == DType::f8_e4m3fn || t == DType::f8_e5m2; }  // Note [Float8 dtypes]
inline bool is_bool(DType t) { return t == DType::boolean; }

// Promotion of two tensor dtypes as in PyTorch: bool < integers < floating; u8+i32 -> i32,
// bf16+f16 -> f32, any integer with any float -> that float. An 8-bit float dtype promotes only
// with itself (an error names both otherwise, as PyTorch).
DType promote_types(DType a, DType b);
// The dtype used when an integer or bool tensor must become floating (true division, exp, ...).
inline constexpr DType kDefaultFloat = DType::f32;

// Maps a C++ element type to its dtype.
template <class T>
struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<float16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::boolean; };
template <> struct dtype_of<float8_e4m3fn> { static constexpr DType value = DType::f8_e4m3fn; };
template <> struct dtype_of<float8_e5m2> { static constexpr DType value = DType::f8_e5m2; };
template <class T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace flame
