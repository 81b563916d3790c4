// nn::functional::rms_norm_rotary (Note [RMS norm rotary] in src/ops/rms_norm_rotary.cpp): the fused
// op against the ops it replaces (rms_norm per part, cat, rotary_embedding) forward and backward,
// bit for bit on the CPU and within rounding on CUDA, over the head dims, dtypes, rotation layouts,
// part counts and gradient layouts attention gives; finite differences; the composite for weights
// that train; what the node saves; and the errors.
#include <string>
#include <vector>

#include "flame/amp.h"
#include "flame/autograd.h"
#include "flame/nn/norm.h"
#include "flame/nn/rotary.h"
#include "flame/ops.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;
using F::RotaryLayout;

enum class Rot { none, interleaved, half };
const char* rot_name(Rot r) { return r == Rot::none ? "none" : r == Rot::half ? "half" : "interleaved"; }

struct Tables {
  Tensor cos, sin;
};
Tables tables(int64_t s, int64_t d, Device dev, DType dt, uint64_t seed) {
  const Tensor t = make_input({{s, d}, DType::f64, Layout::contiguous, -3.0, 3.0}, Device::cpu(), seed);
  return {t.cos().to(dt).to(dev), t.sin().to(dt).to(dev)};
}

// The ops the fused op replaces, outside autocast.
Tensor unfused(const TensorList& parts, const TensorList& weights, double eps, const Tables& t, Rot rot) {
  const amp::AutocastGuard off(false, parts[0].device().type);
  TensorList normed;
  for (std::size_t i = 0; i < parts.size(); ++i)
    normed.push_back(F::rms_norm(parts[i], {parts[i].size(3)}, weights[i], eps));
  Tensor q = (normed.size() == 1 ? normed[0] : cat(normed, 1)).transpose(1, 2);
  if (rot == Rot::none) return q;
  return F::rotary_embedding(q, t.cos, t.sin, rot == Rot::half ? RotaryLayout::half : RotaryLayout::interleaved);
}
Tensor fused(const TensorList& parts, const TensorList& weights, double eps, const Tables& t, Rot rot) {
  if (rot == Rot::none) return F::rms_norm_rotary(parts, weights, eps);
  return F::rms_norm_rotary(parts, weights, eps, t.cos, t.sin,
                            rot == Rot::half ? RotaryLayout::half : RotaryLayout::interleaved);
}

struct Run {
  Tensor y;
  TensorList grads;
};
Run run(bool use_fused, const TensorList& parts0, const TensorList& weights, double eps, const Tables& t, Rot rot,
        const Tensor& seed) {
  TensorList parts;
  for (const Tensor& p : parts0) parts.push_back(p.detach().requires_grad_(true));
  const Tensor y = use_fused ? fused(parts, weights, eps, t, rot) : unfused(parts, weights, eps, t, rot);
  const Gradients g = y.backward(BackwardOptions{seed});
  Run r{y.detach(), {}};
  for (const Tensor& p : parts) r.grads.push_back(g.get(p));
  return r;
}

void expect_match(const Run& got, const Run& want, DType dt, bool exact, const std::string& what) {
  if (exact) {
    EXPECT_TRUE(same_bits(got.y.contiguous(), want.y.contiguous(), what + ": output"));
  } else {
    EXPECT_TRUE(all_close(got.y.to(DType::f64), want.y.to(DType::f64), default_rtol(dt), default_atol(dt)))
        << what << ": output";
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (std::size_t i = 0; i < got.grads.size(); ++i) {
    const std::string w = what + ": gradient of part " + std::to_string(i);
    if (exact) {
      EXPECT_TRUE(same_bits(got.grads[i].contiguous(), want.grads[i].contiguous(), w));
    } else {
      // The gradient's scale: a row's gradient is a difference of terms of about |g| rstd.
      EXPECT_TRUE(all_close(got.grads[i].to(DType::f64), want.grads[i].to(DType::f64), 2 * default_rtol(dt),
                            2 * default_atol(dt)))
          << w;
    }
  }
}

// Head dims the CUDA kernel takes (4..32 vectors per row) and one it does not (the composite),
// one stream and the text + image join (with an odd split), weights or none, every rotation, in
// the dtypes; the gradient both in attention's heads-inner layout and contiguous. The CPU kernel
// rounds where the separate CPU kernels round: bit for bit there.
TEST(RmsNormRotary, MatchesTheOpsItReplaces) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const bool exact = dev.is_cpu();
  const std::vector<DType> dtypes = exact ? std::vector<DType>{DType::f64, DType::f32, DType::bf16, DType::f16}
                                          : std::vector<DType>{DType::f32, DType::bf16, DType::f16};
  const int64_t b = 2, h = 3;
  uint64_t seed = 100;
  for (int64_t d : {int64_t{16}, int64_t{64}, int64_t{128}, int64_t{12}}) {
    for (const std::vector<int64_t>& lens : {std::vector<int64_t>{7}, std::vector<int64_t>{3, 9}}) {
      for (Rot rot : {Rot::none, Rot::interleaved, Rot::half}) {
        for (DType dt : dtypes) {
          for (bool with_weights : {true, false}) {
            const std::string what = "D=" + std::to_string(d) + " parts=" + std::to_string(lens.size()) + " " +
                                     rot_name(rot) + " " + dtype_name(dt) + (with_weights ? " weights" : "");
            SCOPED_TRACE(what);
            int64_t s = 0;
            TensorList parts, weights;
            for (int64_t len : lens) {
              parts.push_back(make_input({{b, len, h, d}, dt, Layout::contiguous}, dev, ++seed));
              weights.push_back(with_weights ? make_input({{d}, dt, Layout::contiguous, 0.5, 1.5}, dev, ++seed)
                                             : Tensor());
              s += len;
            }
            const Tables t = tables(s, d, dev, DType::f32, ++seed);
            const Tensor y = fused(parts, weights, 1e-6, t, rot);
            // [B, H, S, D] over [B, S, H, D] memory: attention takes it without a copy.
            EXPECT_EQ(y.sizes(), (Shape{b, h, s, d}));
            EXPECT_EQ(y.strides(), (Shape{s * h * d, d, h * d, 1}));
            const Tensor g_mem = make_input({{b, s, h, d}, dt, Layout::contiguous}, dev, ++seed);
            for (bool heads_inner : {true, false}) {
              const Tensor g = heads_inner ? g_mem.transpose(1, 2) : g_mem.transpose(1, 2).contiguous();
              expect_match(run(true, parts, weights, 1e-6, t, rot, g), run(false, parts, weights, 1e-6, t, rot, g), dt,
                           exact, what + (heads_inner ? " heads-inner gradient" : " contiguous gradient"));
            }
          }
        }
      }
    }
  }
}

// FLUX-dev's q at 1024² (text 512 + image 4096 tokens, 24 heads of 128, bf16) and SD3.5-Large's
// (image 4096 + text 333, 38 heads of 64, no rotation) on the device, and a part at an address off
// the 16-byte alignment (the CUDA kernel declines it: the composite).
TEST(RmsNormRotary, ModelShapesAndAnUnalignedPart) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const bool exact = dev.is_cpu();
  struct Case {
    int64_t t, l, h, d;
    Rot rot;
    bool unaligned;
  };
  const std::vector<Case> cases = exact ? std::vector<Case>{{5, 11, 2, 128, Rot::interleaved, true}}
                                        : std::vector<Case>{{512, 4096, 24, 128, Rot::interleaved, false},
                                                            {4096, 333, 38, 64, Rot::none, false},
                                                            {5, 11, 2, 128, Rot::interleaved, true}};
  uint64_t seed = 300;
  for (const Case& c : cases) {
    const std::string what = "t=" + std::to_string(c.t) + " l=" + std::to_string(c.l) + " h=" + std::to_string(c.h) +
                             " d=" + std::to_string(c.d) + (c.unaligned ? " unaligned" : "");
    SCOPED_TRACE(what);
    const DType dt = DType::bf16;
    const int64_t n = c.t * c.h * c.d;
    const Tensor flat = make_input({{n + 1}, dt, Layout::contiguous}, dev, ++seed);
    const Tensor first = (c.unaligned ? flat.narrow(0, 1, n) : flat.narrow(0, 0, n)).view({1, c.t, c.h, c.d});
    const TensorList parts = {first, make_input({{1, c.l, c.h, c.d}, dt, Layout::contiguous}, dev, ++seed)};
    const TensorList weights = {make_input({{c.d}, dt, Layout::contiguous, 0.5, 1.5}, dev, ++seed),
                                make_input({{c.d}, dt, Layout::contiguous, 0.5, 1.5}, dev, ++seed)};
    const Tables t = tables(c.t + c.l, c.d, dev, DType::f32, ++seed);
    const Tensor g = make_input({{1, c.t + c.l, c.h, c.d}, dt, Layout::contiguous}, dev, ++seed).transpose(1, 2);
    expect_match(run(true, parts, weights, 1e-6, t, c.rot, g), run(false, parts, weights, 1e-6, t, c.rot, g), dt,
                 exact, what);
  }
}

// Finite differences through the fused backward (f64 on the CPU), and through the composite that
// weights and tables requiring a gradient take (their gradients included).
TEST(RmsNormRotary, FiniteDifferences) {
  const Tables t = tables(5, 8, Device::cpu(), DType::f64, 401);
  for (Rot rot : {Rot::none, Rot::interleaved, Rot::half}) {
    SCOPED_TRACE(rot_name(rot));
    const Tensor w0 = make_input({{8}, DType::f64, Layout::contiguous, 0.5, 1.5}, Device::cpu(), 402);
    const Tensor w1 = make_input({{8}, DType::f64, Layout::contiguous, 0.5, 1.5}, Device::cpu(), 403);
    const TensorList parts = {make_input({{1, 2, 2, 8}, DType::f64, Layout::contiguous}, Device::cpu(), 404),
                              make_input({{1, 3, 2, 8}, DType::f64, Layout::contiguous}, Device::cpu(), 405)};
    const auto fused_parts = gradcheck(
        [&](const TensorList& in) { return fused(in, {w0, w1}, 1e-6, t, rot); }, parts);
    EXPECT_TRUE(fused_parts.ok) << fused_parts.message;
    const auto with_weights = gradcheck(
        [&](const TensorList& in) { return fused({in[0], in[1]}, {in[2], in[3]}, 1e-6, {in[4], in[5]}, rot); },
        {parts[0], parts[1], w0, w1, t.cos, t.sin});
    EXPECT_TRUE(with_weights.ok) << with_weights.message;
  }
}

// The node keeps the parts (the norm's inputs), the weights and the tables; not the output.
TEST(RmsNormRotary, SavesThePartsWeightsAndTables) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = make_input({{1, 4, 2, 16}, DType::f32, Layout::contiguous}, dev, 501).requires_grad_(true);
  const Tensor c = make_input({{1, 6, 2, 16}, DType::f32, Layout::contiguous}, dev, 502).requires_grad_(true);
  const Tensor w = make_input({{16}, DType::f32, Layout::contiguous}, dev, 503);
  const Tables t = tables(10, 16, dev, DType::f32, 504);
  const Tensor y = F::rms_norm_rotary({a, c}, {w, w}, 1e-6, t.cos, t.sin);
  EXPECT_EQ(autograd_saved_bytes(y), (4 * 2 * 16 + 6 * 2 * 16 + 16 + 2 * 10 * 16) * sizeof(float));
}

TEST(RmsNormRotary, ErrorsNameTheProblem) {
  const Tensor x = Tensor::zeros({1, 3, 2, 8});
  const Tensor c = Tensor::zeros({3, 8}), s = Tensor::zeros({3, 8});
  expect_error([&] { F::rms_norm_rotary({}, {}, 1e-6); }, {"rms_norm_rotary", "at least one part"});
  expect_error([&] { F::rms_norm_rotary({Tensor::zeros({3, 2, 8})}, {}, 1e-6); },
               {"rms_norm_rotary", "[B, S, H, D]", "[3, 2, 8]"});
  expect_error([&] { F::rms_norm_rotary({x, Tensor::zeros({1, 2, 3, 8})}, {}, 1e-6); },
               {"rms_norm_rotary", "agree in B, H and D", "[1, 2, 3, 8]"});
  expect_error([&] { F::rms_norm_rotary({x, Tensor::zeros({1, 2, 2, 8}, {DType::f64})}, {}, 1e-6); },
               {"rms_norm_rotary", "share a dtype", "f64"});
  expect_error([&] { F::rms_norm_rotary({x}, {Tensor::zeros({4})}, 1e-6); },
               {"rms_norm_rotary", "weight 0 must be [D] = [8]", "[4]"});
  expect_error([&] { F::rms_norm_rotary({x}, {Tensor::zeros({8}, {DType::bf16})}, 1e-6); },
               {"rms_norm_rotary", "weight 0 must have the parts' dtype", "bf16"});
  expect_error([&] { F::rms_norm_rotary({x}, {Tensor(), Tensor()}, 1e-6); },
               {"rms_norm_rotary", "one weight per part", "1 parts, 2 weights"});
  expect_error([&] { F::rms_norm_rotary({x, x}, {}, 1e-6, c, s); },
               {"rms_norm_rotary", "cos must be [S, D] = [6, 8]", "[3, 8]"});
  expect_error([&] { F::rms_norm_rotary({x}, {}, 1e-6, c, Tensor()); }, {"rms_norm_rotary", "both cos and sin"});
  expect_error([&] { F::rms_norm_rotary({Tensor::zeros({1, 3, 2, 7})}, {}, 1e-6, Tensor::zeros({3, 7}),
                                        Tensor::zeros({3, 7})); },
               {"rms_norm_rotary", "D must be even", "[1, 3, 2, 7]"});
}

}  // namespace
}  // namespace flame::test
