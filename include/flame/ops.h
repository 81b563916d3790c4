#pragma once
// Free-function forms of every op. Tensor's methods forward here; the semantics follow PyTorch
// (broadcasting, type promotion, negative dims). Every op validates its inputs and raises
// flame::Error naming itself and the offending shapes/dtypes/devices before writing anything.
#include <optional>
#include <utility>

#include "flame/tensor.h"

namespace flame {

// ---- factories from another tensor ----
Tensor empty_like(const Tensor& t, std::optional<DType> dtype = std::nullopt);
Tensor zeros_like(const Tensor& t, std::optional<DType> dtype = std::nullopt);
Tensor ones_like(const Tensor& t, std::optional<DType> dtype = std::nullopt);
Tensor full_like(const Tensor& t, Scalar value, std::optional<DType> dtype = std::nullopt);
Tensor rand_like(const Tensor& t, Generator* gen = nullptr);
Tensor randn_like(const Tensor& t, Generator* gen = nullptr);
Tensor randint_like(const Tensor& t, int64_t low, int64_t high, Generator* gen = nullptr);
// Each element is 1 with probability p[i] (p in [0, 1]); result has p's shape and dtype.
Tensor bernoulli(const Tensor& p, Generator* gen = nullptr);
// torch.randperm: Tensor::randperm (a permutation of 0..n-1, drawn on the host, i64 by default).
Tensor randperm(int64_t n, TensorOptions opts = {}, Generator* gen = nullptr);

// ---- shape helpers ----
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op = "broadcast_shapes");
DType result_type(const Tensor& a, const Tensor& b);

// ---- copies and joins ----
Tensor flip(const Tensor& x, const Shape& dims);
Tensor repeat(const Tensor& x, const Shape& repeats);
TensorList split(const Tensor& x, int64_t split_size, int64_t dim = 0);
TensorList split_with_sizes(const Tensor& x, const Shape& sizes, int64_t dim = 0);
TensorList chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
Tensor cat(const TensorList& tensors, int64_t dim = 0);
Tensor stack(const TensorList& tensors, int64_t dim = 0);
enum class PadMode : uint8_t { constant, reflect, replicate };
// pads = {last_left, last_right, second_last_left, second_last_right, ...} as torch.nn.functional.pad
Tensor pad(const Tensor& x, const Shape& pads, PadMode mode = PadMode::constant, double value = 0.0);

// ---- elementwise ----
// One tensor in, one out, no parameters: neg, abs, sign, square, relu, floor, ceil, round (half to
// even, as PyTorch), trunc, isnan, isinf, logical_not, exp, log, log1p, expm1, sqrt, rsqrt,
// reciprocal, sin, cos, tanh, sigmoid, silu, mish, hardswish, hardsigmoid, ... : every row of
// flame/op_table.h whose surface is `fn` (Note [Op table]) declares `Tensor name(const Tensor& x)`.
FLAME_UNARY_OPS(FLAME_DECLARE_UNARY_FN)
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01);
Tensor gelu(const Tensor& x, bool tanh_approximation = false);
Tensor softplus(const Tensor& x, double beta = 1.0, double threshold = 20.0);
Tensor elu(const Tensor& x, double alpha = 1.0);
Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max);
Tensor pow(const Tensor& x, Scalar exponent);
Tensor nan_to_num(const Tensor& x, double nan = 0.0, std::optional<double> posinf = std::nullopt,
                  std::optional<double> neginf = std::nullopt);

// Two tensors in (broadcasting, PyTorch type promotion), one out: add, sub, mul, div (true
// division: integers give f32), pow, maximum, minimum, atan2, fmod, eq, ne, lt, le, gt, ge,
// logical_and, logical_or: the `fn` rows of FLAME_BINARY_OPS declare `Tensor name(a, b)`.
FLAME_BINARY_OPS(FLAME_DECLARE_BINARY_FN)
// a + alpha * b and a - alpha * b (torch.add/sub with alpha; see Tensor::add).
Tensor add(const Tensor& a, const Tensor& b, Scalar alpha);
Tensor sub(const Tensor& a, const Tensor& b, Scalar alpha);
Tensor add_scalar(const Tensor& a, Scalar s);
Tensor sub_scalar(const Tensor& a, Scalar s);
Tensor mul_scalar(const Tensor& a, Scalar s);
Tensor div_scalar(const Tensor& a, Scalar s);
Tensor rsub_scalar(const Tensor& a, Scalar s);  // s - a
Tensor rdiv_scalar(const Tensor& a, Scalar s);  // s / a
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, Scalar value);

// ---- reductions (empty dims = all dims) ----
Tensor sum(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor prod(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor argmax(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor argmin(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor var(const Tensor& x, const Shape& dims = {}, int64_t correction = 1, bool keepdim = false);
Tensor std(const Tensor& x, const Shape& dims = {}, int64_t correction = 1, bool keepdim = false);
// p-norm over dims; p = INFINITY gives max |x|, p = 0 counts non-zeros.
Tensor norm(const Tensor& x, double p = 2.0, const Shape& dims = {}, bool keepdim = false);
Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim = false);
Tensor any(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor all(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
// Single-dim forms: flame::sum(x, 1), flame::amax(x, -1, true) (see DimIndex in tensor.h).
#define FLAME_SINGLE_DIM_REDUCTIONS(X) X(sum) X(mean) X(prod) X(amax) X(amin) X(logsumexp) X(any) X(all)
#define FLAME_DECLARE_SINGLE_DIM_REDUCTION(name)                     \
  template <DimIndex I>                                              \
  Tensor name(const Tensor& x, I dim, bool keepdim = false) {        \
    return name(x, Shape{static_cast<int64_t>(dim)}, keepdim);       \
  }
FLAME_SINGLE_DIM_REDUCTIONS(FLAME_DECLARE_SINGLE_DIM_REDUCTION)
#undef FLAME_DECLARE_SINGLE_DIM_REDUCTION
template <DimIndex I>
Tensor var(const Tensor& x, I dim, int64_t correction = 1, bool keepdim = false) {
  return var(x, Shape{static_cast<int64_t>(dim)}, correction, keepdim);
}
template <DimIndex I>
Tensor std(const Tensor& x, I dim, int64_t correction = 1, bool keepdim = false) {
  return std(x, Shape{static_cast<int64_t>(dim)}, correction, keepdim);
}
Tensor cumsum(const Tensor& x, int64_t dim);
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// ---- linear algebra ----
Tensor matmul(const Tensor& a, const Tensor& b);  // torch.matmul semantics (1-d, batched, broadcast)
Tensor bmm(const Tensor& a, const Tensor& b);     // [B, M, K] x [B, K, N]
Tensor outer(const Tensor& a, const Tensor& b);

// ---- indexing ----
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor masked_select(const Tensor& x, const Tensor& mask);  // 1-d; synchronises (size depends on data)
Tensor take(const Tensor& x, const Tensor& index);          // index into the flattened tensor
Tensor triu(const Tensor& x, int64_t diagonal = 0);
Tensor tril(const Tensor& x, int64_t diagonal = 0);
Tensor one_hot(const Tensor& index, int64_t num_classes = -1);  // i64 result, [..., num_classes]
// Deprecated spelling (weight first): use nn::functional::embedding(index, weight, padding_idx), i.e.
// F::embedding, PyTorch's argument order (flame/nn/embedding.h). Kept so existing code builds.
Tensor embedding(const Tensor& weight, const Tensor& index);    // weight [N, D] -> [..., D]
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true,
                               bool sorted = true);
std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim = -1, bool descending = false);
Tensor argsort(const Tensor& x, int64_t dim = -1, bool descending = false);

// ---- 8-bit float casts with scales (Note [Float8 dtypes] in flame/dtype.h) ----
// The largest finite value of an 8-bit float dtype: 448 (f8_e4m3fn), 57344 (f8_e5m2).
double float8_max(DType f8);
// The f32 scale that maps x's largest magnitude onto float8_max(f8): amax / max over the whole
// tensor (0-d) or, with dim, over every other dim per index of dim (kept as size 1, so it
// broadcasts against x: dim 0 of a weight [out, in] gives per-output-channel scales [out, 1]).
// An all-zero slice gets scale 1; a NaN or an infinity in x gives a NaN or infinite scale. No
// gradient.
Tensor float8_scale(const Tensor& x, DType f8, std::optional<int64_t> dim = std::nullopt);
// q = x / scale as f8, rounded to nearest even and clamped to +-float8_max(f8) in both formats
// (a scaled cast saturates, as Transformer Engine's; a plain x.to(DType::f8_e5m2) overflows to
// infinity as PyTorch's); NaN stays NaN. scale broadcasts against x (0-d, [out, 1], ...). No
// gradient.
Tensor to_float8(const Tensor& x, DType f8, const Tensor& scale);
// q * scale in `out` (computed in f32). No gradient.
Tensor from_float8(const Tensor& q, const Tensor& scale, DType out = DType::f32);
// The per-row scaled cast in one pass (the FP8 Linear's activation and gradient cast): x [..., C]
// as rows of C; returns q (x's shape, f8) and f32 scales (x's shape without the last dim):
// scale = the row's amax of |x * col| / float8_max(f8) (1 for an all-zero row, NaN for a row with
// a NaN), q = to_float8(x * col, f8, scale.unsqueeze(-1)). col: a per-column factor [C], or
// undefined. No gradient.
std::pair<Tensor, Tensor> float8_quantize_rows(const Tensor& x, DType f8, const Tensor& col = Tensor());

// ---- losses ----
enum class Reduction : uint8_t { none, mean, sum };
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction r = Reduction::mean);
Tensor l1_loss(const Tensor& input, const Tensor& target, Reduction r = Reduction::mean);
// |d| < beta ? 0.5 d^2 / beta : |d| - 0.5 beta, d = input - target (beta = 0: l1_loss), as PyTorch.
Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, Reduction r = Reduction::mean, double beta = 1.0);
// |d| < delta ? 0.5 d^2 : delta (|d| - 0.5 delta) (delta > 0), as PyTorch.
Tensor huber_loss(const Tensor& input, const Tensor& target, Reduction r = Reduction::mean, double delta = 1.0);
// logits [N, C] (or [C], [N, C, d1, ...]) and either class indices [N] (or [], [N, d1, ...]), i64,
// or class probabilities of the logits' shape (floating). weight: optional [C] class weights; with
// class indices the mean divides by the summed weights of the counted targets, as PyTorch.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction r = Reduction::mean,
                     int64_t ignore_index = -100, double label_smoothing = 0.0, const Tensor& weight = {});
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction r = Reduction::mean,
                int64_t ignore_index = -100);
// weight: rescales each element's loss (broadcast to the logits' shape); pos_weight: the weight of
// the positive term, broadcast to the logits' shape (a [C] vector weights the classes of the last
// dim), as PyTorch.
Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target,
                                        Reduction r = Reduction::mean, const Tensor& weight = {},
                                        const Tensor& pos_weight = {});

}  // namespace flame
