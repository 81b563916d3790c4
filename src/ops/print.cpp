// Printing, in the spirit of PyTorch's repr: nested brackets, a common number format, and
// summarised rows ("...") for large tensors.
//
// Note [Summarised printing]
// Above kSummariseAbove elements only the first and last kEdgeItems entries of each longer dim
// are shown. Those corners are gathered on the tensor's own device (narrow views joined by cat)
// and only they are copied to the host, so printing a large CUDA tensor moves a few hundred
// bytes, and printing a huge expanded view allocates nothing of its logical size.
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "flame/ops.h"
#include "src/core/tensor_impl.h"

namespace flame {
namespace {

constexpr int64_t kSummariseAbove = 1000;
constexpr int64_t kEdgeItems = 3;

struct Formatter {
  bool floating = false;
  bool boolean = false;
  bool scientific = false;
  bool integral_values = false;

  std::string format(double v) const {
    char buf[64];
    if (boolean) return v != 0 ? "true" : "false";
    if (!floating) {
      // Integers reach here as doubles: +-2^63 (INT64_MAX/MIN rounded) must not overflow the cast.
      const long long i = v >= 9223372036854775807.0 ? std::numeric_limits<long long>::max()
                          : v <= -9223372036854775808.0 ? std::numeric_limits<long long>::min()
                                                        : static_cast<long long>(v);
      std::snprintf(buf, sizeof(buf), "%lld", i);
    } else if (std::isnan(v)) {
      return "nan";
    } else if (std::isinf(v)) {
      return v > 0 ? "inf" : "-inf";
    } else if (scientific) {
      std::snprintf(buf, sizeof(buf), "%.4e", v);
    } else if (integral_values) {
      std::snprintf(buf, sizeof(buf), "%.0f.", v);
    } else {
      std::snprintf(buf, sizeof(buf), "%.4f", v);
    }
    return buf;
  }
};

bool summarised_dim(int64_t n, bool summarise) { return summarise && n > 2 * kEdgeItems; }

// The elements shown: `t` itself, or (summarising) the corners of `t` joined into one small tensor
// holding, for each summarised dim, its first and last kEdgeItems entries (Note [Summarised printing]).
Tensor shown_elements(const Tensor& t, int64_t dim, bool summarise) {
  if (dim == t.dim()) return t;
  const int64_t n = t.size(dim);
  if (!summarised_dim(n, summarise)) return shown_elements(t, dim + 1, summarise);
  return cat({shown_elements(t.narrow(dim, 0, kEdgeItems), dim + 1, summarise),
              shown_elements(t.narrow(dim, n - kEdgeItems, kEdgeItems), dim + 1, summarise)},
             dim);
}

// `v` holds the shown elements (contiguous, strides `strides`); `sizes` are the full tensor's.
void print_rec(std::ostringstream& os, const std::vector<double>& v, const Shape& sizes,
               const Shape& strides, int64_t dim, int64_t base, const Formatter& f, std::size_t width,
               bool summarise, int indent) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  if (ndim == 0) {
    os << f.format(v[0]);
    return;
  }
  os << "[";
  const int64_t n = sizes[dim];
  const bool cut = summarised_dim(n, summarise);
  for (int64_t i = 0; i < n; ++i) {
    if (cut && i == kEdgeItems) {
      os << (dim == ndim - 1 ? "..., " : "...,\n" + std::string(indent + 1, ' '));
      i = n - kEdgeItems;
    }
    const int64_t shown_i = cut && i >= kEdgeItems ? i - (n - 2 * kEdgeItems) : i;
    if (dim == ndim - 1) {
      std::string s = f.format(v[base + shown_i * strides[dim]]);
      if (s.size() < width) s = std::string(width - s.size(), ' ') + s;
      os << s;
      if (i + 1 < n) os << ", ";
    } else {
      print_rec(os, v, sizes, strides, dim + 1, base + shown_i * strides[dim], f, width, summarise, indent + 1);
      if (i + 1 < n) os << "," << std::string(ndim - dim - 1, '\n') << std::string(indent + 1, ' ');
    }
  }
  os << "]";
}

}  // namespace

std::string Tensor::to_string() const {
  if (!defined()) return "tensor(undefined)";
  const bool summarise = numel() > kSummariseAbove;
  const Tensor shown = numel() == 0 ? *this : shown_elements(detach(), 0, summarise);
  const std::vector<double> v = shown.to_vec<double>();
  Formatter f;
  f.floating = is_floating(dtype());
  f.boolean = is_bool(dtype());
  if (f.floating) {
    double max_abs = 0, min_abs = INFINITY;
    bool all_int = true;
    for (double x : v) {
      if (!std::isfinite(x)) continue;
      max_abs = std::max(max_abs, std::fabs(x));
      if (x != 0) min_abs = std::min(min_abs, std::fabs(x));
      if (x != std::floor(x)) all_int = false;
    }
    f.integral_values = all_int && max_abs < 1e8;
    f.scientific = !f.integral_values && (max_abs >= 1e8 || (min_abs < 1e-4 && min_abs != INFINITY));
  }
  std::size_t width = 0;
  for (double x : v) width = std::max(width, f.format(x).size());
  std::ostringstream os;
  os << "tensor(";
  if (numel() == 0) {
    os << "[]";
    if (dim() != 1) os << ", size=" << shape_str(sizes());
  } else {
    print_rec(os, v, sizes(), contiguous_strides(shown.sizes()), 0, 0, f, width, summarise, 7);
  }
  os << ", dtype=" << dtype_name(dtype());
  if (!device().is_cpu()) os << ", device=" << device().str();
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.to_string(); }

}  // namespace flame
