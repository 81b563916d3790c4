#include "test_util.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>

namespace flame::test {

Device test_device() {
  const char* e = std::getenv("FLAME_TEST_DEVICE");
  if (e && std::string(e) == "cuda") return Device::cuda(0);
  return Device::cpu();
}

RefTensor to_ref(const Tensor& t) {
  RefTensor r(t.sizes(), t.dtype());
  r.v = t.to_vec<double>();
  return r;
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::contiguous: return "contiguous";
    case Layout::transposed: return "transposed";
    case Layout::sliced: return "sliced";
    case Layout::expanded: return "expanded";
  }
  return "?";
}

// The value of an 8-bit float pattern built as f32 bits: a normal number's exponent is rebiased
// into the f32 field and its mantissa shifted to the top; a subnormal is m * 2^(1 - bias - mbits)
// computed in double; the all-ones exponent follows the OCP rules (E4M3: only S.1111.111 is NaN;
// E5M2: inf with mantissa 0, else NaN).
float f8_reference(uint8_t b, int ebits, int mbits) {
  const int bias = (1 << (ebits - 1)) - 1;
  const uint32_t sign = b >> 7, e = (b >> mbits) & ((1u << ebits) - 1), m = b & ((1u << mbits) - 1);
  const uint32_t emax = (1u << ebits) - 1;
  if (e == emax && (ebits == 5 || m == (1u << mbits) - 1)) {
    if (ebits == 5 && m == 0) return sign ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (e == 0) {
    const double v = static_cast<double>(m) * std::pow(2.0, 1 - bias - mbits);
    return static_cast<float>(sign ? -v : v);
  }
  const uint32_t bits = (sign << 31) | ((e - bias + 127) << 23) | (m << (23 - mbits));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {
Tensor random_values(const Shape& shape, const InputSpec& spec, Generator& gen) {
  if (is_bool(spec.dtype)) return Tensor::bernoulli(shape, 0.5, DType::boolean, &gen);
  if (is_integral(spec.dtype)) {
    return Tensor::randint(static_cast<int64_t>(spec.lo), static_cast<int64_t>(spec.hi), shape, spec.dtype, &gen);
  }
  return Tensor::uniform(shape, spec.lo, spec.hi, DType::f64, &gen).to(spec.dtype);
}
}  // namespace

Tensor make_input(const InputSpec& spec, Device device, uint64_t seed) {
  Generator gen(seed);
  const Shape& s = spec.shape;
  const int64_t nd = static_cast<int64_t>(s.size());
  Tensor t;
  switch (spec.layout) {
    case Layout::contiguous: t = random_values(s, spec, gen); break;
    case Layout::transposed:
      if (nd >= 2) {
        Shape st = s;
        std::swap(st[nd - 1], st[nd - 2]);
        t = random_values(st, spec, gen).to(device).transpose(-1, -2);
        return t;
      }
      [[fallthrough]];
    case Layout::sliced:
      if (nd >= 1) {
        Shape big = s;
        big[nd - 1] = 2 * s[nd - 1] + 1;
        t = random_values(big, spec, gen).to(device).slice(nd - 1, 1, big[nd - 1], 2);
        return t;
      }
      t = random_values(s, spec, gen);
      break;
    case Layout::expanded:
      if (nd >= 1) {
        Shape one = s;
        one[0] = 1;
        return random_values(one, spec, gen).to(device).expand(s);
      }
      t = random_values(s, spec, gen);
      break;
  }
  return t.to(device);
}

double default_rtol(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-10;
    case DType::f32: return 1e-5;
    case DType::bf16: return 1.6e-2;
    case DType::f16: return 2e-3;
    default: return 0.0;
  }
}
double default_atol(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-6;
    case DType::bf16: return 1e-2;
    case DType::f16: return 1e-3;
    default: return 0.0;
  }
}

namespace {
::testing::AssertionResult compare(const Shape& got_shape, DType got_dtype, const std::vector<double>& g,
                                   const Shape& want_shape, DType want_dtype, const std::vector<double>& w,
                                   double rtol, double atol) {
  if (got_shape != want_shape) {
    return ::testing::AssertionFailure() << "shape " << shape_str(got_shape) << " != expected "
                                         << shape_str(want_shape);
  }
  if (got_dtype != want_dtype) {
    return ::testing::AssertionFailure() << "dtype " << dtype_name(got_dtype) << " != expected "
                                         << dtype_name(want_dtype);
  }
  int bad = 0;
  std::ostringstream os;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double a = g[i], b = w[i];
    bool ok;
    if (std::isnan(b)) ok = std::isnan(a);
    else if (std::isinf(b)) ok = a == b;
    else ok = std::fabs(a - b) <= atol + rtol * std::fabs(b);
    if (!ok && bad++ < 5) os << "\n  [" << i << "] got " << a << ", expected " << b;
  }
  if (bad) {
    return ::testing::AssertionFailure() << bad << " of " << g.size() << " elements differ (rtol " << rtol
                                         << ", atol " << atol << ")" << os.str();
  }
  return ::testing::AssertionSuccess();
}
}  // namespace

::testing::AssertionResult all_close(const Tensor& got, const RefTensor& want, double rtol, double atol) {
  return compare(got.sizes(), got.dtype(), got.to_vec<double>(), want.shape, want.dtype, want.v, rtol, atol);
}
::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double rtol, double atol) {
  return compare(got.sizes(), got.dtype(), got.to_vec<double>(), want.sizes(), want.dtype(),
                 want.to_vec<double>(), rtol, atol);
}

std::string unique_temp_path(const std::string& stem, const std::string& ext) {
  static std::atomic<int64_t> counter{0};
  std::string dir = ::testing::TempDir();
  if (!dir.empty() && dir.back() != '/') dir += '/';
  return dir + "flame_" + stem + "_" + std::to_string(static_cast<long>(::getpid())) + "_" +
         std::to_string(counter.fetch_add(1)) + ext;
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "error message '" << msg << "' lacks '" << p << "'";
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected flame::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected flame::Error, nothing was thrown";
}

::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return ::testing::AssertionFailure() << what << ": shape/dtype differ";
  const std::vector<double> x = a.to_vec<double>(), y = b.to_vec<double>();
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::memcmp(&x[i], &y[i], sizeof(double)) != 0 && !(std::isnan(x[i]) && std::isnan(y[i])))
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << x[i] << " vs " << y[i];
  }
  return ::testing::AssertionSuccess();
}

std::string start_trace(profiler::KernelTrace& trace) {
  try {
    trace.start();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace flame::test
