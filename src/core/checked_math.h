#pragma once
// Note [Checked size arithmetic]
// Every product or sum that makes a shape's element count, a stride, a byte size or a view's
// extent goes through these helpers, so an argument that would overflow int64 becomes a
// flame::Error naming the op instead of a wrapped (tiny, negative or bogus) size. Host code only:
// kernels index with sizes that were checked here before launch.
//
// A tensor's bytes must also fit kMaxTensorBytes (2^62): far above any real allocation, and low
// enough that the allocators' rounding (to 64 bytes, to a power-of-two block size) cannot wrap,
// and that element offset x element size (at most 8 bytes) stays inside int64 for every element
// of a valid tensor.
#include <cstdint>
#include <optional>

#include "flame/error.h"

namespace flame {

inline constexpr int64_t kMaxTensorBytes = int64_t(1) << 62;

// a + b / a * b, or nullopt when the result does not fit int64.
inline std::optional<int64_t> add_overflows(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}
inline std::optional<int64_t> mul_overflows(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a + b, a - b, a * b; raise "op: <what> overflows int64 (a <op> b)" when the result does not fit.
inline int64_t checked_add(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) FLAME_FAIL(op, what, " overflows int64 (", a, " + ", b, ")");
  return r;
}
inline int64_t checked_sub(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) FLAME_FAIL(op, what, " overflows int64 (", a, " - ", b, ")");
  return r;
}
inline int64_t checked_mul(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) FLAME_FAIL(op, what, " overflows int64 (", a, " * ", b, ")");
  return r;
}

// Number of pieces of size `piece` (> 0) that cover n >= 0 elements: ceil(n / piece), without
// the n + piece - 1 that overflows for a huge piece.
inline int64_t ceil_div(int64_t n, int64_t piece) { return n == 0 ? 0 : (n - 1) / piece + 1; }

}  // namespace flame
