#pragma once
// The CPU reference backend: simple, readable loops, f64 capable. It is the oracle the CUDA
// kernels are tested against, so clarity wins over speed except on the contiguous fast paths.
#include <algorithm>
#include <array>
#include <cstring>

#include "src/backend/backend.h"
#include "src/backend/cpu/cpu_threads.h"
#include "src/core/dispatch.h"
#include "src/core/tensor_impl.h"

namespace flame::backend::cpu {

// Calls f(ptrs) for every element of `shape`, with ptrs[k] pointing at operand k's element.
// Operands are given as (base pointer, element strides, element size).
template <std::size_t N, class F>
void for_each_element(const Shape& shape, std::array<char*, N> base,
                      const std::array<const Shape*, N>& strides,
                      const std::array<std::size_t, N>& esize, F&& f) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (numel == 0) return;
  if (ndim == 0) {
    f(base);
    return;
  }
  std::array<std::array<int64_t, 16>, N> bstride{};
  FLAME_CHECK(ndim <= 16, "cpu kernel", "tensors with more than 16 dims are not supported");
  for (std::size_t k = 0; k < N; ++k)
    for (int64_t d = 0; d < ndim; ++d) bstride[k][d] = (*strides[k])[d] * static_cast<int64_t>(esize[k]);
  std::array<int64_t, 16> idx{};
  const int64_t inner = shape[ndim - 1];
  std::array<char*, N> p = base;
  for (int64_t done = 0; done < numel; done += inner) {
    std::array<char*, N> q = p;
    for (int64_t i = 0; i < inner; ++i) {
      f(q);
      for (std::size_t k = 0; k < N; ++k) q[k] += bstride[k][ndim - 1];
    }
    // Advance the outer index (odometer) and the base pointers.
    for (int64_t d = ndim - 2; d >= 0; --d) {
      ++idx[d];
      for (std::size_t k = 0; k < N; ++k) p[k] += bstride[k][d];
      if (idx[d] < shape[d]) break;
      for (std::size_t k = 0; k < N; ++k) p[k] -= bstride[k][d] * shape[d];
      idx[d] = 0;
    }
  }
}

inline char* bytes(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// for_each_element split over the CPU pool along whole innermost rows, above kParallelGrain
// elements (Note [CPU threads]). Only for elementwise work: every call writes its own element and
// reads nothing another call writes, so the result equals the serial loop's bit for bit.
template <std::size_t N, class F>
void parallel_for_each_element(const Shape& shape, std::array<char*, N> base,
                               const std::array<const Shape*, N>& strides,
                               const std::array<std::size_t, N>& esize, F&& f) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (numel < kParallelGrain || ndim < 2 || ndim > 16 || pool_threads() < 2) {
    for_each_element<N>(shape, base, strides, esize, f);
    return;
  }
  const int64_t inner = shape[ndim - 1], rows = numel / inner;
  parallel_for(rows, std::max<int64_t>(1, kParallelGrain / inner), [&](int64_t r0, int64_t r1) {
    // The start of row r0: its outer index, one digit per dim, last dim fastest.
    std::array<int64_t, 16> idx{};
    std::array<char*, N> p = base;
    for (int64_t d = ndim - 2, rem = r0; d >= 0; --d) {
      idx[d] = rem % shape[d];
      rem /= shape[d];
      for (std::size_t k = 0; k < N; ++k) p[k] += idx[d] * (*strides[k])[d] * static_cast<int64_t>(esize[k]);
    }
    for (int64_t r = r0; r < r1; ++r) {
      std::array<char*, N> q = p;
      for (int64_t i = 0; i < inner; ++i) {
        f(q);
        for (std::size_t k = 0; k < N; ++k) q[k] += (*strides[k])[ndim - 1] * static_cast<int64_t>(esize[k]);
      }
      for (int64_t d = ndim - 2; d >= 0; --d) {
        ++idx[d];
        for (std::size_t k = 0; k < N; ++k) p[k] += (*strides[k])[d] * static_cast<int64_t>(esize[k]);
        if (idx[d] < shape[d]) break;
        for (std::size_t k = 0; k < N; ++k) p[k] -= (*strides[k])[d] * shape[d] * static_cast<int64_t>(esize[k]);
        idx[d] = 0;
      }
    }
  });
}



// A CPU Storage of nbytes whose bookkeeping (the Storage object and its shared_ptr control block)
// lives in a header in front of the data, in one block of the block cache: creating a tensor
// costs no heap allocation once the cache holds a block of its class (Note [Storage in its block]
// in cpu_allocator.cpp).
std::shared_ptr<Storage> allocate_storage(std::size_t nbytes);

// The fused kernels the CPU backend implements (Note [Fused kernels]), registered when the CPU
// backend is created: the training step's multi-tensor updates (cpu_optim.cpp, cpu_graph.cpp,
// cpu_amp.cpp), the reference of the CUDA ones.
void register_cpu_optim_kernels();
void register_cpu_adamw8bit_kernels();  // cpu_adamw8bit.cpp
void register_cpu_graph_kernels();
void register_cpu_amp_kernels();
// and the rotary embedding (cpu_rotary.cpp) and the 8-bit float row casts (cpu_float8.cpp).
void register_cpu_rotary_kernels();
void register_cpu_float8_kernels();

class CpuBackend final : public Backend {
 public:
  CpuBackend() {
    register_cpu_optim_kernels();
    register_cpu_adamw8bit_kernels();
    register_cpu_graph_kernels();
    register_cpu_amp_kernels();
    register_cpu_rotary_kernels();
    register_cpu_float8_kernels();
  }
  std::shared_ptr<void> allocate(std::size_t nbytes) override;
  void copy(const Tensor& dst, const Tensor& src) override;
  void copy_from_host(const Tensor& dst, const void* host) override;
  void copy_to_host(void* host, const Tensor& src) override;
  void synchronize() override {}
  void fill(const Tensor& dst, Scalar value) override;
  void iota(const Tensor& dst, double start, double step) override;
  void unary(UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p) override;
  void binary(BinaryOp op, const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void where(const Tensor& dst, const Tensor& cond, const Tensor& a, const Tensor& b) override;
  void reduce(ReduceOp op, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) override;
  void cumsum(const Tensor& dst, const Tensor& src, int64_t dim) override;
  void softmax(const Tensor& dst, const Tensor& src, int64_t dim, bool log) override;
  void matmul(const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void index_select(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) override;
  void gather(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) override;
  void scatter(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate) override;
  Tensor masked_select(const Tensor& src, const Tensor& mask) override;
  void sort(const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim, bool descending) override;
  void random(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset, double a, double b) override;
  // ---- conv ---- (cpu_conv.cpp / conv/)
  void conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) override;
  void conv_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p) override;
  void conv_backward_filter(const Tensor& dw, const Tensor& x, const Tensor& dy, const ConvParams& p) override;

  // ---- attention ---- (cpu_attention.cpp)
  void sdpa_forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& bias, double scale, bool causal) override;
  void sdpa_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& stats, const Tensor& bias,
                     double scale, bool causal, Tensor* column_sums) override;

  // ---- norm ----
  void norm_rows_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         const Tensor& bias, double eps) override;
  void norm_rows_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                          const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight) override;
  void group_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                          const Tensor& weight, const Tensor& bias, int64_t groups, double eps) override;
  void group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                           int64_t groups) override;
  void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& x) override;
  void batch_norm_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& weight, const Tensor& bias) override;
  void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                           bool training) override;

  // ---- pool ----
  void pool2d(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p) override;
  void pool2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                       const Pool2dParams& p) override;
  void upsample2d(const Tensor& out, const Tensor& x, const Upsample2dParams& p) override;
  void upsample2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p) override;
  void cross_entropy(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                     int64_t ignore_index, double label_smoothing) override;
  void cross_entropy_backward(const Tensor& grad_logits, const Tensor& grad_loss, const Tensor& logits,
                              const Tensor& target, const Tensor& lse, int64_t ignore_index,
                              double label_smoothing) override;
};

}  // namespace flame::backend::cpu
