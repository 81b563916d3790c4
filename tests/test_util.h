#pragma once
// Shared test helpers: the device under test, input generation with chosen layouts, and a host
// reference representation (RefTensor: values as double in row-major order).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "flame/flame.h"

namespace flame::test {

// The value of an 8-bit float pattern (OCP E4M3 with ebits 4, mbits 3; E5M2 with 5, 2), written
// from the formats' definition: the reference of the safetensors F8 reader and of flame/float8.h.
float f8_reference(uint8_t b, int ebits, int mbits);

// FLAME_TEST_DEVICE=cuda runs the suite on GPU 0; the default is the CPU.
Device test_device();
// Skips the current test, with a message, when the device under test is not available.
#define FLAME_SKIP_IF_NO_DEVICE()                                                              \
  do {                                                                                         \
    if (::flame::test::test_device().is_cuda() && !::flame::cuda_is_available())               \
      GTEST_SKIP() << "FLAME_TEST_DEVICE=cuda but no CUDA device is available";                 \
  } while (0)
#define FLAME_SKIP_IF_NO_CUDA()                                                          \
  do {                                                                                   \
    if (!::flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: CUDA case skipped"; \
  } while (0)

struct RefTensor {
  Shape shape;
  std::vector<double> v;
  DType dtype = DType::f64;  // the dtype the op is expected to return
  RefTensor() = default;
  RefTensor(Shape s, DType dt) : shape(std::move(s)), v(static_cast<std::size_t>(numel_of(shape))), dtype(dt) {}
  static int64_t numel_of(const Shape& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
  }
  int64_t numel() const { return static_cast<int64_t>(v.size()); }
  // Row-major flat index of a multi-index.
  int64_t flat(const Shape& idx) const {
    int64_t f = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
    return f;
  }
  Shape unravel(int64_t f) const {
    Shape idx(shape.size());
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      idx[d] = shape[d] == 0 ? 0 : f % shape[d];
      f = shape[d] == 0 ? 0 : f / shape[d];
    }
    return idx;
  }
};

RefTensor to_ref(const Tensor& t);

// How an op-table input is laid out in memory (non-contiguous layouts catch stride bugs).
enum class Layout { contiguous, transposed, sliced, expanded };
const char* layout_name(Layout l);

struct InputSpec {
  Shape shape;
  DType dtype = DType::f32;
  Layout layout = Layout::contiguous;
  double lo = -2.0, hi = 2.0;  // value range (integers: [lo, hi)); never all zeros
};

// Builds a tensor with the spec's shape, dtype and layout on `device`. Values are drawn on the CPU
// from `seed` and only then moved, so every device gets identical inputs.
Tensor make_input(const InputSpec& spec, Device device, uint64_t seed);

// Tolerances by dtype for results compared with a float64 reference.
double default_rtol(DType dt);
double default_atol(DType dt);

// Asserts shape, dtype and values (NaN matches NaN, inf matches inf of the same sign).
::testing::AssertionResult all_close(const Tensor& got, const RefTensor& want, double rtol, double atol);
::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double rtol, double atol);

// Bit-level equality of two tensors (same dtype and shape; NaN matches NaN), with the first
// difference named.
::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b, const std::string& what);

// Expects `fn` to throw flame::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts);

// Starts `trace`; the error's text when the kernel trace is not available here (no CUPTI access),
// empty when it started. For cases that count kernels and skip with that reason otherwise.
std::string start_trace(profiler::KernelTrace& trace);

// Sets a process-wide on/off switch (given by its getter and setter, e.g. cuda::allow_tf32 and
// cuda::set_allow_tf32) for a scope and puts the previous value back when the scope ends.
class SwitchScope {
 public:
  SwitchScope(bool (*get)(), void (*set)(bool), bool on) : set_(set), prev_(get()) { set(on); }
  ~SwitchScope() { set_(prev_); }
  SwitchScope(const SwitchScope&) = delete;
  SwitchScope& operator=(const SwitchScope&) = delete;

 private:
  void (*set_)(bool);
  bool prev_;
};

// A path in the test temp folder that no other call, thread or process uses: ctest runs the
// suite in several processes at once (the shards and the shuffled whole), each running the same
// cases. `stem` and `ext` (with its dot) only make the name readable.
std::string unique_temp_path(const std::string& stem, const std::string& ext);

}  // namespace flame::test
