#pragma once
// The op table: one OpCase per (op, dtypes, shapes, layout) combination. From it come the
// CPU-vs-float64-reference checks (test_op_table.cpp), the CUDA-vs-CPU checks and, later, the
// gradient checks. Each op family adds its cases in its own cases_*.cpp file.
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

namespace flame::test {

struct OpCase {
  std::string name;  // unique; letters, digits and '_' only (it becomes the gtest name)
  std::vector<InputSpec> inputs;
  std::function<Tensor(const TensorList&)> run;
  // Independent reference: float64 loops or closed forms over the inputs' values.
  std::function<RefTensor(const std::vector<RefTensor>&)> reference;
  double rtol = -1.0, atol = -1.0;  // < 0: default_rtol/atol of the result's dtype
  bool differentiable = false;      // takes part in gradient checks
};
using CaseList = std::vector<OpCase>;

inline void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

// All cases, sorted by name (built once).
const CaseList& op_table();

// Family contributions (one file each).
void add_elementwise_cases(CaseList& cases);
void add_view_cases(CaseList& cases);
void add_reduce_cases(CaseList& cases);
void add_index_cases(CaseList& cases);
void add_join_cases(CaseList& cases);
void add_linalg_cases(CaseList& cases);
void add_loss_cases(CaseList& cases);

// Helpers for writing cases.
using RunFn = std::function<Tensor(const TensorList&)>;
using RefFn = std::function<RefTensor(const std::vector<RefTensor>&)>;
// Appends a case named case_name(op, inputs, extra).
void add_case(CaseList& cases, const std::string& op, std::vector<InputSpec> inputs, const std::string& extra,
              RunFn run, RefFn reference, bool differentiable);
// "dim2" for 2, "dimm1" for -1 (case names allow letters, digits and '_' only).
std::string dim_tag(int64_t d);
std::string case_name(const std::string& op, const std::vector<InputSpec>& inputs, const std::string& extra = "");
// Elementwise reference over broadcast inputs: out[i] = f(a[i']) with the given result dtype.
RefTensor ref_map(const RefTensor& a, DType out, const std::function<double(double)>& f);
RefTensor ref_zip(const RefTensor& a, const RefTensor& b, DType out, const std::function<double(double, double)>& f);
// Rounds a double to what `dt` can hold (so integer references wrap/truncate as the kernels do).
double round_to(DType dt, double v);

}  // namespace flame::test
