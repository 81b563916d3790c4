#pragma once
// Host-side launch geometry shared by the CUDA kernel families: offset maps over collapsed dims,
// grid sizes, the multiprocessor count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "src/backend/cuda/common.cuh"

namespace flame::backend::cuda {

// Offset of logical index i in a (collapsed) set of dims: i * stride when they merged into one.
struct OffsetMap {
  bool linear;
  int64_t stride;
  StridedInfo info;
  __device__ __forceinline__ int64_t operator()(int64_t i) const { return linear ? i * stride : info.offset(i); }
};

// Sizes and strides after dropping size-1 dims and merging dims contiguous with each other
// (row-major logical order kept).
struct Dims {
  std::vector<int64_t> sizes, strides;
};
inline Dims collapse(const int64_t* sizes, const int64_t* strides, int64_t n) {
  Dims out;
  for (int64_t d = 0; d < n; ++d) {
    if (sizes[d] == 1) continue;
    if (!out.sizes.empty() && out.strides.back() == strides[d] * sizes[d]) {
      out.sizes.back() *= sizes[d];
      out.strides.back() = strides[d];
    } else {
      out.sizes.push_back(sizes[d]);
      out.strides.push_back(strides[d]);
    }
  }
  return out;
}

inline OffsetMap make_offset_map(const Dims& d) {
  FLAME_CHECK(d.sizes.size() <= static_cast<std::size_t>(kMaxDims), "cuda", "tensors with more than ", kMaxDims,
              " dims are not supported");
  OffsetMap m{};
  m.linear = d.sizes.size() <= 1;
  m.stride = d.sizes.empty() ? 0 : d.strides[0];
  m.info.ndim = static_cast<int>(d.sizes.size());
  for (std::size_t i = 0; i < d.sizes.size(); ++i) {
    m.info.sizes[i] = d.sizes[i];
    m.info.strides[i] = d.strides[i];
  }
  return m;
}

// Lines along `dim`: the map of the other dims (dim removed).
inline OffsetMap line_map(const Tensor& t, int64_t dim) {
  std::vector<int64_t> s, st;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d == dim) continue;
    s.push_back(t.sizes()[d]);
    st.push_back(t.strides()[d]);
  }
  return make_offset_map(collapse(s.data(), st.data(), static_cast<int64_t>(s.size())));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Blocks for `units` work units of `per_block` each, at least 1, at most `cap` (grid-stride
// kernels cover the rest).
inline unsigned int grid_for(int64_t units, int64_t per_block, int64_t cap = 1 << 20) {
  return static_cast<unsigned int>(std::clamp<int64_t>(ceil_div(units, per_block), 1, cap));
}

}  // namespace flame::backend::cuda
