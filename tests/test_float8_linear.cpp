// The 8-bit float Linear (Note [Float8 Linear] in flame/nn/float8.h):
//  - Float8Rows.*: the per-row scaled cast against the composite of float8_scale and to_float8 (the
//    same bits: every dtype, with and without a column factor, zero / NaN / huge rows, row lengths
//    that take the vector and the scalar kernels), and the per-row dequantisation against q * s.
//  - Float8Linear.*: functional::linear_float8 in both compute modes, forward and backward, against
//    f64 references written here from the definition (dequantize: x W^T with W = q s; fp8: the
//    per-row quantised x times q, the scales after; the backward's per-row cast of dy * s), under
//    autocast, with bad inputs; nn::Linear::to_float8 and quantize_float8 with LoRA adapters, state
//    dicts and the checks that keep an 8-bit weight frozen.
// FLAME_TEST_DEVICE=cuda runs them on the GPU: there fp8 goes through cuBLASLt's FP8 GEMM
// (Float8Linear.Fp8GemmRunsOnTheGpu says whether the device has one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "flame/amp.h"
#include "flame/flame.h"
#include "flame/io/safetensors.h"
#include "flame/nn.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Values of t as f32 on the host.
std::vector<float> host(const Tensor& t) { return t.to(DType::f32).to(Device::cpu()).contiguous().to_vec<float>(); }
std::vector<double> host64(const Tensor& t) {
  return t.to(DType::f64).to(Device::cpu()).contiguous().to_vec<double>();
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < got.size() && bad < 5; ++i) {
    const bool same = (std::isnan(got[i]) && std::isnan(want[i])) || bits_of(got[i]) == bits_of(want[i]);
    if (!same) {
      ++bad;
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
}

// Rows of x with the special cases at fixed places: row 1 all zeros, row 2 one NaN, row 3 huge.
Tensor special_rows(int64_t rows, int64_t cols, DType dt, uint64_t seed) {
  Tensor x = make_input({{rows, cols}, DType::f32, Layout::contiguous, -3.0, 3.0}, Device::cpu(), seed);
  std::vector<float> v = x.to_vec<float>();
  if (rows > 1)
    for (int64_t c = 0; c < cols; ++c) v[cols + c] = 0.0f;
  if (rows > 2) v[2 * cols + cols / 2] = std::nanf("");
  if (rows > 3)
    for (int64_t c = 0; c < cols; ++c) v[3 * cols + c] *= 1e4f;
  return Tensor::from_vec(v, {rows, cols}).to(dt);
}

TEST(Float8Rows, QuantizeMatchesTheComposite) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (int64_t cols : {64, 37, 3072, 20000}) {  // CUDA: vector and scalar row kernels, short and long rows
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      for (DType f8 : kFloat8DTypes) {
        for (bool with_col : {false, true}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " -> " + dtype_name(f8) + " cols " + std::to_string(cols) +
                       (with_col ? " with col" : ""));
          const Tensor x = special_rows(6, cols, dt, 11 + cols).to(dev);
          const Tensor col =
              with_col ? make_input({{cols}, DType::f32, Layout::contiguous, 0.01, 2.0}, dev, 5) : Tensor();
          const auto [q, s] = float8_quantize_rows(x, f8, col);
          ASSERT_EQ(q.dtype(), f8);
          ASSERT_EQ(q.sizes(), x.sizes());
          ASSERT_EQ(s.sizes(), Shape({6}));
          ASSERT_EQ(s.dtype(), DType::f32);
          // The composite: the same f32 math through the public ops (run on the CPU).
          const Tensor xf = x.to(Device::cpu()).to(DType::f32);
          const Tensor v = with_col ? xf * col.to(Device::cpu()) : xf;
          const Tensor ws = float8_scale(v, f8, 0);
          const Tensor wq = to_float8(v, f8, ws);
          expect_same_bits(host(s), host(ws.reshape({6})), "scale");
          expect_same_bits(host(q), host(wq), "q");
          const std::vector<float> sv = host(s);
          EXPECT_EQ(sv[1], 1.0f) << "an all-zero row gets scale 1";
          EXPECT_TRUE(std::isnan(sv[2])) << "a row with a NaN gets a NaN scale";
        }
      }
    }
  }
}

TEST(Float8Rows, QuantizeKeepsLeadingDimsAndRejectsBadInput) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = make_input({{2, 3, 32}, DType::bf16}, dev, 3);
  const auto [q, s] = float8_quantize_rows(x, DType::f8_e4m3fn);
  EXPECT_EQ(q.sizes(), Shape({2, 3, 32}));
  EXPECT_EQ(s.sizes(), Shape({2, 3}));
  // Every row's largest magnitude lands on 448.
  const std::vector<float> qv = host(q.to(DType::f32).reshape({6, 32}).abs().max({1}));
  for (float m : qv) EXPECT_EQ(m, 448.0f);
  EXPECT_THROW(float8_quantize_rows(x, DType::bf16), Error);
  EXPECT_THROW(float8_quantize_rows(x.to(DType::i32), DType::f8_e4m3fn), Error);
  EXPECT_THROW(float8_quantize_rows(x, DType::f8_e4m3fn, Tensor::ones({31}, TensorOptions(DType::f32, dev))), Error);
}

TEST(Float8Rows, DequantizeMatchesTheProduct) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (int64_t cols : {64, 13}) {
    for (DType f8 : kFloat8DTypes) {
      for (DType out : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
        SCOPED_TRACE(std::string(dtype_name(f8)) + " -> " + dtype_name(out) + " cols " + std::to_string(cols));
        const Tensor w = make_input({{5, cols}, DType::f32}, dev, 21);
        const Tensor s = float8_scale(w, f8, 0);
        const Tensor q = to_float8(w, f8, s);
        const Tensor got = from_float8(q, s, out);  // per-row: the fused pass
        const Tensor want = (q.to(Device::cpu()).to(DType::f32) * s.to(Device::cpu())).to(out);
        expect_same_bits(host(got), host(want), "per row");
        const Tensor s0 = Tensor::full({}, 0.37, TensorOptions(DType::f32, dev));
        const Tensor got0 = from_float8(q, s0, out);
        const Tensor want0 = (q.to(Device::cpu()).to(DType::f32) * 0.37f).to(out);
        expect_same_bits(host(got0), host(want0), "one scale");
      }
    }
  }
}

// ---- references in f64 ----
struct Case {
  Tensor x, q, s, b;  // x [rows, in] (or more dims), q [out, in] f8, s f32 [out], b [out]
};

Case make_case(Device dev, DType xdt, int64_t rows, int64_t in, int64_t out, bool bias, uint64_t seed) {
  Case c;
  const Tensor w = make_input({{out, in}, DType::f32, Layout::contiguous, -0.5, 0.5}, dev, seed);
  c.s = float8_scale(w, DType::f8_e4m3fn, 0).reshape({out});
  c.q = to_float8(w, DType::f8_e4m3fn, c.s.unsqueeze(1));
  c.x = make_input({{rows, in}, xdt, Layout::contiguous, -2.0, 2.0}, dev, seed + 1);
  if (bias) c.b = make_input({{out}, xdt, Layout::contiguous, -1.0, 1.0}, dev, seed + 2);
  return c;
}

// W = q * s [out, in] (row-major), rounded to dt as dequantize mode rebuilds it (f64 keeps it exact).
std::vector<double> dense_ref(const Case& c, DType dt = DType::f64) {
  const std::vector<double> q = host64(c.q), s = host64(c.s);
  const int64_t out = c.q.size(0), in = c.q.size(1);
  std::vector<double> w(q.size());
  for (int64_t o = 0; o < out; ++o)
    for (int64_t k = 0; k < in; ++k) w[o * in + k] = q[o * in + k] * s[o];
  if (dt == DType::f64) return w;
  std::vector<float> wf(w.begin(), w.end());  // q * s in f32, as the kernel, then dt's rounding
  for (int64_t o = 0; o < out; ++o)
    for (int64_t k = 0; k < in; ++k) wf[o * in + k] = static_cast<float>(q[o * in + k]) * static_cast<float>(s[o]);
  return host64(Tensor::from_vec(wf, {out, in}).to(dt));
}

// a [M, K] times b [N, K]^T, f64.
std::vector<double> mm_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t N, int64_t K) {
  std::vector<double> y(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc += a[m * K + k] * b[n * K + k];
      y[m * N + n] = acc;
    }
  return y;
}

// The per-row quantised values of x (x rows times their scales), f64.
std::vector<double> rows_dequantised(const Tensor& x, const Tensor& col, DType f8) {
  const auto [q, s] = float8_quantize_rows(x, f8, col);
  const std::vector<double> qv = host64(q), sv = host64(s);
  const int64_t cols = x.size(-1);
  std::vector<double> v(qv.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = qv[i] * sv[i / cols];
  return v;
}

// |got - want| <= atol + rtol |want| (+ mag_tol * mag[i] when mag is given: a bound relative to the
// sum of the products' magnitudes, for GEMMs whose accumulation is coarser than f32).
void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double rtol, double atol,
                     const std::string& what, const std::vector<double>* mag = nullptr, double mag_tol = 0.0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < got.size() && bad < 5; ++i) {
    const double extra = mag ? mag_tol * (*mag)[i] : 0.0;
    if (!(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i]) + extra)) {
      ++bad;
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
}

// Output tolerance: the result's rounding (bf16: 2^-8 relative) plus f32 summation; the bf16 bias
// add rounds twice (x W^T, then + b), up to two bf16 steps of values near 1.
double rtol_of(DType dt) { return dt == DType::bf16 ? 8e-3 : dt == DType::f16 ? 1e-3 : 1e-5; }
double atol_of(DType dt) { return dt == DType::bf16 ? 4e-3 : 1e-4; }

TEST(Float8Linear, ForwardAndBackwardMatchTheReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t rows = 24, in = 64, out = 48;
  for (nn::Float8Compute mode : {nn::Float8Compute::dequantize, nn::Float8Compute::fp8}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (DType gdt : {DType::f8_e4m3fn, DType::f8_e5m2}) {
        if (mode == nn::Float8Compute::dequantize && gdt == DType::f8_e5m2) continue;
        for (bool bias : {true, false}) {
          SCOPED_TRACE(std::string(nn::float8_compute_name(mode)) + " " + dtype_name(dt) + " grad " +
                       dtype_name(gdt) + (bias ? " bias" : ""));
          // Hopper's FP8 tensor cores add the products with about 14 mantissa bits, not f32's 24, so
          // an FP8 GEMM's error is bounded relative to the sum of the products' magnitudes (it can be
          // far above |y| where the products cancel): 2^-11 of that sum there (the CPU's reference
          // sums in f32).
          const bool fp8_gemm = mode == nn::Float8Compute::fp8 && nn::float8_gemm_supported(dev);
          const double rtol = rtol_of(dt), mag_tol = fp8_gemm ? std::ldexp(1.0, -11) : 0.0;
          auto abs_of = [](std::vector<double> v) {
            for (double& e : v) e = std::fabs(e);
            return v;
          };
          Case c = make_case(dev, dt, rows, in, out, bias, 40);
          Tensor x = c.x.clone().requires_grad_(true);
          Tensor b = bias ? c.b.clone().requires_grad_(true) : Tensor();
          const Tensor y = F::linear_float8(x, c.q, c.s, b, mode, gdt);
          ASSERT_EQ(y.dtype(), dt);
          ASSERT_EQ(y.sizes(), Shape({rows, out}));
          // forward
          const std::vector<double> w = dense_ref(c, mode == nn::Float8Compute::dequantize ? dt : DType::f64);
          const std::vector<double> xin =
              mode == nn::Float8Compute::fp8 ? rows_dequantised(c.x, Tensor(), DType::f8_e4m3fn) : host64(c.x);
          std::vector<double> want = mm_nt(xin, w, rows, out, in);
          const std::vector<double> y_mag = mm_nt(abs_of(xin), abs_of(w), rows, out, in);
          if (bias) {
            const std::vector<double> bv = host64(c.b);
            for (int64_t i = 0; i < rows * out; ++i) want[i] += bv[i % out];
          }
          expect_near_all(host64(y), want, rtol, atol_of(dt), "y", &y_mag, mag_tol);
          // backward of sum(y * gy)
          const Tensor gy = make_input({{rows, out}, dt, Layout::contiguous, -1.0, 1.0}, dev, 77);
          Gradients g = (y * gy).sum().backward();
          std::vector<double> gin;
          if (mode == nn::Float8Compute::fp8) {
            gin = rows_dequantised(gy, c.s, gdt);  // rows of dy * s, per-row quantised
            std::vector<double> qv = host64(c.q);  // dx = (dy s)_q q
            std::vector<double> qt(in * out);
            for (int64_t o = 0; o < out; ++o)
              for (int64_t k = 0; k < in; ++k) qt[k * out + o] = qv[o * in + k];
            const std::vector<double> dx = mm_nt(gin, qt, rows, in, out);
            const std::vector<double> dx_mag = mm_nt(abs_of(gin), abs_of(qt), rows, in, out);
            expect_near_all(host64(g.get(x)), dx, rtol, atol_of(dt), "dx", &dx_mag, mag_tol);
          } else {
            gin = host64(gy);
            std::vector<double> wt(in * out);
            for (int64_t o = 0; o < out; ++o)
              for (int64_t k = 0; k < in; ++k) wt[k * out + o] = w[o * in + k];
            expect_near_all(host64(g.get(x)), mm_nt(gin, wt, rows, in, out), rtol, atol_of(dt), "dx");
          }
          if (bias) {
            const std::vector<double> gv = host64(gy);
            std::vector<double> db(out, 0.0);
            for (int64_t i = 0; i < rows * out; ++i) db[i % out] += gv[i];
            expect_near_all(host64(g.get(b)), db, rtol, atol_of(dt), "dbias");
          }
        }
      }
    }
  }
}

// fp8 is close to the full-precision linear: per-row e4m3 keeps about 2^-4 relative per value, and
// the errors average out over the dot products.
TEST(Float8Linear, Fp8IsCloseToTheFullPrecisionLinear) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t rows = 64, in = 256, out = 128;
  const Tensor w = make_input({{out, in}, DType::f32, Layout::contiguous, -0.1, 0.1}, dev, 90);
  const Tensor x = make_input({{rows, in}, DType::f32}, dev, 91);
  const Tensor s = float8_scale(w, DType::f8_e4m3fn, 0);
  const Tensor q = to_float8(w, DType::f8_e4m3fn, s);
  const Tensor ref = F::linear(x, w);
  for (nn::Float8Compute mode : {nn::Float8Compute::dequantize, nn::Float8Compute::fp8}) {
    const Tensor y = F::linear_float8(x, q, s, Tensor(), mode);
    const double rel = ((y - ref).pow(2.0).sum() / ref.pow(2.0).sum()).sqrt().item<double>();
    EXPECT_LT(rel, mode == nn::Float8Compute::fp8 ? 0.06 : 0.04) << nn::float8_compute_name(mode);
    EXPECT_GT(rel, 1e-4) << "an 8-bit weight cannot be exact";
  }
}

// A column block of a wider 8-bit weight (w.narrow(1, start, n), as FLUX's single blocks split
// proj_out) is read in place: the same bits as the block copied out, in both modes, forward and
// backward (fp8's forward on a GPU: within one bf16 rounding, below). Rows 16 bytes apart take the
// strided kernels (a wide block the row-per-grid-row dequantisation, a narrow one the element-wise
// one, fp8 the GEMM with b's row stride); rows that are not (a pitch of 1090) are copied first.
TEST(Float8Linear, ColumnBlocksOfAWiderWeightGiveTheBlocksBits) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t rows = 20, out = 24;
  for (int64_t total : {int64_t{1088}, int64_t{1090}}) {
    const Tensor w = make_input({{out, total}, DType::f32, Layout::contiguous, -0.2, 0.2}, dev, 120);
    const Tensor s = float8_scale(w, DType::f8_e4m3fn, 0);
    const Tensor q = to_float8(w, DType::f8_e4m3fn, s);
    const Tensor bias = make_input({{out}, DType::bf16}, dev, 121);
    for (const auto& [start, n] : {std::pair<int64_t, int64_t>{64, 1024}, {0, 64}}) {
      const Tensor block = q.narrow(1, start, n);
      ASSERT_FALSE(block.is_contiguous());
      const Tensor copy = block.contiguous();
      for (nn::Float8Compute mode : {nn::Float8Compute::dequantize, nn::Float8Compute::fp8}) {
        SCOPED_TRACE("pitch " + std::to_string(total) + ", columns " + std::to_string(start) + "+" +
                     std::to_string(n) + ", " + nn::float8_compute_name(mode));
        const Tensor x0 = make_input({{rows, n}, DType::bf16}, dev, 122);
        const Tensor gy = make_input({{rows, out}, DType::bf16}, dev, 123);
        auto run = [&](const Tensor& weight, Tensor& dx) {
          Tensor x = x0.clone().requires_grad_(true);
          const Tensor y = F::linear_float8(x, weight, s, bias, mode);
          dx = (y * gy).sum().backward().get(x);
          return y;
        };
        Tensor dx_block, dx_copy;
        const Tensor y_block = run(block, dx_block), y_copy = run(copy, dx_copy);
        if (mode == nn::Float8Compute::fp8 && nn::float8_gemm_supported(dev)) {
          // cuBLASLt may pick another algorithm for b's other row stride and alignment (another
          // order of the f32 sums): one bf16 rounding apart at most.
          const std::vector<float> a = host(y_block), b = host(y_copy);
          float big = 0.0f;
          for (float v : b) big = std::max(big, std::fabs(v));
          for (std::size_t i = 0; i < a.size(); ++i)
            ASSERT_LE(std::fabs(a[i] - b[i]), std::ldexp(big, -7)) << "y " << i;
        } else {
          expect_same_bits(host(y_block), host(y_copy), "y");
        }
        expect_same_bits(host(dx_block), host(dx_copy), "dx");
      }
    }
  }
}

// Note [Float8 input reuse]: Linears reading one input reuse its 8-bit cast; an in-place write to
// the input, another view of its storage, or a new tensor in freed memory casts again. Each result
// must have the bits of the same call on a fresh copy of its input (which always casts).
TEST(Float8Linear, Fp8ReusesTheInputCastOnlyWhileTheInputIsUnchanged) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const nn::Float8Compute fp8 = nn::Float8Compute::fp8;
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Case a = make_case(dev, dt, 24, 64, 48, true, 60), b = make_case(dev, dt, 24, 64, 32, false, 61);
    // The same call on a copy of x, after a cast of another shape has replaced the kept one.
    const Case other = make_case(dev, dt, 2, 16, 8, false, 64);
    auto fresh = [&](const Tensor& x, const Case& c) {
      (void)F::linear_float8(other.x, other.q, other.s, other.b, fp8);
      return host(F::linear_float8(x.clone(), c.q, c.s, c.b, fp8));
    };
    Tensor x = a.x.clone();
    const std::vector<float> ya = host(F::linear_float8(x, a.q, a.s, a.b, fp8));
    const std::vector<float> yb = host(F::linear_float8(x, b.q, b.s, b.b, fp8));  // the cast of x again
    expect_same_bits(ya, fresh(x, a), "first Linear");
    expect_same_bits(yb, fresh(x, b), "second Linear on the same input");
    // Each check below first casts x (the entry), then makes the change, then calls again before
    // anything else casts; fresh() comes last.
    // An in-place write: the next call must see the new values.
    (void)F::linear_float8(x, b.q, b.s, b.b, fp8);
    {
      NoGradGuard no_grad;
      x.mul_(-3.0);
    }
    const std::vector<float> yb2 = host(F::linear_float8(x, b.q, b.s, b.b, fp8));
    expect_same_bits(yb2, fresh(x, b), "after an in-place write");
    EXPECT_NE(yb2, yb);
    // Two views of one storage with one shape at different offsets.
    const Tensor both = cat({x, x * 2.0}, 0);
    (void)F::linear_float8(both.narrow(0, 0, 24), b.q, b.s, b.b, fp8);
    const Tensor second = both.narrow(0, 24, 24);
    const std::vector<float> yt = host(F::linear_float8(second, b.q, b.s, b.b, fp8));
    expect_same_bits(yt, fresh(second, b), "a view at an offset");
    // A shorter view at the same offset.
    (void)F::linear_float8(x, b.q, b.s, b.b, fp8);
    const Tensor head = x.narrow(0, 0, 12);
    const std::vector<float> yh = host(F::linear_float8(head, b.q, b.s, b.b, fp8));
    expect_same_bits(yh, fresh(head, b), "a shorter view");
    // A new tensor in the memory of a freed one.
    std::vector<float> yn;
    {
      const Tensor y0 = make_input({{24, 64}, dt, Layout::contiguous, -2.0, 2.0}, dev, 62);
      (void)F::linear_float8(y0, b.q, b.s, b.b, fp8);
    }
    const Tensor y1 = make_input({{24, 64}, dt, Layout::contiguous, -2.0, 2.0}, dev, 63);
    yn = host(F::linear_float8(y1, b.q, b.s, b.b, fp8));
    expect_same_bits(yn, fresh(y1, b), "a new input");
  }
}

TEST(Float8Linear, LeadingDimsAutocastAndOneScale) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Case c = make_case(dev, DType::f32, 12, 32, 16, true, 50);
  const Tensor x3 = c.x.reshape({2, 6, 32});
  for (nn::Float8Compute mode : {nn::Float8Compute::dequantize, nn::Float8Compute::fp8}) {
    const Tensor y3 = F::linear_float8(x3, c.q, c.s, c.b, mode);
    EXPECT_EQ(y3.sizes(), Shape({2, 6, 16}));
    expect_near_all(host64(y3.reshape({12, 16})), host64(F::linear_float8(c.x, c.q, c.s, c.b, mode)), 1e-6, 1e-6,
                    "leading dims");
    {
      auto ac = amp::autocast(DType::bf16, dev.type);
      const Tensor yl = F::linear_float8(c.x, c.q, c.s, c.b, mode);
      EXPECT_EQ(yl.dtype(), DType::bf16) << "autocast casts x and the bias";
    }
    // One scale for the whole weight: the same as that value repeated per row.
    const Tensor one = Tensor::full({}, 0.01, TensorOptions(DType::f32, dev));
    expect_near_all(host64(F::linear_float8(c.x, c.q, one, c.b, mode)),
                    host64(F::linear_float8(c.x, c.q, one.expand({16}).contiguous(), c.b, mode)), 1e-6, 1e-6,
                    "0-d scale");
  }
}

TEST(Float8Linear, BadInputsNameTheOp) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Case c = make_case(dev, DType::f32, 4, 32, 16, true, 60);
  auto expect_error = [&](auto&& fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "no error (expected one mentioning '" << part << "')";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("linear_float8"), std::string::npos) << m;
      EXPECT_NE(m.find(part), std::string::npos) << m;
    }
  };
  expect_error([&] { F::linear_float8(c.x.narrow(1, 0, 31), c.q, c.s); }, "in_features = 32");
  expect_error([&] { F::linear_float8(c.x, c.q.to(DType::bf16), c.s); }, "8-bit float");
  expect_error([&] { F::linear_float8(c.x, c.q, c.s.narrow(0, 0, 15)); }, "one value per output row");
  expect_error([&] { F::linear_float8(c.x, c.q, c.s, c.b.narrow(0, 0, 8)); }, "bias");
  expect_error([&] { F::linear_float8(c.x.to(DType::i32), c.q, c.s); }, "floating");
  expect_error([&] { F::linear_float8(c.x, c.q, c.s, c.b, nn::Float8Compute::fp8, DType::bf16); }, "grad_dtype");
  EXPECT_THROW(nn::parse_float8_compute("fp4"), Error);
  EXPECT_EQ(nn::parse_float8_compute("fp8"), nn::Float8Compute::fp8);
  EXPECT_EQ(nn::parse_float8_compute("dequantize"), nn::Float8Compute::dequantize);
}

TEST(Float8Linear, LinearModuleWithLoraTrainsTheAdapterOnly) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  manual_seed(3);
  for (nn::Float8Compute mode : {nn::Float8Compute::dequantize, nn::Float8Compute::fp8}) {
    SCOPED_TRACE(nn::float8_compute_name(mode));
    auto lin = std::make_shared<nn::Linear>(64, 32, true, TensorOptions(DType::f32, dev));
    const Tensor w_before = lin->weight().clone();
    const Tensor x = make_input({{8, 64}, DType::f32}, dev, 4);
    const Tensor y_full = lin->forward(x);
    // An 8-bit weight is frozen: a trainable one is refused.
    EXPECT_THROW(lin->to_float8({.compute = mode}), Error);
    nn::apply_lora(*lin, nn::LoraOptions{.rank = 4, .alpha = 4.0}, {""});
    EXPECT_FALSE(lin->weight().requires_grad());
    const nn::Float8Report rep = nn::quantize_float8(*lin, {.compute = mode});
    EXPECT_EQ(rep.layers, 1) << "the adapter's own Linears are left alone";
    EXPECT_EQ(rep.bytes_before, 64 * 32 * 4);
    EXPECT_EQ(rep.bytes_after, 64 * 32 + 32 * 4);
    ASSERT_TRUE(lin->is_float8());
    EXPECT_EQ(lin->weight().dtype(), DType::f8_e4m3fn);
    EXPECT_EQ(lin->weight_scale().sizes(), Shape({32}));
    EXPECT_EQ(lin->lora_A()->weight().dtype(), DType::f32);
    // The state dict carries the 8-bit weight and its scales; to(dtype) leaves them as they are.
    const StateDict sd = lin->state_dict();
    EXPECT_TRUE(sd.contains("weight_scale"));
    EXPECT_EQ(sd.at("weight").dtype(), DType::f8_e4m3fn);
    lin->to(DType::f32);
    EXPECT_EQ(lin->weight().dtype(), DType::f8_e4m3fn);
    // The dequantised weight is the original within e4m3's half step (2^-4 relative per row max).
    const Tensor err = (lin->dense_weight(DType::f32) - w_before).abs().max();
    EXPECT_LE(err.item<double>(), w_before.abs().max().item<double>() / 16.0);
    // B starts at zero: the output is the 8-bit base's.
    const Tensor y = lin->forward(x);
    EXPECT_LT(((y - y_full).pow(2.0).sum() / y_full.pow(2.0).sum()).sqrt().item<double>(), 0.06);
    Gradients g = y.pow(2.0).sum().backward();
    EXPECT_TRUE(g.contains(lin->lora_A()->weight()));
    EXPECT_TRUE(g.contains(lin->lora_B()->weight()));
    EXPECT_FALSE(g.contains(lin->weight()));
    EXPECT_THROW(lin->merge(), Error);
    EXPECT_THROW(lin->to_float8({.dtype = DType::f8_e5m2}), Error);  // no requantising
    lin->to_float8({.compute = nn::Float8Compute::dequantize});       // a new compute mode is fine
    EXPECT_EQ(lin->float8_options().compute, nn::Float8Compute::dequantize);
  }
}

// An 8-bit Linear's state dict through a safetensors file: the weight as F8_E4M3 and its scales,
// read back into another quantised Linear (the codes read as their own dtype, by hand or through
// nn::load_state_dict): the same codes and the same outputs.
TEST(Float8Linear, StateDictThroughSafetensors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const std::string path = testing::TempDir() + "/float8_linear.safetensors";
  auto a = std::make_shared<nn::Linear>(32, 16, true, TensorOptions(DType::f32, dev));
  a->requires_grad_(false);
  a->to_float8();
  io::save_safetensors(path, a->state_dict());
  const StateDict loaded = io::load_safetensors(path, dev, DType::f8_e4m3fn);
  EXPECT_EQ(loaded.at("weight").dtype(), DType::f8_e4m3fn);
  auto b = std::make_shared<nn::Linear>(32, 16, true, TensorOptions(DType::f32, dev));
  b->requires_grad_(false);
  b->to_float8();
  StateDict sd = io::load_safetensors(path, dev);  // scales and bias as f32
  sd.set("weight", loaded.at("weight"));  // the codes read as their own dtype
  b->load_state_dict(sd);
  EXPECT_EQ(host(b->weight()), host(a->weight()));
  EXPECT_EQ(host(b->weight_scale()), host(a->weight_scale()));
  const Tensor x = make_input({{4, 32}, DType::f32}, dev, 12);
  EXPECT_EQ(host(b->forward(x)), host(a->forward(x)));
  auto c = std::make_shared<nn::Linear>(32, 16, true, TensorOptions(DType::f32, dev));
  c->requires_grad_(false);
  c->to_float8();
  nn::load_state_dict(*c, path);  // the file helper keeps F8 codes for 8-bit weights
  EXPECT_EQ(host(c->weight()), host(a->weight()));
  EXPECT_EQ(host(c->forward(x)), host(a->forward(x)));
  // Module::load_state_dict itself wants the module's dtype: a decoded (f32) weight is refused by name.
  try {
    c->load_state_dict(io::load_safetensors(path, dev));
    ADD_FAILURE() << "an f32 weight loaded into the 8-bit one";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'weight'"), std::string::npos) << e.what();
  }
}

// An adapter added after quantising gets f32 weights (not the 8-bit dtype); DoRA reads the
// dequantised weight for its norms.
TEST(Float8Linear, AdaptersAddedAfterQuantising) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto lin = std::make_shared<nn::Linear>(32, 16, false, TensorOptions(DType::f32, dev));
  lin->requires_grad_(false);
  lin->to_float8();
  lin->add_lora(nn::LoraOptions{.rank = 2, .alpha = 2.0, .use_dora = true});
  EXPECT_EQ(lin->lora_A()->weight().dtype(), DType::f32);
  const Tensor m = lin->lora_magnitude_vector();
  expect_near_all(host64(m), host64(lin->dense_weight(DType::f32).norm(2.0, {1})), 1e-6, 1e-6, "DoRA magnitude");
  const Tensor x = make_input({{4, 32}, DType::f32}, dev, 8);
  // DoRA at start (B = 0) is the base output.
  expect_near_all(host64(lin->forward(x)),
                  host64(F::linear_float8(x, lin->weight(), lin->weight_scale())), 1e-5, 1e-5, "DoRA at init");
}

TEST(Float8Linear, Fp8GemmRunsOnTheGpu) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  if (!dev.is_cuda()) {
    EXPECT_FALSE(nn::float8_gemm_supported(dev));
    GTEST_SKIP() << "the FP8 GEMM is CUDA's; on the CPU fp8 runs the f32 reference";
  }
  const bool ok = nn::float8_gemm_supported(dev);
  if (!ok) GTEST_SKIP() << "this GPU has no FP8 GEMM (compute capability below 8.9)";
  // A Linear-sized case through the GEMM against the f32 reference of the same quantised values.
  Case c = make_case(dev, DType::bf16, 256, 512, 384, true, 70);
  const Tensor y = F::linear_float8(c.x, c.q, c.s, c.b, nn::Float8Compute::fp8);
  std::printf("[ info ] FP8 GEMM on %s: %s\n", dev.str().c_str(), nn::float8_gemm_path(dev));
  const Tensor yc = F::linear_float8(c.x.to(Device::cpu()), c.q.to(Device::cpu()), c.s.to(Device::cpu()),
                                     c.b.to(Device::cpu()), nn::Float8Compute::fp8);
  expect_near_all(host64(y), host64(yc), 8e-3, 1.5e-2, "GPU FP8 GEMM against the CPU reference");
  // The backward's GEMM (dy * s cast per row, against the transposed weight) the same way.
  for (DType gdt : {DType::f8_e4m3fn, DType::f8_e5m2}) {
    SCOPED_TRACE(dtype_name(gdt));
    const Tensor gy = make_input({{256, 384}, DType::bf16, Layout::contiguous, -1.0, 1.0}, dev, 71);
    Tensor xg = c.x.clone().requires_grad_(true);
    Tensor xc = c.x.to(Device::cpu()).requires_grad_(true);
    Gradients g = (F::linear_float8(xg, c.q, c.s, c.b, nn::Float8Compute::fp8, gdt) * gy).sum().backward();
    Gradients gc = (F::linear_float8(xc, c.q.to(Device::cpu()), c.s.to(Device::cpu()), c.b.to(Device::cpu()),
                                     nn::Float8Compute::fp8, gdt) *
                    gy.to(Device::cpu()))
                       .sum()
                       .backward();
    expect_near_all(host64(g.get(xg)), host64(gc.get(xc)), 8e-3, 1.5e-2, "dx on the GPU against the CPU reference");
  }
}

}  // namespace
}  // namespace flame::test
