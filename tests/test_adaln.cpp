// The fused adaLN ops (Note [adaLN ops] in src/ops/adaln.cpp): F::layer_norm_modulate and
// F::gated_residual (and F::gated_residual_modulate, the two in one).
//  - AdalnOps.*: forward and every gradient on the device under test (FLAME_TEST_DEVICE) in
//    f32 / bf16 / f16 and the autocast mix (f32 x, bf16 modulation) against a float64 CPU
//    reference written here with plain ops (mean, square, sqrt: not the ops under test), from the
//    same rounded inputs; shapes the CUDA kernels take (D % 4 == 0, D <= 6144 in rows of one, two
//    and four warps; one block per batch and batches split in slices) and ones they decline (odd D,
//    D > 6144); modulation given as strided chunks of one projection; 4-d inputs.
//  - AdalnRule.*: which path ran (CUDA: one fused node each).
//  - AdalnGradcheck.*: float64 finite differences on the CPU.
//  - AdalnAutocast.*, AdalnErrors.*.
#include <cmath>
#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include "flame/amp.h"
#include "flame/autograd.h"
#include "flame/nn.h"
#include "engine_detail.h"
#include "gradcheck.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;

Tensor rnd(const Shape& s, uint64_t seed, double mean = 0.0, double stddev = 1.0) {
  Generator g(seed);
  return Tensor::randn(s, mean, stddev, DType::f64, &g);
}


double tol_for(DType dt) {
  switch (dt) {
    case DType::bf16: return 2e-2;
    case DType::f16: return 4e-3;
    case DType::f32: return 2e-5;
    default: return 1e-10;
  }
}

// [B, D] -> [B, 1, ..., D] against x.
Tensor per_sample(const Tensor& m, const Tensor& x) {
  Shape s(static_cast<std::size_t>(x.dim()), 1);
  s.front() = m.size(0);
  s.back() = m.size(1);
  return m.reshape(s);
}

// The float64 reference: LayerNorm without affine from its definition, then the modulation.
Tensor ref_ln_mod(const Tensor& x, const Tensor& shift, const Tensor& scale, double eps) {
  const Tensor mean = x.mean({-1}, /*keepdim=*/true);
  const Tensor c = x - mean;
  const Tensor var = c.square().mean({-1}, true);
  return c / (var + eps).sqrt() * (per_sample(scale, x) + 1.0) + per_sample(shift, x);
}

struct Case {
  Shape x;  // [B, ..., D]
  const char* what;
};

// The modulation as the DiT makes it: chunks k of one [B, 3 * D] tensor (strided views).
struct Mod {
  Tensor leaf;  // [B, 3D], requires grad
  Tensor chunk(int k, int64_t d) const { return leaf.narrow(1, k * d, d); }
};

// dtype of x / of the modulation.
struct Dtypes {
  DType x, m;
};

void check_ln_mod(const Case& c, Dtypes dt, uint64_t seed) {
  SCOPED_TRACE(std::string(c.what) + " x " + dtype_name(dt.x) + " mod " + dtype_name(dt.m));
  const Device dev = test_device();
  const int64_t b = c.x.front(), d = c.x.back();
  const double eps = 1e-6;
  // Rounded once to the test dtypes; the reference reads the same values in float64.
  const Tensor x64 = rnd(c.x, seed, 0.5, 2.0).to(dt.x).to(DType::f64);
  const Tensor m64 = rnd({b, 3 * d}, seed + 1, 0.0, 0.5).to(dt.m).to(DType::f64);
  const DType out_dt = promote_types(dt.x, dt.m);
  const Tensor gy64 = rnd(c.x, seed + 2).to(out_dt).to(DType::f64);

  Tensor x = x64.to(dt.x).to(dev).requires_grad_(true);
  Mod mod{m64.to(dt.m).to(dev).requires_grad_(true)};
  Tensor y = F::layer_norm_modulate(x, mod.chunk(0, d), mod.chunk(1, d), eps);
  ASSERT_EQ(y.dtype(), out_dt);
  Gradients g = (y * gy64.to(out_dt).to(dev)).sum().backward();

  Tensor rx = x64.clone().requires_grad_(true), rm = m64.clone().requires_grad_(true);
  Tensor ry = ref_ln_mod(rx, rm.narrow(1, 0, d), rm.narrow(1, d, d), eps);
  Gradients rg = (ry * gy64).sum().backward();

  const double tol = tol_for(dt.x == DType::f32 ? dt.m : dt.x);
  EXPECT_TRUE(close_scaled(y, ry.detach(), tol)) << "y";
  EXPECT_TRUE(close_scaled(g.get(x), rg.get(rx), tol)) << "dx";
  // The modulation gradients are sums over the tokens: held to the same scaled tolerance.
  EXPECT_TRUE(close_scaled(g.get(mod.leaf), rg.get(rm), tol)) << "dshift/dscale";
}

const Case kLnCases[] = {
    {{3, 7, 384}, "DiT-S rows"},
    {{2, 300, 64}, "few batches, many rows (slices)"},
    {{300, 3, 32}, "many batches, few rows"},
    {{2, 5, 1152}, "DiT-XL width"},
    {{2, 3, 4, 96}, "4-d input"},
    {{2, 6, 30}, "D % 4 != 0 (composite)"},
    {{2, 4, 1536}, "one warp a row, the widest (48 KiB of accumulators)"},
    {{2, 3, 1600}, "D > 1536 (two warps a row)"},
    {{1, 70, 3072}, "FLUX width (two warps a row, slices)"},
    {{2, 9, 2432}, "SD3.5-Large width"},
    {{2, 5, 4100}, "four warps a row, a partial last chunk"},
    {{1, 3, 6148}, "D > 6144 (composite)"},
    {{4, 40}, "2-d input (one row per sample)"},
};

TEST(AdalnOps, LayerNormModulateF32) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 100;
  for (const Case& c : kLnCases) check_ln_mod(c, {DType::f32, DType::f32}, seed += 10);
}

TEST(AdalnOps, LayerNormModulateHalf) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 200;
  for (const Case& c : kLnCases) {
    check_ln_mod(c, {DType::bf16, DType::bf16}, seed += 10);
    check_ln_mod(c, {DType::f16, DType::f16}, seed += 10);
  }
}

TEST(AdalnOps, LayerNormModulateMixed) {  // an f32 residual stream with a half modulation
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 300;
  for (const Case& c : kLnCases) {
    check_ln_mod(c, {DType::f32, DType::bf16}, seed += 10);
    check_ln_mod(c, {DType::f32, DType::f16}, seed += 10);
  }
}

void check_gated(const Case& c, Dtypes dt, uint64_t seed) {
  SCOPED_TRACE(std::string(c.what) + " x " + dtype_name(dt.x) + " gate/y " + dtype_name(dt.m));
  const Device dev = test_device();
  const int64_t b = c.x.front(), d = c.x.back();
  const Tensor x64 = rnd(c.x, seed).to(dt.x).to(DType::f64);
  const Tensor y64 = rnd(c.x, seed + 1).to(dt.m).to(DType::f64);
  const Tensor m64 = rnd({b, 3 * d}, seed + 2).to(dt.m).to(DType::f64);
  const DType out_dt = promote_types(dt.x, dt.m);
  const Tensor go64 = rnd(c.x, seed + 3).to(out_dt).to(DType::f64);

  Tensor x = x64.to(dt.x).to(dev).requires_grad_(true);
  Tensor y = y64.to(dt.m).to(dev).requires_grad_(true);
  Mod mod{m64.to(dt.m).to(dev).requires_grad_(true)};
  Tensor o = F::gated_residual(x, mod.chunk(2, d), y);
  ASSERT_EQ(o.dtype(), out_dt);
  Gradients g = (o * go64.to(out_dt).to(dev)).sum().backward();

  Tensor rx = x64.clone().requires_grad_(true), ry = y64.clone().requires_grad_(true),
         rm = m64.clone().requires_grad_(true);
  Tensor ro = rx + per_sample(rm.narrow(1, 2 * d, d), rx) * ry;
  Gradients rg = (ro * go64).sum().backward();

  // The composite rounds gate * y to the half dtype before the add; the kernel does not.
  const double tol = tol_for(dt.m);
  EXPECT_TRUE(close_scaled(o, ro.detach(), tol)) << "out";
  EXPECT_TRUE(close_scaled(g.get(x), rg.get(rx), tol)) << "dx";
  EXPECT_TRUE(close_scaled(g.get(y), rg.get(ry), tol)) << "dy";
  EXPECT_TRUE(close_scaled(g.get(mod.leaf), rg.get(rm), tol)) << "dgate";
}

TEST(AdalnOps, GatedResidual) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 400;
  for (const Case& c : kLnCases) {
    check_gated(c, {DType::f32, DType::f32}, seed += 10);
    check_gated(c, {DType::f32, DType::bf16}, seed += 10);
    check_gated(c, {DType::bf16, DType::bf16}, seed += 10);
    check_gated(c, {DType::f16, DType::f16}, seed += 10);
  }
}

// F::gated_residual_modulate gives what its two ops give, values and gradients (on CUDA one kernel
// computes both outputs; the graph is the same two nodes), also under autocast.
void check_gated_modulate(const Case& c, Dtypes dt, bool autocast, uint64_t seed) {
  SCOPED_TRACE(std::string(c.what) + " x " + dtype_name(dt.x) + " mod " + dtype_name(dt.m) +
               (autocast ? " autocast" : ""));
  const Device dev = test_device();
  const int64_t b = c.x.front(), d = c.x.back();
  const Tensor x0 = rnd(c.x, seed, 0.5, 2.0).to(dt.x).to(dev);
  const Tensor br0 = rnd(c.x, seed + 1).to(dt.m).to(dev);
  const Tensor m0 = rnd({b, 3 * d}, seed + 2, 0.0, 0.5).to(dt.m).to(dev);
  auto run = [&](bool fused) {
    Tensor x = x0.detach().requires_grad_(true), br = br0.detach().requires_grad_(true);
    Tensor m = m0.detach().requires_grad_(true);
    Tensor h, y;
    {
      std::optional<amp::AutocastGuard> ac;
      if (autocast) ac.emplace(DType::bf16, dev.type);
      if (fused) {
        std::tie(h, y) = F::gated_residual_modulate(x, m.narrow(1, 0, d), br, m.narrow(1, d, d), m.narrow(1, 2 * d, d),
                                                    1e-6);
      } else {
        h = F::gated_residual(x, m.narrow(1, 0, d), br);
        y = F::layer_norm_modulate(h, m.narrow(1, d, d), m.narrow(1, 2 * d, d), 1e-6);
      }
    }
    const Tensor gy = rnd(c.x, seed + 3).to(y.dtype()).to(dev), gh = rnd(c.x, seed + 4).to(h.dtype()).to(dev);
    Gradients g = ((y * gy).sum().to(DType::f32) + (h * gh).sum().to(DType::f32)).backward();
    return TensorList{h, y, g.get(x), g.get(br), g.get(m)};
  };
  const TensorList want = run(false), got = run(true);
  const char* names[] = {"h", "y", "dx", "dbranch", "dmodulation"};
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].dtype(), want[i].dtype()) << names[i];
    // The gradients come from different kernels (Note [Fused residual backward]): the same math,
    // so up to one rounding of a half result (an ulp relative to the largest value).
    const DType dt = got[i].dtype();
    const double tol = dt == DType::bf16 ? 8e-3 : dt == DType::f16 ? 1e-3 : 1e-6;
    EXPECT_TRUE(close_scaled(got[i], want[i], tol)) << names[i];
  }
}

TEST(AdalnOps, GatedResidualModulate) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 450;
  for (const Case& c : kLnCases) {
    check_gated_modulate(c, {DType::f32, DType::f32}, false, seed += 10);
    check_gated_modulate(c, {DType::f32, DType::bf16}, true, seed += 10);
    check_gated_modulate(c, {DType::f32, DType::bf16}, false, seed += 10);  // f32 out: composed
    check_gated_modulate(c, {DType::bf16, DType::bf16}, false, seed += 10);
    check_gated_modulate(c, {DType::bf16, DType::bf16}, true, seed += 10);  // FLUX's bf16 stream
    check_gated_modulate(c, {DType::f16, DType::f16}, false, seed += 10);
  }
  const Device dev = test_device();
  Tensor x = rnd({2, 5, 64}, 490).to(DType::f32).to(dev).requires_grad_(true);
  Tensor m = rnd({2, 192}, 491).to(DType::f32).to(dev).requires_grad_(true);
  const auto [h, y] = F::gated_residual_modulate(x, m.narrow(1, 0, 64), rnd({2, 5, 64}, 492).to(DType::f32).to(dev),
                                                 m.narrow(1, 64, 64), m.narrow(1, 128, 64));
  if (dev.is_cuda()) {  // the two ops' nodes, from one kernel
    EXPECT_EQ(h.grad_fn_name(), "GatedResidualBackward");
    EXPECT_EQ(y.grad_fn_name(), "LayerNormModulateBackward");
  }
  expect_error([&] { F::gated_residual_modulate(x, m.narrow(1, 0, 64), x, m.narrow(1, 0, 32), m.narrow(1, 64, 64)); },
               {"gated_residual_modulate", "shift", "[2, 64]", "[2, 32]"});
}

// Only some inputs need a gradient: the others get none, the rest are still right.
TEST(AdalnOps, PartialGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x64 = rnd({2, 9, 64}, 501), m64 = rnd({2, 128}, 502, 0.0, 0.5), y64 = rnd({2, 9, 64}, 503);
  Tensor x = x64.to(DType::f32).to(dev).requires_grad_(true);
  const Tensor shift = m64.narrow(1, 0, 64).to(DType::f32).to(dev);
  Tensor scale = m64.narrow(1, 64, 64).to(DType::f32).to(dev).requires_grad_(true);
  Gradients g = F::layer_norm_modulate(x, shift, scale, 1e-5).square().sum().backward();
  Tensor rx = x64.clone().requires_grad_(true), rs = m64.narrow(1, 64, 64).clone().requires_grad_(true);
  Gradients rg = ref_ln_mod(rx, m64.narrow(1, 0, 64), rs, 1e-5).square().sum().backward();
  EXPECT_TRUE(close_scaled(g.get(x), rg.get(rx), 1e-4));
  EXPECT_TRUE(close_scaled(g.get(scale), rg.get(rs), 1e-4));

  // gated_residual with only y requiring grad; and with only x.
  const Tensor gate = m64.narrow(1, 0, 64).to(DType::f32).to(dev);
  Tensor y = y64.to(DType::f32).to(dev).requires_grad_(true);
  Gradients gy = F::gated_residual(x64.to(DType::f32).to(dev), gate, y).sum().backward();
  EXPECT_TRUE(close_scaled(gy.get(y), per_sample(m64.narrow(1, 0, 64), y64).expand({2, 9, 64}).contiguous(), 1e-6));
  Gradients gx = F::gated_residual(x, gate, y64.to(DType::f32).to(dev)).sum().backward();
  EXPECT_TRUE(close_scaled(gx.get(x), Tensor::ones({2, 9, 64}, DType::f64), 0.0));
}

TEST(AdalnRule, OneFusedNodeOnCuda) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor x = rnd({2, 5, 64}, 601).to(DType::f32).to(dev).requires_grad_(true);
  Tensor m = rnd({2, 128}, 602).to(DType::bf16).to(dev).requires_grad_(true);
  Tensor y = rnd({2, 5, 64}, 603).to(DType::bf16).to(dev).requires_grad_(true);
  // f32 x with a bf16 modulation: the promotion (f32) fuses only under autocast, an f32 one always.
  Tensor m32 = rnd({2, 128}, 604).to(DType::f32).to(dev).requires_grad_(true);
  const std::string ln = F::layer_norm_modulate(x, m32.narrow(1, 0, 64), m32.narrow(1, 64, 64)).grad_fn_name();
  const std::string gr = F::gated_residual(x, m.narrow(1, 0, 64), y).grad_fn_name();
  if (dev.is_cuda()) {
    EXPECT_EQ(ln, "LayerNormModulateBackward");
    EXPECT_EQ(gr, "GatedResidualBackward");
  } else {  // the CPU composes: the last op is the add of the shift / the residual
    EXPECT_EQ(ln, "AddBackward");
    EXPECT_EQ(gr, "AddBackward");
  }
}

TEST(AdalnGradcheck, F64) {
  const GradcheckResult a = gradcheck(
      [](const TensorList& t) { return F::layer_norm_modulate(t[0], t[1], t[2], 1e-5); },
      {rnd({2, 3, 5}, 701), rnd({2, 5}, 702, 0.0, 0.5), rnd({2, 5}, 703, 0.0, 0.5)});
  EXPECT_TRUE(a.ok) << a.message;
  const GradcheckResult b = gradcheck([](const TensorList& t) { return F::gated_residual(t[0], t[1], t[2]); },
                                      {rnd({2, 3, 5}, 711), rnd({2, 5}, 712), rnd({2, 3, 5}, 713)});
  EXPECT_TRUE(b.ok) << b.message;
}

// Under autocast the normalisation runs in f32 and the result has the autocast dtype, on every
// device; gated_residual keeps the promotion (an f32 residual stream stays f32).
TEST(AdalnAutocast, DtypesAndGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x64 = rnd({2, 7, 64}, 801, 1.0, 3.0);
  const Tensor m64 = rnd({2, 128}, 802, 0.0, 0.5).to(DType::bf16).to(DType::f64);
  const Tensor gy64 = rnd({2, 7, 64}, 803).to(DType::bf16).to(DType::f64);
  Tensor x = x64.to(DType::f32).to(dev).requires_grad_(true);
  Tensor m = m64.to(DType::bf16).to(dev).requires_grad_(true);
  Tensor y;
  {
    amp::AutocastGuard autocast(DType::bf16, dev.type);
    y = F::layer_norm_modulate(x, m.narrow(1, 0, 64), m.narrow(1, 64, 64), 1e-6);
    EXPECT_EQ(F::gated_residual(x, m.narrow(1, 0, 64), y).dtype(), DType::f32);
  }
  EXPECT_EQ(y.dtype(), DType::bf16);
  Gradients g = (y * gy64.to(DType::bf16).to(dev)).sum().backward();
  Tensor rx = x64.clone().requires_grad_(true), rm = m64.clone().requires_grad_(true);
  Tensor ry = ref_ln_mod(rx, rm.narrow(1, 0, 64), rm.narrow(1, 64, 64), 1e-6);
  Gradients rg = (ry * gy64).sum().backward();
  EXPECT_TRUE(close_scaled(y, ry.detach(), tol_for(DType::bf16)));
  EXPECT_EQ(g.get(x).dtype(), DType::f32);
  EXPECT_TRUE(close_scaled(g.get(x), rg.get(rx), tol_for(DType::bf16)));
  EXPECT_TRUE(close_scaled(g.get(m), rg.get(rm), tol_for(DType::bf16)));
}

// Note [Saved x-hat]: under autocast an f32 input is not held by the graph; x-hat in bf16 is.
TEST(AdalnSaved, XhatInTheResultDtypeInsteadOfTheF32Input) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = test_device();
  const int64_t B = 4, T = 50, D = 256;
  Tensor x = rnd({B, T, D}, 901).to(DType::f32).to(dev).requires_grad_(true);
  Tensor m = rnd({B, 2 * D}, 902, 0.0, 0.5).to(DType::bf16).to(dev).requires_grad_(true);
  Tensor y;
  {
    amp::AutocastGuard autocast(DType::bf16, dev.type);
    y = F::layer_norm_modulate(x * 1.0, m.narrow(1, 0, D), m.narrow(1, D, D));  // x * 1: a non-leaf input
  }
  ASSERT_EQ(y.grad_fn_name(), "LayerNormModulateBackward");
  // x-hat (bf16), rstd (f32 per row) and the modulation's storage; not x (f32) nor mean.
  EXPECT_EQ(autograd_saved_bytes(y), static_cast<std::size_t>(B * T * D * 2 + B * T * 4 + B * 2 * D * 2));
  // Without autocast (f32 out) x and mean are saved as before.
  Tensor y32 = F::layer_norm_modulate(x * 1.0, m.narrow(1, 0, D).to(DType::f32), m.narrow(1, D, D).to(DType::f32));
  EXPECT_GE(autograd_saved_bytes(y32), static_cast<std::size_t>(B * T * D * 4 + 2 * B * T * 4));
}

// Note [adaLN ops], autocast: a bf16 x (FLUX's residual stream) is normalised in f32 from what it
// holds, with no f32 copy: values and gradients as the float64 reference of the same rounded
// inputs; on CUDA the node saves x itself (its storage), mean, rstd and the modulation's storage.
TEST(AdalnAutocast, HalfInputIsReadAsItIs) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (const Shape& xs : {Shape{1, 40, 3072}, Shape{2, 9, 2432}, Shape{3, 7, 384}}) {
    SCOPED_TRACE(shape_str(xs));
    const int64_t B = xs[0], T = xs[1], D = xs[2];
    const Tensor x64 = rnd(xs, 1001 + D, 0.5, 2.0).to(DType::bf16).to(DType::f64);
    const Tensor m64 = rnd({B, 2 * D}, 1002 + D, 0.0, 0.5).to(DType::bf16).to(DType::f64);
    const Tensor gy64 = rnd(xs, 1003 + D).to(DType::bf16).to(DType::f64);
    Tensor x = x64.to(DType::bf16).to(dev).requires_grad_(true);
    Tensor m = m64.to(DType::bf16).to(dev).requires_grad_(true);
    Tensor y;
    {
      amp::AutocastGuard autocast(DType::bf16, dev.type);
      y = F::layer_norm_modulate(x * 1.0, m.narrow(1, 0, D), m.narrow(1, D, D), 1e-6);  // x * 1: a non-leaf input
    }
    ASSERT_EQ(y.dtype(), DType::bf16);
    if (dev.is_cuda()) {
      EXPECT_EQ(y.grad_fn_name(), "LayerNormModulateBackward");
      EXPECT_EQ(autograd_saved_bytes(y), static_cast<std::size_t>(B * T * D * 2 + 2 * B * T * 4 + B * 2 * D * 2));
    }
    Gradients g = (y * gy64.to(DType::bf16).to(dev)).sum().backward();
    Tensor rx = x64.clone().requires_grad_(true), rm = m64.clone().requires_grad_(true);
    Tensor ry = ref_ln_mod(rx, rm.narrow(1, 0, D), rm.narrow(1, D, D), 1e-6);
    Gradients rg = (ry * gy64).sum().backward();
    EXPECT_TRUE(close_scaled(y, ry.detach(), tol_for(DType::bf16)));
    EXPECT_EQ(g.get(x).dtype(), DType::bf16);
    EXPECT_TRUE(close_scaled(g.get(x), rg.get(rx), tol_for(DType::bf16)));
    EXPECT_TRUE(close_scaled(g.get(m), rg.get(rm), tol_for(DType::bf16)));
  }
}

// Note [Gated residual saves]: the fused node keeps the branch y only when the gate wants a gradient
// (a frozen adaLN projection's gate: LoRA training); the gradients are those of the composite
// either way (on the CPU the op is the composite).
TEST(AdalnSaved, GatedResidualKeepsTheBranchOnlyForTheGateGradient) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t B = 2, T = 6, D = 64;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (bool gate_grad : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (gate_grad ? " gate with a gradient" : " frozen gate"));
      const Tensor x0 = rnd({B, T, D}, 1101).to(dt), y0 = rnd({B, T, D}, 1102).to(dt), m0 = rnd({B, D}, 1103).to(dt);
      const Tensor go = rnd({B, T, D}, 1104).to(dt);
      auto run = [&](bool fused) {
        Tensor x = x0.to(dev).requires_grad_(true), y = y0.to(dev).requires_grad_(true);
        Tensor gate = m0.to(dev).requires_grad_(gate_grad);
        // Non-leaf inputs, as in a model; the composite is the reference.
        const Tensor o = fused ? F::gated_residual(x * 1.0, gate, y * 1.0) : x * 1.0 + per_sample(gate, x) * (y * 1.0);
        const std::size_t saved = autograd_saved_bytes(o);
        Gradients g = (o * go.to(dev)).sum().backward();
        return std::tuple<Tensor, std::size_t, TensorList>{o, saved,
                                                           {g.get(x), g.get(y), gate_grad ? g.get(gate) : Tensor()}};
      };
      const auto [o, saved, grads] = run(true);
      const auto [ro, rsaved, rgrads] = run(false);
      if (dev.is_cuda()) {
        ASSERT_EQ(o.grad_fn_name(), "GatedResidualBackward");
        const std::size_t row = static_cast<std::size_t>(B * D) * dtype_size(dt), big = row * T;
        EXPECT_EQ(saved, gate_grad ? row + big : row) << "gate, and y only for the gate's gradient";
      }
      const double tol = dt == DType::bf16 ? 1e-2 : 1e-6;
      EXPECT_TRUE(close_scaled(o, ro, tol));
      for (std::size_t i = 0; i < grads.size(); ++i) {
        if (!grads[i].defined()) continue;
        EXPECT_TRUE(close_scaled(grads[i], rgrads[i], tol)) << "gradient " << i;
      }
    }
  }
}

// A chain of DiT-style stages under bf16 autocast (Note [Fused residual backward]): y0 =
// layer_norm_modulate(x); stage k = 1..kStages: h = h + gate * branch(y, params[k]) and y =
// layer_norm_modulate(h), as gated_residual_modulate (fused) or the two ops. hook_stage: the stage
// whose residual gets hooks scaling its gradient by hook_scales, each returning a new tensor (-1:
// none). The gradients of x, each stage's modulation and each stage's branch parameters, in that
// order per stage.
struct StageChain {
  static constexpr int kStages = 3;
  int64_t B = 3, T = 37, D = 128;
  Tensor x0, gy;
  TensorList m0;                     // [B, 3D] bf16 per stage (0: the first norm's)
  std::vector<TensorList> params0;   // per stage (0: none)
  std::function<Tensor(const Tensor& y, const TensorList& params)> branch;
  std::vector<double> hook_scales = {2.0, 1.0};

  StageChain(Device dev, uint64_t x_seed, uint64_t m_seed, uint64_t gy_seed) {
    x0 = rnd({B, T, D}, x_seed, 0.5, 2.0).to(DType::f32).to(dev);
    for (int k = 0; k <= kStages; ++k) m0.push_back(rnd({B, 3 * D}, m_seed + k, 0.0, 0.5).to(DType::bf16).to(dev));
    gy = rnd({B, T, D}, gy_seed).to(DType::bf16).to(dev);
  }

  TensorList run(bool fused, int hook_stage) const {
    const Device dev = x0.device();
    Tensor x = x0.detach().requires_grad_(true);
    TensorList m;
    std::vector<TensorList> p(params0.size());
    for (int k = 0; k <= kStages; ++k) m.push_back(m0[k].detach().requires_grad_(true));
    for (std::size_t k = 0; k < params0.size(); ++k)
      for (const Tensor& t : params0[k]) p[k].push_back(t.detach().requires_grad_(true));
    Tensor y;
    {
      amp::AutocastGuard autocast(DType::bf16, dev.type);
      Tensor h = x;
      y = F::layer_norm_modulate(h, m[0].narrow(1, D, D), m[0].narrow(1, 2 * D, D));
      for (int k = 1; k <= kStages; ++k) {
        const Tensor br = branch(y, p[k]);
        const Tensor gate = m[k].narrow(1, 0, D), shift = m[k].narrow(1, D, D), scale = m[k].narrow(1, 2 * D, D);
        if (fused) {
          std::tie(h, y) = F::gated_residual_modulate(h, gate, br, shift, scale);
        } else {
          h = F::gated_residual(h, gate, br);
          y = F::layer_norm_modulate(h, shift, scale);
        }
        if (k == hook_stage)
          for (double f : hook_scales) h.register_hook([f](const Tensor& g) { return g * f; });
      }
    }
    Gradients g = (y * gy).sum().to(DType::f32).backward();
    TensorList out{g.get(x)};
    for (int k = 0; k <= kStages; ++k) {
      out.push_back(g.get(m[k]));
      if (k > 0)
        for (const Tensor& t : p[k]) out.push_back(g.get(t));
    }
    return out;
  }
};

// Each stage's adaLN backward also computes its gated residual's gradients (taken by that node); a
// hook that edits one residual's gradient makes that stage compute as the two ops do, from the
// edited gradient.
TEST(AdalnFusedResidual, PreparedGradientsMatchTheTwoOpsAndHooksFallBack) {
  FLAME_SKIP_IF_NO_CUDA();
  StageChain chain(test_device(), 951, 960, 980);
  chain.params0.resize(StageChain::kStages + 1);
  for (int k = 1; k <= StageChain::kStages; ++k)
    chain.params0[k] = {rnd({chain.D}, 970 + k).to(DType::bf16).to(chain.x0.device())};
  chain.branch = [](const Tensor& y, const TensorList& p) { return y * p[0]; };
  // With the engine's base hand-over off, h's pending sum (the next stage's pass-through) is not
  // in the adaLN's dx: only the last stage, whose h has no other consumer, may prepare.
  for (bool based : {true, false})
  for (int hook_stage : {-1, 2}) {
    SCOPED_TRACE("hook on stage " + std::to_string(hook_stage) + (based ? "" : ", no base hand-over"));
    const bool was = autograd_detail::set_accumulate_base_enabled(based);
    const TensorList want = chain.run(false, hook_stage);
    const autograd_detail::PreparedCounts before = autograd_detail::prepared_counts();
    const TensorList got = chain.run(true, hook_stage);
    const autograd_detail::PreparedCounts after = autograd_detail::prepared_counts();
    autograd_detail::set_accumulate_base_enabled(was);
    const uint64_t prepared = based ? StageChain::kStages : 1;
    EXPECT_EQ(after.prepared - before.prepared, prepared);
    EXPECT_EQ(after.taken - before.taken, hook_stage < 0 || !based ? prepared : prepared - 1);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(got[i].defined() && want[i].defined()) << i;
      EXPECT_TRUE(close_scaled(got[i], want[i], 1e-5)) << "gradient " << i;
    }
  }
}

// Note [Gradient row sums]: with Linear branches (f32 master weights and biases under autocast, as
// the DiT's proj and fc2), the fused residual backward also sums each branch gradient's columns,
// and the Linear takes its bias gradient from them. The gradients match the two ops' path (the
// bias gradients within bf16 rounding: the fused sums add the f32 products, the two ops the
// bf16-rounded gradient); a hook on one residual makes that stage's Linear sum as usual.
TEST(AdalnFusedResidual, LinearBranchesTakeTheirBiasGradientsFromTheKernel) {
  FLAME_SKIP_IF_NO_CUDA();
  StageChain chain(test_device(), 1951, 1960, 1990);
  chain.hook_scales = {1.0};
  const Device dev = chain.x0.device();
  const int64_t D = chain.D;
  chain.params0.resize(StageChain::kStages + 1);
  for (int k = 1; k <= StageChain::kStages; ++k)
    chain.params0[k] = {rnd({D, D}, 1970 + k, 0.0, 0.1).to(DType::f32).to(dev),
                        rnd({D}, 1980 + k, 0.0, 0.5).to(DType::f32).to(dev)};
  chain.branch = [](const Tensor& y, const TensorList& p) { return F::linear(y, p[0], p[1]); };
  for (int hook_stage : {-1, 2}) {
    SCOPED_TRACE("hook on stage " + std::to_string(hook_stage));
    const TensorList want = chain.run(false, hook_stage);
    const autograd_detail::RowSumCounts before = autograd_detail::row_sum_counts();
    const TensorList got = chain.run(true, hook_stage);
    const autograd_detail::RowSumCounts after = autograd_detail::row_sum_counts();
    const uint64_t stages = StageChain::kStages;
    EXPECT_EQ(after.attached - before.attached, stages);
    EXPECT_EQ(after.taken - before.taken, hook_stage < 0 ? stages : stages - 1);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(got[i].defined() && want[i].defined()) << i;
      // Order: x, m0, then per stage m, weight, bias.
      const bool bias_grad = i >= 2 && (i - 2) % 3 == 2;
      EXPECT_EQ(got[i].dtype(), want[i].dtype()) << i;
      EXPECT_TRUE(close_scaled(got[i], want[i], bias_grad ? 1e-2 : 1e-5)) << "gradient " << i;
    }
  }
}

// Note [Gradient row sums]: the registry hands sums back only for the same memory, unchanged, in
// a layout where each element is still in its column; once.
TEST(GradientRowSums, TakenOnlyForTheSameUnchangedMemory) {
  namespace ad = autograd_detail;
  const Tensor sums = Tensor::from_vec(std::vector<float>{1, 2, 3, 4}, {4});
  Tensor g = Tensor::zeros({2, 3, 4});
  ad::attach_row_sums(g, sums);
  EXPECT_FALSE(ad::take_row_sums(Tensor::zeros({2, 3, 4})).defined()) << "other memory";
  const Tensor got = ad::take_row_sums(g.reshape({6, 4}));  // a contiguous view, same columns
  ASSERT_TRUE(got.defined());
  EXPECT_EQ(got.to_vec<float>(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_FALSE(ad::take_row_sums(g).defined()) << "taken once";
  ad::attach_row_sums(g, sums);
  g.add_(1.0);
  EXPECT_FALSE(ad::take_row_sums(g).defined()) << "edited in place since";
  Tensor sq = Tensor::zeros({4, 4});
  ad::attach_row_sums(sq, sums);
  EXPECT_FALSE(ad::take_row_sums(sq.t()).defined()) << "a transposed view moves the columns";
  ad::attach_row_sums(sq, sums);
  EXPECT_FALSE(ad::take_row_sums(sq.narrow(0, 0, 2)).defined()) << "part of the memory";
  EXPECT_TRUE(ad::take_row_sums(sq).defined());
  ad::attach_row_sums(g, Tensor::zeros({3}));  // sums that do not match the last dim: ignored
  EXPECT_FALSE(ad::take_row_sums(g).defined());
}

TEST(AdalnErrors, NameTheOpAndShapes) {
  const Tensor x = Tensor::ones({2, 3, 8});
  expect_error([&] { F::layer_norm_modulate(x, Tensor::ones({2, 4}), Tensor::ones({2, 8})); },
               {"layer_norm_modulate", "shift", "[2, 8]", "[2, 4]"});
  expect_error([&] { F::layer_norm_modulate(x, Tensor::ones({2, 8}), Tensor::ones({3, 8})); },
               {"layer_norm_modulate", "scale", "[3, 8]"});
  expect_error([&] { F::layer_norm_modulate(Tensor::ones({8}), Tensor::ones({1, 8}), Tensor::ones({1, 8})); },
               {"layer_norm_modulate", "at least 2 dims"});
  expect_error([&] { F::layer_norm_modulate(x, Tensor::ones({2, 8}), Tensor::ones({2, 8}), -1.0); },
               {"layer_norm_modulate", "eps"});
  expect_error([&] { F::gated_residual(x, Tensor::ones({2, 8}), Tensor::ones({2, 3, 7})); },
               {"gated_residual", "y must have the input's shape"});
  expect_error([&] { F::gated_residual(x, Tensor::ones({2, 8}, DType::i32), x); }, {"gated_residual", "gate", "i32"});
}

}  // namespace
}  // namespace flame::test
