#include "op_table.h"

#include <algorithm>
#include <cmath>
#include <set>

namespace flame::test {

const CaseList& op_table() {
  static const CaseList cases = [] {
    CaseList c;
    add_elementwise_cases(c);
    add_view_cases(c);
    add_reduce_cases(c);
    add_index_cases(c);
    add_join_cases(c);
    add_linalg_cases(c);
    add_loss_cases(c);
    std::sort(c.begin(), c.end(), [](const OpCase& a, const OpCase& b) { return a.name < b.name; });
    std::set<std::string> seen;
    for (const auto& oc : c) {
      if (!seen.insert(oc.name).second) throw std::runtime_error("duplicate op case name " + oc.name);
    }
    return c;
  }();
  return cases;
}

void add_case(CaseList& cases, const std::string& op, std::vector<InputSpec> inputs, const std::string& extra,
              RunFn run, RefFn reference, bool differentiable) {
  OpCase c;
  c.name = case_name(op, inputs, extra);
  c.inputs = std::move(inputs);
  c.run = std::move(run);
  c.reference = std::move(reference);
  c.differentiable = differentiable;
  cases.push_back(std::move(c));
}

std::string dim_tag(int64_t d) { return d < 0 ? "dimm" + std::to_string(-d) : "dim" + std::to_string(d); }

std::string case_name(const std::string& op, const std::vector<InputSpec>& inputs, const std::string& extra) {
  std::string n = op;
  for (const auto& in : inputs) {
    n += "_";
    n += dtype_name(in.dtype);
    for (int64_t s : in.shape) n += "x" + std::to_string(s);
    if (in.shape.empty()) n += "x";
    if (in.layout != Layout::contiguous) n += std::string("_") + layout_name(in.layout);
  }
  if (!extra.empty()) n += "_" + extra;
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_') ch = '_';
  }
  return n;
}

double round_to(DType dt, double v) {
  switch (dt) {
    case DType::f32: return static_cast<float>(v);
    case DType::bf16: return static_cast<float>(bfloat16(static_cast<float>(v)));
    case DType::f16: return static_cast<float>(float16(static_cast<float>(v)));
    case DType::i32: return static_cast<int32_t>(static_cast<int64_t>(v));
    case DType::i64: return static_cast<double>(static_cast<int64_t>(v));
    case DType::u8: return static_cast<uint8_t>(static_cast<int64_t>(v));
    case DType::boolean: return v != 0 ? 1.0 : 0.0;
    default: return v;
  }
}

namespace {
// Index of a broadcast input element for output multi-index idx.
int64_t broadcast_index(const RefTensor& in, const Shape& out_shape, const Shape& idx) {
  const std::size_t off = out_shape.size() - in.shape.size();
  int64_t f = 0;
  for (std::size_t d = 0; d < in.shape.size(); ++d) {
    const int64_t i = in.shape[d] == 1 ? 0 : idx[d + off];
    f = f * in.shape[d] + i;
  }
  return f;
}
Shape bshape(const Shape& a, const Shape& b) {
  const std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    out[i] = da == 1 ? db : da;
  }
  return out;
}
}  // namespace

RefTensor ref_map(const RefTensor& a, DType out, const std::function<double(double)>& f) {
  RefTensor r(a.shape, out);
  for (int64_t i = 0; i < a.numel(); ++i) r.v[i] = round_to(out, f(a.v[i]));
  return r;
}

RefTensor ref_zip(const RefTensor& a, const RefTensor& b, DType out, const std::function<double(double, double)>& f) {
  RefTensor r(bshape(a.shape, b.shape), out);
  for (int64_t i = 0; i < r.numel(); ++i) {
    const Shape idx = r.unravel(i);
    r.v[i] = round_to(out, f(a.v[broadcast_index(a, r.shape, idx)], b.v[broadcast_index(b, r.shape, idx)]));
  }
  return r;
}

}  // namespace flame::test
