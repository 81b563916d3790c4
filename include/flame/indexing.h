#pragma once
// Index lists for Tensor::index and Tensor::index_put_, spelled as libtorch's torch::indexing:
//
//   using namespace flame::indexing;
//   x.index({0, Slice(1, None), None, Ellipsis, idx});   // Python: x[0, 1:, None, ..., idx]
//   x.index_put_({mask}, 0.0);                            // x[mask] = 0
//
// An entry is an integer (selects, removing the dim), a Slice(start, stop, step) (None ends,
// negative values count from the end, out-of-range ends clamp, step > 0), None (a new dim of size
// 1), Ellipsis or "..." (as many full dims as the other entries leave), true/false (a new dim of
// size 1 or 0), or a tensor: bool (a mask over as many dims as it has, which must match them) or
// i64/i32 (advanced indexing). docs/api.md, "Indexing", states the rules.
#include <cstdint>
#include <cstring>
#include <optional>

#include "flame/tensor.h"

namespace flame::indexing {

struct EllipsisIndexType {
  explicit constexpr EllipsisIndexType() = default;
};
inline constexpr EllipsisIndexType Ellipsis{};
// An absent slice end, or (alone in an index list) a new dim: Python's None.
inline constexpr std::nullopt_t None = std::nullopt;

// Python's start:stop:step. Unset start is 0, unset stop the dim's size, unset step 1.
struct Slice {
  std::optional<int64_t> start, stop, step;
  Slice(std::optional<int64_t> start_ = std::nullopt, std::optional<int64_t> stop_ = std::nullopt,
        std::optional<int64_t> step_ = std::nullopt)
      : start(start_), stop(stop_), step(step_) {}
};

// One entry of an index list (implicit from each spelling above).
class TensorIndex {
 public:
  enum class Kind : uint8_t { integer, slice, none, ellipsis, boolean, tensor };

  TensorIndex(std::nullopt_t) : kind_(Kind::none) {}              // NOLINT
  TensorIndex(EllipsisIndexType) : kind_(Kind::ellipsis) {}       // NOLINT
  TensorIndex(const char* s) : kind_(Kind::ellipsis) {            // NOLINT: "..." only
    FLAME_CHECK(s != nullptr && std::strcmp(s, "...") == 0, "index",
                "a string index must be \"...\" (Ellipsis), got \"", s ? s : "(null)", "\"");
  }
  template <DimIndex I>
  TensorIndex(I i) : kind_(Kind::integer), integer_(static_cast<int64_t>(i)) {}  // NOLINT
  TensorIndex(bool b) : kind_(Kind::boolean), boolean_(b) {}      // NOLINT
  TensorIndex(Slice s) : kind_(Kind::slice), slice_(s) {}         // NOLINT
  TensorIndex(Tensor t) : kind_(Kind::tensor), tensor_(std::move(t)) {}  // NOLINT

  Kind kind() const { return kind_; }
  int64_t integer() const { return integer_; }
  bool boolean() const { return boolean_; }
  const Slice& slice() const { return slice_; }
  const Tensor& tensor() const { return tensor_; }

 private:
  Kind kind_;
  int64_t integer_ = 0;
  bool boolean_ = false;
  Slice slice_;
  Tensor tensor_;
};

}  // namespace flame::indexing
