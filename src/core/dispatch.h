#pragma once
// Note [Dtype dispatch]
// dispatch_dtype(t, op, f) calls f(type_tag<T>{}) with T the element type of t. Host and device
// code share it; `op` names the caller in the error for an unsupported dtype.
#include <cstddef>
#include <cstdint>
#include <utility>

#include "flame/dtype.h"
#include "flame/error.h"

namespace flame {

template <class T>
struct type_tag {
  using type = T;
};

// What the error says of an 8-bit float dtype (Note [Float8 dtypes] in flame/dtype.h).
#define FLAME_FLOAT8_HINT(t)                                                                                  \
  (is_float8(t) ? ": 8-bit float tensors are storage (copies, casts, views); cast to f32 or bf16 first" : "")

template <class F>
decltype(auto) dispatch_dtype(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(type_tag<float>{});
    case DType::f64: return f(type_tag<double>{});
    case DType::bf16: return f(type_tag<bfloat16>{});
    case DType::f16: return f(type_tag<float16>{});
    case DType::i32: return f(type_tag<int32_t>{});
    case DType::i64: return f(type_tag<int64_t>{});
    case DType::u8: return f(type_tag<uint8_t>{});
    case DType::boolean: return f(type_tag<bool>{});
    default: break;
  }
  FLAME_FAIL(op, "unsupported dtype ", dtype_name(t), FLAME_FLOAT8_HINT(t));
}

// dispatch_dtype and the 8-bit float storage dtypes: for the kernels that take every dtype (copies
// and casts, fills).
template <class F>
decltype(auto) dispatch_storage_dtype(DType t, const char* op, F&& f) {
  if (t == DType::f8_e4m3fn) return f(type_tag<float8_e4m3fn>{});
  if (t == DType::f8_e5m2) return f(type_tag<float8_e5m2>{});
  return dispatch_dtype(t, op, std::forward<F>(f));
}

template <class F>
decltype(auto) dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(type_tag<float>{});
    case DType::f64: return f(type_tag<double>{});
    case DType::bf16: return f(type_tag<bfloat16>{});
    case DType::f16: return f(type_tag<float16>{});
    default: break;
  }
  FLAME_FAIL(op, "expected a floating dtype, got ", dtype_name(t), FLAME_FLOAT8_HINT(t));
}

// Kernels that move elements bit for bit (gathers, scatters, selections) dispatch on the element
// size only: f(type_tag<uintN_t>{}).
template <class F>
decltype(auto) dispatch_by_size(std::size_t size, const char* op, F&& f) {
  switch (size) {
    case 1: return f(type_tag<uint8_t>{});
    case 2: return f(type_tag<uint16_t>{});
    case 4: return f(type_tag<uint32_t>{});
    case 8: return f(type_tag<uint64_t>{});
    default: break;
  }
  FLAME_FAIL(op, "unsupported element size ", size);
}

}  // namespace flame
