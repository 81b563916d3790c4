// CPU reference: index_select, gather, scatter, masked_select, sort.
// The op layer hands these kernels i64 contiguous index tensors with >= 1 dim (Note [Index
// tensors] in src/ops/index.cpp). Index values are checked on the host before anything is
// written, so an out-of-range index leaves the destination untouched.
#include <algorithm>
#include <numeric>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {
namespace {

// Every index must lie in [0, size): PyTorch rejects negative indices for these ops.
void check_indices(const Tensor& index, int64_t size, int64_t dim, const char* op) {
  const int64_t* p = index.data<int64_t>();
  for (int64_t i = 0, n = index.numel(); i < n; ++i) {
    FLAME_CHECK(p[i] >= 0 && p[i] < size, op, "index ", p[i], " is out of bounds for dim ", dim,
                " with size ", size);
  }
}

Shape erase_dim(Shape s, int64_t dim) {
  s.erase(s.begin() + dim);
  return s;
}

// dst[p] = src[p with coordinate `dim` replaced by the index read at p]. The index is read
// through `index_strides` (elements): gather passes its own strides, index_select a 1-d index
// broadcast along every dim but `dim`. src is walked with dst's sizes and its stride along `dim`
// zeroed, then offset by index * stride.
template <class T>
void gather_loop(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index,
                 const Shape& index_strides) {
  Shape src_strides = src.strides();
  src_strides[dim] = 0;
  const int64_t step = src.stride(dim) * static_cast<int64_t>(sizeof(T));
  for_each_element<3>(dst.sizes(), {bytes(dst), bytes(index), bytes(src)},
                      {&dst.strides(), &index_strides, &src_strides}, {sizeof(T), sizeof(int64_t), sizeof(T)},
                      [step](std::array<char*, 3> p) {
                        const int64_t i = *reinterpret_cast<const int64_t*>(p[1]);
                        *reinterpret_cast<T*>(p[0]) = *reinterpret_cast<const T*>(p[2] + i * step);
                      });
}

// dst[p with coordinate `dim` replaced by index[p]] = src[p] (or += src[p]) for every p of the
// index, in row-major order of the index (Note [Scatter duplicates]: the last write wins).
template <class T, bool kAccumulate>
void scatter_loop(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  Shape dst_strides = dst.strides();
  dst_strides[dim] = 0;
  const int64_t step = dst.stride(dim) * static_cast<int64_t>(sizeof(T));
  for_each_element<3>(index.sizes(), {bytes(dst), bytes(index), bytes(src)},
                      {&dst_strides, &index.strides(), &src.strides()}, {sizeof(T), sizeof(int64_t), sizeof(T)},
                      [step](std::array<char*, 3> p) {
                        const int64_t i = *reinterpret_cast<const int64_t*>(p[1]);
                        T* d = reinterpret_cast<T*>(p[0] + i * step);
                        const T s = *reinterpret_cast<const T*>(p[2]);
                        if constexpr (kAccumulate) {
                          using C = compute_t<T>;
                          *d = convert<T>(fn::Add{}(convert<C>(*d), convert<C>(s)));  // wraps for integers
                        } else {
                          *d = s;
                        }
                      });
}

// Orders for sort: NaN counts as larger than every number (last ascending, first descending).
template <class C>
bool sorts_before_ascending(C a, C b) {
  if (math::isnan(b)) return !math::isnan(a);
  return a < b;
}
template <class C>
bool sorts_before_descending(C a, C b) {
  if (math::isnan(a)) return !math::isnan(b);
  return a > b;
}

template <class T>
void sort_loop(const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim, bool descending) {
  using C = compute_t<T>;
  const int64_t n = src.size(dim);
  const int64_t v_step = values.stride(dim), i_step = indices.stride(dim), s_step = src.stride(dim);
  const Shape outer = erase_dim(src.sizes(), dim);
  const Shape v_strides = erase_dim(values.strides(), dim), i_strides = erase_dim(indices.strides(), dim),
              s_strides = erase_dim(src.strides(), dim);
  std::vector<C> keys(static_cast<std::size_t>(n));
  std::vector<int64_t> perm(static_cast<std::size_t>(n));
  // One call per slice along `dim` (once for a 1-d tensor: `outer` is then 0-d).
  for_each_element<3>(outer, {bytes(values), bytes(indices), bytes(src)}, {&v_strides, &i_strides, &s_strides},
                      {sizeof(T), sizeof(int64_t), sizeof(T)}, [&](std::array<char*, 3> p) {
                        const T* s = reinterpret_cast<const T*>(p[2]);
                        for (int64_t k = 0; k < n; ++k) keys[k] = convert<C>(s[k * s_step]);
                        std::iota(perm.begin(), perm.end(), int64_t{0});
                        if (descending) {
                          std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
                            return sorts_before_descending(keys[a], keys[b]);
                          });
                        } else {
                          std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
                            return sorts_before_ascending(keys[a], keys[b]);
                          });
                        }
                        T* v = reinterpret_cast<T*>(p[0]);
                        int64_t* ix = reinterpret_cast<int64_t*>(p[1]);
                        for (int64_t k = 0; k < n; ++k) {
                          v[k * v_step] = s[perm[k] * s_step];
                          ix[k * i_step] = perm[k];
                        }
                      });
}

}  // namespace

void CpuBackend::index_select(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) {
  check_indices(index, src.size(dim), dim, "index_select");
  Shape index_strides(dst.sizes().size(), 0);
  index_strides[dim] = 1;
  dispatch_by_size(src.element_size(), "index_select", [&](auto tag) {
    gather_loop<typename decltype(tag)::type>(dst, src, dim, index, index_strides);
  });
}

void CpuBackend::gather(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) {
  check_indices(index, src.size(dim), dim, "gather");
  dispatch_by_size(src.element_size(), "gather", [&](auto tag) {
    gather_loop<typename decltype(tag)::type>(dst, src, dim, index, index.strides());
  });
}

void CpuBackend::scatter(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate) {
  const char* op = accumulate ? "scatter_add" : "scatter";
  check_indices(index, dst.size(dim), dim, op);
  if (accumulate) {
    dispatch_dtype(dst.dtype(), op, [&](auto tag) { scatter_loop<typename decltype(tag)::type, true>(dst, dim, index, src); });
  } else {
    dispatch_by_size(dst.element_size(), op, [&](auto tag) {
      scatter_loop<typename decltype(tag)::type, false>(dst, dim, index, src);
    });
  }
}

Tensor CpuBackend::masked_select(const Tensor& src, const Tensor& mask) {
  int64_t count = 0;
  for_each_element<1>(mask.sizes(), {bytes(mask)}, {&mask.strides()}, {sizeof(bool)},
                      [&count](std::array<char*, 1> p) { count += *reinterpret_cast<const bool*>(p[0]) ? 1 : 0; });
  Tensor out = make_empty({count}, src.dtype(), Device::cpu());
  dispatch_by_size(src.element_size(), "masked_select", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data_ptr());
    // for_each_element walks in row-major order, which is the order of the result.
    for_each_element<2>(src.sizes(), {bytes(src), bytes(mask)}, {&src.strides(), &mask.strides()},
                        {sizeof(T), sizeof(bool)}, [&o](std::array<char*, 2> p) {
                          if (*reinterpret_cast<const bool*>(p[1])) *o++ = *reinterpret_cast<const T*>(p[0]);
                        });
  });
  return out;
}

void CpuBackend::sort(const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim, bool descending) {
  dispatch_dtype(src.dtype(), "sort", [&](auto tag) {
    sort_loop<typename decltype(tag)::type>(values, indices, src, dim, descending);
  });
}

}  // namespace flame::backend::cpu
