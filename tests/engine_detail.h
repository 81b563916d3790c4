#pragma once
// The engine's internal switches and counters that tests read (declared in src/autograd/record.h,
// which tests do not include; libflame exports them): one copy of the declarations, kept equal to
// record.h's, for the tests that compare a fused gradient path with the unfused one and prove
// which one ran.
#include <cstdint>

#include "flame/tensor.h"

namespace flame::autograd_detail {
// Note [Accumulate base] (backward.cpp).
bool set_accumulate_base_enabled(bool on);
struct AccumulateBaseCounts {
  uint64_t handed = 0, owned = 0;
};
AccumulateBaseCounts accumulate_base_counts();
// Note [Prepared gradients] (backward.cpp).
struct PreparedCounts {
  uint64_t prepared = 0, taken = 0;
};
PreparedCounts prepared_counts();
// Note [Gradient row sums] (node.cpp).
void attach_row_sums(const Tensor& grad, Tensor sums);
Tensor take_row_sums(const Tensor& grad);
struct RowSumCounts {
  uint64_t attached = 0, taken = 0;
};
RowSumCounts row_sum_counts();
}  // namespace flame::autograd_detail
