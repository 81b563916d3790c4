#pragma once
// The Tensor handle. A Tensor is a cheap, shared handle to a TensorImpl (sizes, strides, offset,
// dtype) over a Storage (the bytes on one device). Copying a Tensor never copies data; views
// (reshape, transpose, slice, expand, ...) share the Storage. See docs/tensor-model.md.
#include <concepts>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flame/device.h"
#include "flame/dtype.h"
#include "flame/error.h"
#include "flame/op_table.h"
#include "flame/scalar.h"

namespace flame {

using Shape = std::vector<int64_t>;
// Prints shape_str(s), "[2, 3]". Shape is a std::vector, so this is found from namespace flame or
// after `using namespace flame;` (or `using flame::operator<<;`), not by argument lookup alone.
inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << shape_str(s); }
class TensorImpl;
class Generator;
class Tensor;
class Gradients;
struct BackwardOptions;
using TensorList = std::vector<Tensor>;
namespace indexing {
class TensorIndex;  // flame/indexing.h (included at the end of this header)
}

// An integer dim index (bool excluded). Single-dim overloads (x.sum(1), x.mean(-1, true)) take it as
// a template parameter because a braced list never deduces one: x.sum({}) stays "all dims" and
// x.sum({0, 1}) stays a Shape, where an int64_t overload would silently take {} as dim 0.
template <class T>
concept DimIndex = std::integral<T> && !std::same_as<T, bool>;

// Reductions that also take one dim: x.NAME(dim, keepdim = false) == x.NAME({dim}, keepdim).
// max/min give the values (as torch.amax/amin), not torch.max(x, dim)'s (values, indices) pair.
#define FLAME_SINGLE_DIM_REDUCTION_METHODS(X) \
  X(sum) X(mean) X(prod) X(max) X(min) X(logsumexp) X(any) X(all)

// dtype (unset: the factory's default, f32 for most) and device (default CPU) of a new tensor.
// Converts implicitly from a Device or a DType: Tensor::ones({2}, Device::cuda()).
struct TensorOptions {
  std::optional<DType> dtype;
  Device device = Device::cpu();
  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}                      // NOLINT
  TensorOptions(Device d) : device(d) {}                    // NOLINT
  TensorOptions(DType t, Device d) : dtype(t), device(d) {}
  TensorOptions(Device d, DType t) : dtype(t), device(d) {}
  DType dtype_or(DType fallback) const { return dtype.value_or(fallback); }
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl);
  Tensor(const Tensor&) = default;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(const Tensor&) & = default;
  Tensor& operator=(Tensor&&) & noexcept = default;
  // Assigning to a temporary writes through it, as in libtorch: x[0] = y copies y into row 0 of x
  // (copy_, broadcasting), x.select(1, 2) = 1.5 fills. A named Tensor is rebound as usual.
  Tensor& operator=(const Tensor& src) &&;
  Tensor& operator=(Scalar value) &&;
  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // ---- metadata ----
  const Shape& sizes() const;
  const Shape& shape() const { return sizes(); }
  const Shape& strides() const;  // in elements
  int64_t dim() const;
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const;
  int64_t storage_offset() const;  // in elements
  DType dtype() const;
  Device device() const;
  std::size_t element_size() const;
  std::size_t nbytes() const;  // numel * element_size
  bool is_contiguous() const;
  void* data_ptr() const;  // address of the first element (device memory for CUDA tensors)
  template <class T>
  T* data() const {
    FLAME_CHECK(dtype() == dtype_of_v<T>, "data", "tensor has dtype ", dtype_name(dtype()),
                ", requested ", dtype_name(dtype_of_v<T>));
    return static_cast<T*>(data_ptr());
  }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  bool shares_storage(const Tensor& o) const;
  uint64_t version() const;  // counts in-place writes to the storage (shared by all views)

  // ---- autograd (see autograd.h) ----
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);  // leaves only
  bool is_leaf() const;                           // not produced by a recorded op
  Tensor detach() const;                          // same storage, outside any graph
  std::string grad_fn_name() const;               // "" for leaves
  [[nodiscard]] Gradients backward() const;       // scalar output; gradients of all leaves
  // With options.accumulate_into the store returned is empty: discard it with (void).
  [[nodiscard]] Gradients backward(const BackwardOptions& options) const;
  // Runs during backward with the gradient arriving at this tensor; may return a replacement.
  void register_hook(std::function<Tensor(const Tensor&)> hook);
  // Leaves only: runs once the leaf's gradient of a backward has been added to the Gradients
  // store, with the store's (accumulated) gradient (torch's register_post_accumulate_grad_hook);
  // DistributedDataParallel reduces gradients from it while backward goes on.
  void register_post_accumulate_grad_hook(std::function<void(const Tensor& accumulated_grad)> hook);
  Tensor grad(const Gradients& grads) const;      // grads.get(*this): raises when absent

  // ---- factories ----
  static Tensor empty(const Shape& shape, TensorOptions opts = {});
  static Tensor zeros(const Shape& shape, TensorOptions opts = {});
  static Tensor ones(const Shape& shape, TensorOptions opts = {});
  static Tensor full(const Shape& shape, Scalar value, TensorOptions opts = {});
  static Tensor scalar(Scalar value, TensorOptions opts = {});  // 0-d tensor
  // dtype defaults to i64 when start/end/step are all integers, else f32 (as PyTorch).
  static Tensor arange(Scalar end, TensorOptions opts = {});
  static Tensor arange(Scalar start, Scalar end, Scalar step = 1, TensorOptions opts = {});
  static Tensor linspace(double start, double end, int64_t steps, TensorOptions opts = {});
  static Tensor eye(int64_t n, int64_t m = -1, TensorOptions opts = {});
  // Random factories draw from `gen` (default: default_generator()); see random.h.
  static Tensor rand(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);
  // U(low, high): the same as uniform(shape, low, high, opts, gen).
  static Tensor rand(const Shape& shape, double low, double high, TensorOptions opts = {},
                     Generator* gen = nullptr);
  static Tensor uniform(const Shape& shape, double low, double high, TensorOptions opts = {},
                        Generator* gen = nullptr);
  static Tensor randn(const Shape& shape, double mean = 0.0, double std = 1.0,
                      TensorOptions opts = {}, Generator* gen = nullptr);
  static Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions opts = {},
                        Generator* gen = nullptr);  // dtype defaults to i64
  static Tensor bernoulli(const Shape& shape, double p, TensorOptions opts = {},
                          Generator* gen = nullptr);
  // A random permutation of 0..n-1 (torch.randperm); dtype defaults to i64. Drawn on the host
  // (Fisher-Yates with HostRng seeded from the generator's seed and offset, one offset per call),
  // then copied to opts.device: the same permutation on every device for the same generator state.
  static Tensor randperm(int64_t n, TensorOptions opts = {}, Generator* gen = nullptr);
  template <class T>
  static Tensor from_vec(const std::vector<T>& values, const Shape& shape,
                         Device device = Device::cpu()) {
    return from_blob_copy(values.data(), dtype_of_v<T>, values.size(), shape, device);
  }
  static Tensor from_vec(const std::vector<bool>& values, const Shape& shape,
                         Device device = Device::cpu());
  // Copies `count` elements of type `dtype` from host memory.
  static Tensor from_blob_copy(const void* host, DType dtype, std::size_t count, const Shape& shape,
                               Device device = Device::cpu());
  // A contiguous tensor over memory the caller owns (torch::from_blob): no copy, and nothing is
  // freed when the tensor goes. `data` is host memory for a CPU device, device memory of that GPU
  // for a CUDA one. The memory must stay valid, and must not be freed or reused, while this tensor,
  // any view of it or any autograd graph that saved it is alive; writes through the tensor change
  // the caller's buffer. opts.dtype defaults to f32.
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor from_blob(void* data, const Shape& shape, TensorOptions opts = {});

  // ---- conversions and reads (reads synchronise with the device) ----
  Tensor to(Device device) const;  // returns *this when already there
  Tensor to(DType dtype) const;    // returns *this when already that dtype
  Tensor to(DType dtype, Device device) const;
  // Pinned host memory and asynchronous copies (include/flame/offload.h, docs/offload.md).
  // non_blocking: between a pinned CPU tensor and a CUDA tensor, one cudaMemcpyAsync on the CUDA
  // device's current stream, and the host does not wait (to(cpu, true) returns a pinned tensor
  // whose values are there once that stream reaches the copy). Any other pair copies as without it.
  Tensor to(Device device, bool non_blocking) const;
  Tensor pin_memory() const;  // a pinned CPU copy (*this when already pinned); needs CUDA
  bool is_pinned() const;     // a CPU tensor in page-locked memory
  Tensor contiguous() const;       // returns *this when already contiguous
  // Makes this handle hold `data`'s storage and geometry (PyTorch's `param.data = data`): the same
  // TensorImpl, so anything keyed by this tensor (an optimizer's state, a module's registry) stays
  // attached. Keeps requires_grad. Raises unless this tensor is a leaf and not a view. The version
  // seen through this handle strictly increases (the new storage's counter is raised, which other
  // handles on `data` share); views taken earlier keep the old storage, as in PyTorch.
  void set_data(const Tensor& data);
  Tensor clone() const;            // always a fresh contiguous copy
  // Element values converted to T (to_vec<double>() of an f32 tensor is allowed).
  template <class T>
  std::vector<T> to_vec() const {
    Tensor c = host_copy(dtype_of_v<T>);
    const T* p = static_cast<const T*>(c.data_ptr());
    return std::vector<T>(p, p + c.numel());
  }
  template <class T>
  T item() const {
    FLAME_CHECK(numel() == 1, "item", "tensor with ", numel(), " elements (shape ", sizes(),
                ") cannot be converted to a scalar");
    return to_vec<T>()[0];
  }
  std::string to_string() const;

  // ---- views (share storage) ----
  Tensor reshape(const Shape& shape) const;  // a view when the strides allow, else a copy
  Tensor view(const Shape& shape) const;     // always a view; error when strides don't allow
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // transpose of a <= 2-d tensor
  Tensor permute(const Shape& dims) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(const Shape& shape) const;  // -1 keeps a dim
  Tensor expand_as(const Tensor& other) const { return expand(other.sizes()); }
  Tensor broadcast_to(const Shape& shape) const { return expand(shape); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor unflatten(int64_t dim, const Shape& sizes) const;
  Tensor unfold(int64_t dim, int64_t size, int64_t step) const;

  // ---- copies ----
  Tensor flip(const Shape& dims) const;
  Tensor repeat(const Shape& repeats) const;
  TensorList split(int64_t split_size, int64_t dim = 0) const;
  TensorList split_with_sizes(const Shape& sizes, int64_t dim = 0) const;
  TensorList chunk(int64_t chunks, int64_t dim = 0) const;

  // ---- elementwise unary ----
  // x.name() for every `fn` row of flame/op_table.h (neg, abs, exp, log, sqrt, tanh, sigmoid, relu,
  // silu, mish, hardswish, floor, round, isnan, logical_not, ...): the same as flame::name(x).
  FLAME_UNARY_OPS(FLAME_DECLARE_UNARY_METHOD)
  Tensor leaky_relu(double negative_slope = 0.01) const;
  Tensor gelu(bool tanh_approximation = false) const;
  Tensor softplus(double beta = 1.0, double threshold = 20.0) const;
  Tensor elu(double alpha = 1.0) const;
  Tensor clamp(std::optional<Scalar> min, std::optional<Scalar> max) const;
  Tensor pow(Scalar exponent) const;
  Tensor nan_to_num(double nan = 0.0, std::optional<double> posinf = std::nullopt,
                    std::optional<double> neginf = std::nullopt) const;

  // ---- elementwise binary (broadcasting, PyTorch type promotion) ----
  // x.name(o) for every `fn` row of FLAME_BINARY_OPS (add, sub, mul, div (true division: integers
  // give f32), pow, maximum, minimum, atan2, fmod, eq, ne, lt, le, gt, ge, logical_and, logical_or).
  FLAME_BINARY_OPS(FLAME_DECLARE_BINARY_METHOD)
  Tensor add_scalar(Scalar s) const;
  Tensor sub_scalar(Scalar s) const;
  Tensor mul_scalar(Scalar s) const;
  Tensor div_scalar(Scalar s) const;
  Tensor masked_fill(const Tensor& mask, Scalar value) const;

  // ---- in-place (bump the version counter; the written tensor may not overlap itself) ----
  Tensor& copy_(const Tensor& src);  // broadcasts src, converts dtype, may cross devices
  // non_blocking: see to(device, non_blocking); a pinned<->CUDA pair of one dtype and shape,
  // both contiguous, does not wait for the GPU (offload.h).
  Tensor& copy_(const Tensor& src, bool non_blocking);
  Tensor& fill_(Scalar value);
  Tensor& zero_();
  Tensor& add_(const Tensor& o, Scalar alpha = 1);
  Tensor& sub_(const Tensor& o);
  Tensor& mul_(const Tensor& o);
  Tensor& div_(const Tensor& o);
  Tensor& add_(Scalar s);
  Tensor& sub_(Scalar s);
  Tensor& mul_(Scalar s);
  Tensor& div_(Scalar s);
  Tensor& clamp_(std::optional<Scalar> min, std::optional<Scalar> max);

  // ---- reductions (empty dims = all dims) ----
  Tensor sum(const Shape& dims = {}, bool keepdim = false) const;
  Tensor mean(const Shape& dims = {}, bool keepdim = false) const;
  Tensor prod(const Shape& dims = {}, bool keepdim = false) const;
  Tensor max(const Shape& dims, bool keepdim = false) const;  // values (like torch.amax)
  Tensor min(const Shape& dims, bool keepdim = false) const;
  Tensor argmax(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor argmin(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor var(const Shape& dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor std(const Shape& dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor norm(double p = 2.0, const Shape& dims = {}, bool keepdim = false) const;
  Tensor logsumexp(const Shape& dims, bool keepdim = false) const;
  Tensor any(const Shape& dims = {}, bool keepdim = false) const;
  Tensor all(const Shape& dims = {}, bool keepdim = false) const;
  Tensor sum_all() const;
  Tensor mean_all() const;
  Tensor max_all() const;
  Tensor min_all() const;
  Tensor cumsum(int64_t dim) const;
  Tensor softmax(int64_t dim) const;
  Tensor log_softmax(int64_t dim) const;

  // ---- linear algebra ----
  Tensor matmul(const Tensor& o) const;
  Tensor bmm(const Tensor& o) const;

  // ---- indexing ----
  // x[i] is select(0, i): a view, negative i counting from the end. x[t] with a bool or integer
  // tensor is x.index({t}) (a copy), as libtorch's.
  Tensor operator[](int64_t index) const;
  Tensor operator[](const Tensor& index) const;
  // libtorch's x.index({...}) with ints, Slice, None, Ellipsis, bools and bool/integer tensors
  // (flame/indexing.h; rules in docs/api.md, "Indexing"). Without tensor entries the result is a
  // view; with them, a new tensor (advanced indexing). Differentiable.
  Tensor index(const std::vector<indexing::TensorIndex>& indices) const;
  // Writes value (broadcast to x.index(indices)'s shape, converted to x's dtype) into the indexed
  // elements of this tensor, in place; recorded for autograd like any in-place write.
  Tensor& index_put_(const std::vector<indexing::TensorIndex>& indices, const Tensor& value);
  Tensor& index_put_(const std::vector<indexing::TensorIndex>& indices, Scalar value);
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor gather(int64_t dim, const Tensor& index) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor masked_select(const Tensor& mask) const;
  Tensor take(const Tensor& index) const;
  Tensor triu(int64_t diagonal = 0) const;
  Tensor tril(int64_t diagonal = 0) const;
  std::pair<Tensor, Tensor> topk(int64_t k, int64_t dim = -1, bool largest = true,
                                 bool sorted = true) const;
  std::pair<Tensor, Tensor> sort(int64_t dim = -1, bool descending = false) const;
  Tensor argsort(int64_t dim = -1, bool descending = false) const;

  // ---- libtorch spellings (see docs/api.md) ----
  // Single-dim reductions, generated from FLAME_SINGLE_DIM_REDUCTION_METHODS above:
  // sum, mean, prod, max, min, logsumexp, any, all (dim, keepdim = false).
#define FLAME_DECLARE_SINGLE_DIM_REDUCTION(name)                         \
  template <DimIndex I>                                                  \
  Tensor name(I dim, bool keepdim = false) const {                       \
    return name(Shape{static_cast<int64_t>(dim)}, keepdim);              \
  }
  FLAME_SINGLE_DIM_REDUCTION_METHODS(FLAME_DECLARE_SINGLE_DIM_REDUCTION)
#undef FLAME_DECLARE_SINGLE_DIM_REDUCTION
  template <DimIndex I>
  Tensor var(I dim, int64_t correction = 1, bool keepdim = false) const {
    return var(Shape{static_cast<int64_t>(dim)}, correction, keepdim);
  }
  template <DimIndex I>
  Tensor std(I dim, int64_t correction = 1, bool keepdim = false) const {
    return std(Shape{static_cast<int64_t>(dim)}, correction, keepdim);
  }
  Tensor max() const;  // whole tensor, 0-d (as torch.max(x)); same as max_all()
  Tensor min() const;
  // self + alpha * other / self - alpha * other, as torch.add/sub: a floating alpha needs a
  // floating result type, bool inputs take only a bool alpha.
  Tensor add(const Tensor& o, Scalar alpha) const;
  Tensor sub(const Tensor& o, Scalar alpha) const;
  Tensor& sub_(const Tensor& o, Scalar alpha);
  // N(0, 1) with dtype/device from opts: Tensor::randn({2, 3}, Device::cuda()).
  static Tensor randn(const Shape& shape, TensorOptions opts, Generator* gen = nullptr);

  // Literal factory: Tensor::tensor({1, 2, 3}) is i64, Tensor::tensor({1.5, 2.0}) f32 (as
  // torch.tensor), bool literals give bool; opts.dtype converts. 2-d and 3-d from nested lists
  // (rows must have equal lengths). All elements of one literal have one C++ type.
  template <class T>
  static Tensor tensor(std::initializer_list<T> values, TensorOptions opts = {}) {
    return tensor_literal(values.begin(), values.size(), Shape{static_cast<int64_t>(values.size())}, opts);
  }
  template <class T>
  static Tensor tensor(std::initializer_list<std::initializer_list<T>> rows, TensorOptions opts = {}) {
    const std::size_t cols = rows.size() ? rows.begin()->size() : 0;
    std::unique_ptr<T[]> flat(new T[rows.size() * cols]);
    std::size_t n = 0;
    for (const auto& r : rows) {
      FLAME_CHECK(r.size() == cols, "tensor", "ragged literal: a row of ", r.size(),
                  " elements where the first has ", cols);
      for (const T& v : r) flat[n++] = v;
    }
    return tensor_literal(flat.get(), n, Shape{static_cast<int64_t>(rows.size()), static_cast<int64_t>(cols)},
                          opts);
  }
  template <class T>
  static Tensor tensor(std::initializer_list<std::initializer_list<std::initializer_list<T>>> planes,
                       TensorOptions opts = {}) {
    TensorList parts;
    for (const auto& p : planes) parts.push_back(tensor(p, opts).unsqueeze(0));
    FLAME_CHECK(!parts.empty(), "tensor", "empty 3-d literal");
    return cat_literal_planes(parts);
  }

 private:
  Tensor host_copy(DType dtype) const;  // contiguous CPU copy converted to dtype
  template <class T>
  static Tensor tensor_literal(const T* values, std::size_t count, const Shape& shape, TensorOptions opts) {
    if constexpr (std::is_same_v<T, bool>) {
      std::vector<uint8_t> v(values, values + count);
      return literal_from_host(v.data(), DType::boolean, count, shape, opts);
    } else if constexpr (std::is_integral_v<T>) {
      std::vector<int64_t> v(values, values + count);
      return literal_from_host(v.data(), DType::i64, count, shape, opts);
    } else if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) {
      return literal_from_host(values, dtype_of_v<T>, count, shape, opts);
    } else {
      static_assert(std::is_floating_point_v<T>, "Tensor::tensor: elements must be numbers or bool");
      std::vector<double> v(values, values + count);
      return literal_from_host(v.data(), DType::f64, count, shape, opts, DType::f32);
    }
  }
  // Copies host values of `dtype` and converts to opts.dtype (else `fallback`, else `dtype`).
  static Tensor literal_from_host(const void* host, DType dtype, std::size_t count, const Shape& shape,
                                  TensorOptions opts, std::optional<DType> fallback = std::nullopt);
  static Tensor cat_literal_planes(const TensorList& planes);
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// Operators: Tensor op Tensor and Tensor op Scalar (either side).
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, Scalar b);
Tensor operator-(const Tensor& a, Scalar b);
Tensor operator*(const Tensor& a, Scalar b);
Tensor operator/(const Tensor& a, Scalar b);
Tensor operator+(Scalar a, const Tensor& b);
Tensor operator-(Scalar a, const Tensor& b);
Tensor operator*(Scalar a, const Tensor& b);
Tensor operator/(Scalar a, const Tensor& b);
Tensor& operator+=(Tensor& a, const Tensor& b);
Tensor& operator-=(Tensor& a, const Tensor& b);
Tensor& operator*=(Tensor& a, const Tensor& b);
Tensor& operator/=(Tensor& a, const Tensor& b);
Tensor& operator+=(Tensor& a, Scalar b);
Tensor& operator-=(Tensor& a, Scalar b);
Tensor& operator*=(Tensor& a, Scalar b);
Tensor& operator/=(Tensor& a, Scalar b);
// Compound assignment on a temporary writes through it: x.narrow(0, 0, 1) += 1 changes x.
Tensor operator+=(Tensor&& a, const Tensor& b);
Tensor operator-=(Tensor&& a, const Tensor& b);
Tensor operator*=(Tensor&& a, const Tensor& b);
Tensor operator/=(Tensor&& a, const Tensor& b);
Tensor operator+=(Tensor&& a, Scalar b);
Tensor operator-=(Tensor&& a, Scalar b);
Tensor operator*=(Tensor&& a, Scalar b);
Tensor operator/=(Tensor&& a, Scalar b);

// Comparisons are elementwise and give bool tensors (as in PyTorch): (x > 0) is a mask, not a
// truth value. Tensor identity is x.is_same(y). A scalar operand is compared in the tensor's
// dtype when that is floating (as PyTorch), else exactly: in i64, or f64 for a floating scalar.
#define FLAME_COMPARISON_OPERATORS(X) X(==, eq) X(!=, ne) X(<, lt) X(<=, le) X(>, gt) X(>=, ge)
#define FLAME_DECLARE_COMPARISON(op, name)          \
  Tensor operator op(const Tensor& a, const Tensor& b); \
  Tensor operator op(const Tensor& a, Scalar b);        \
  Tensor operator op(Scalar a, const Tensor& b);
FLAME_COMPARISON_OPERATORS(FLAME_DECLARE_COMPARISON)
#undef FLAME_DECLARE_COMPARISON
Tensor operator!(const Tensor& a);                   // logical_not (any dtype)
Tensor operator&(const Tensor& a, const Tensor& b);  // logical_and of bool tensors
Tensor operator|(const Tensor& a, const Tensor& b);  // logical_or of bool tensors
Tensor operator^(const Tensor& a, const Tensor& b);  // logical xor of bool tensors

}  // namespace flame

#include "flame/indexing.h"  // Tensor::index's entries; needs the complete Tensor above
