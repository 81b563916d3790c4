#pragma once
#include <cstdint>
#include <type_traits>

#include "flame/half.h"

namespace flame {

// A number passed to an op (fill value, scalar operand). It remembers whether it was a bool, an
// integer or a floating value, which matters for type promotion (int tensor * 2.5 -> f32).
class Scalar {
 public:
  enum class Kind : uint8_t { boolean, integral, floating };

  Scalar() : kind_(Kind::integral), i_(0) {}
  template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
  Scalar(T v) {  // NOLINT: implicit on purpose, like a literal
    if constexpr (std::is_same_v<T, bool>) {
      kind_ = Kind::boolean;
      i_ = v ? 1 : 0;
    } else if constexpr (std::is_integral_v<T>) {
      kind_ = Kind::integral;
      i_ = static_cast<int64_t>(v);
    } else {
      kind_ = Kind::floating;
      d_ = static_cast<double>(v);
    }
  }

  // The half types are floating scalars of their exact value: Scalar(bfloat16(1.5f)), x * float16(2.f).
  Scalar(bfloat16 v) : kind_(Kind::floating), d_(static_cast<float>(v)) {}  // NOLINT: implicit
  Scalar(float16 v) : kind_(Kind::floating), d_(static_cast<float>(v)) {}   // NOLINT: implicit

  Kind kind() const { return kind_; }
  bool is_floating() const { return kind_ == Kind::floating; }
  bool is_integral() const { return kind_ == Kind::integral; }
  bool is_bool() const { return kind_ == Kind::boolean; }
  double to_double() const { return kind_ == Kind::floating ? d_ : static_cast<double>(i_); }
  int64_t to_int() const { return kind_ == Kind::floating ? static_cast<int64_t>(d_) : i_; }

 private:
  Kind kind_;
  union {
    int64_t i_;
    double d_;
  };
};

}  // namespace flame
