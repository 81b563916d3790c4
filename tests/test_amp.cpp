// Autocast: the op -> dtype table, nesting and disabling, the cast cache, gradients into f32
// leaves, autocast off in backward, checkpoint recompute. The GradScaler and training runs are in
// test_amp_scaler.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "flame/amp.h"
#include "flame/flame.h"
#include "flame/nn.h"
#include "test_util.h"

namespace flame::test {
namespace {

using nn::functional::batch_norm;
using nn::functional::conv1d;
using nn::functional::conv2d;
using nn::functional::conv_transpose2d;
using nn::functional::group_norm;
using nn::functional::layer_norm;
using nn::functional::linear;
using nn::functional::rms_norm;
using nn::functional::scaled_dot_product_attention;

Tensor rnd(const Shape& shape, uint64_t seed, DType dt = DType::f32, double lo = -2.0, double hi = 2.0) {
  return make_input({shape, dt, Layout::contiguous, lo, hi}, test_device(), seed);
}

// Exact comparison (both sides ran the same kernels on the same values).
::testing::AssertionResult same_values(const Tensor& got, const Tensor& want) {
  if (got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << "dtype " << dtype_name(got.dtype()) << " vs " << dtype_name(want.dtype());
  return all_close(got, want, 0.0, 0.0);
}

struct OpCase {
  std::string name;
  int n_float_inputs;  // the first inputs are the floating ones the policy casts
  std::function<TensorList(DType)> make;           // inputs in the given floating dtype
  std::function<Tensor(const TensorList&)> run;    // the op
};

std::vector<OpCase> low_precision_cases() {
  std::vector<OpCase> c;
  c.push_back({"matmul", 2, [](DType d) { return TensorList{rnd({3, 5, 7}, 1, d), rnd({7, 4}, 2, d)}; },
               [](const TensorList& t) { return matmul(t[0], t[1]); }});
  c.push_back({"bmm", 2, [](DType d) { return TensorList{rnd({3, 5, 7}, 3, d), rnd({3, 7, 4}, 4, d)}; },
               [](const TensorList& t) { return bmm(t[0], t[1]); }});
  c.push_back({"linear", 3,
               [](DType d) { return TensorList{rnd({2, 3, 6}, 5, d), rnd({5, 6}, 6, d), rnd({5}, 7, d)}; },
               [](const TensorList& t) { return linear(t[0], t[1], t[2]); }});
  c.push_back({"conv1d", 3,
               [](DType d) { return TensorList{rnd({2, 3, 9}, 8, d), rnd({4, 3, 3}, 9, d), rnd({4}, 10, d)}; },
               [](const TensorList& t) { return conv1d(t[0], t[1], t[2]); }});
  c.push_back({"conv2d", 3,
               [](DType d) { return TensorList{rnd({2, 3, 6, 5}, 11, d), rnd({4, 3, 3, 3}, 12, d), rnd({4}, 13, d)}; },
               [](const TensorList& t) { return conv2d(t[0], t[1], t[2]); }});
  c.push_back({"conv_transpose2d", 3,
               [](DType d) { return TensorList{rnd({2, 3, 4, 5}, 14, d), rnd({3, 2, 3, 3}, 15, d), rnd({2}, 16, d)}; },
               [](const TensorList& t) { return conv_transpose2d(t[0], t[1], t[2]); }});
  c.push_back({"scaled_dot_product_attention", 3,
               [](DType d) {
                 return TensorList{rnd({2, 2, 5, 8}, 17, d), rnd({2, 2, 6, 8}, 18, d), rnd({2, 2, 6, 8}, 19, d)};
               },
               [](const TensorList& t) { return scaled_dot_product_attention(t[0], t[1], t[2]); }});
  return c;
}

std::vector<OpCase> f32_cases() {
  std::vector<OpCase> c;
  auto unary = [&](const std::string& name, std::function<Tensor(const Tensor&)> f, double lo = -2.0, double hi = 2.0) {
    c.push_back({name, 1, [lo, hi](DType d) { return TensorList{rnd({4, 9}, 21, d, lo, hi)}; },
                 [f](const TensorList& t) { return f(t[0]); }});
  };
  unary("softmax", [](const Tensor& x) { return softmax(x, -1); });
  unary("log_softmax", [](const Tensor& x) { return log_softmax(x, 0); });
  unary("exp", [](const Tensor& x) { return exp(x); });
  unary("expm1", [](const Tensor& x) { return expm1(x); });
  unary("log", [](const Tensor& x) { return log(x); }, 0.1, 3.0);
  unary("log1p", [](const Tensor& x) { return log1p(x); }, 0.1, 3.0);
  unary("rsqrt", [](const Tensor& x) { return rsqrt(x); }, 0.1, 3.0);
  unary("reciprocal", [](const Tensor& x) { return reciprocal(x); }, 0.5, 3.0);
  unary("pow_scalar", [](const Tensor& x) { return pow(x, Scalar(3.0)); });
  unary("softplus", [](const Tensor& x) { return softplus(x); });
  unary("sum", [](const Tensor& x) { return sum(x, {1}); });
  unary("prod", [](const Tensor& x) { return prod(x, {0}); }, 0.5, 1.5);
  unary("cumsum", [](const Tensor& x) { return cumsum(x, 1); });
  unary("logsumexp", [](const Tensor& x) { return logsumexp(x, {1}); });
  unary("norm", [](const Tensor& x) { return norm(x, 2.0, {1}); });
  unary("layer_norm", [](const Tensor& x) { return layer_norm(x, {9}); });
  unary("rms_norm", [](const Tensor& x) { return rms_norm(x, {9}, Tensor(), 1e-5); });
  c.push_back({"pow_tensor", 2, [](DType d) { return TensorList{rnd({4, 9}, 22, d, 0.5, 2.0), rnd({4, 9}, 23, d)}; },
               [](const TensorList& t) { return pow(t[0], t[1]); }});
  c.push_back({"layer_norm_affine", 3,
               [](DType d) { return TensorList{rnd({3, 4, 8}, 24, d), rnd({8}, 25, d), rnd({8}, 26, d)}; },
               [](const TensorList& t) { return layer_norm(t[0], {8}, t[1], t[2]); }});
  c.push_back({"group_norm", 3,
               [](DType d) { return TensorList{rnd({2, 6, 5}, 27, d), rnd({6}, 28, d), rnd({6}, 29, d)}; },
               [](const TensorList& t) { return group_norm(t[0], 3, t[1], t[2]); }});
  c.push_back({"batch_norm", 3,
               [](DType d) { return TensorList{rnd({4, 3, 5}, 30, d), rnd({3}, 31, d), rnd({3}, 32, d)}; },
               [](const TensorList& t) { return batch_norm(t[0], Tensor(), Tensor(), t[1], t[2], true, 0.1, 1e-5); }});
  c.push_back({"mse_loss", 2, [](DType d) { return TensorList{rnd({5, 7}, 33, d), rnd({5, 7}, 34, d)}; },
               [](const TensorList& t) { return mse_loss(t[0], t[1]); }});
  c.push_back({"l1_loss", 2, [](DType d) { return TensorList{rnd({5, 7}, 35, d), rnd({5, 7}, 36, d)}; },
               [](const TensorList& t) { return l1_loss(t[0], t[1], Reduction::none); }});
  c.push_back({"binary_cross_entropy_with_logits", 2,
               [](DType d) { return TensorList{rnd({5, 7}, 37, d), rnd({5, 7}, 38, d, 0.0, 1.0)}; },
               [](const TensorList& t) { return binary_cross_entropy_with_logits(t[0], t[1]); }});
  c.push_back({"cross_entropy", 1,
               [](DType d) {
                 return TensorList{rnd({6, 11}, 39, d),
                                   make_input({{6}, DType::i64, Layout::contiguous, 0, 11}, test_device(), 40)};
               },
               [](const TensorList& t) { return cross_entropy(t[0], t[1]); }});
  c.push_back({"cross_entropy_spatial", 1,
               [](DType d) {
                 return TensorList{rnd({3, 5, 4}, 41, d),
                                   make_input({{3, 4}, DType::i64, Layout::contiguous, 0, 5}, test_device(), 42)};
               },
               [](const TensorList& t) { return cross_entropy(t[0], t[1], Reduction::none); }});
  c.push_back({"nll_loss", 1,
               [](DType d) {
                 return TensorList{rnd({6, 11}, 43, d),
                                   make_input({{6}, DType::i64, Layout::contiguous, 0, 11}, test_device(), 44)};
               },
               [](const TensorList& t) { return nll_loss(t[0], t[1]); }});
  return c;
}

TensorList cast_floats(const TensorList& in, int n, DType to) {
  TensorList out = in;
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = in[static_cast<std::size_t>(i)].to(to);
  return out;
}

DeviceType dev_type() { return test_device().type; }

class AmpAutocastPolicy : public ::testing::TestWithParam<DType> {};

// Low-precision ops: f32 inputs run in the low dtype and give exactly what the op gives on inputs
// cast by hand; outside autocast nothing changes.
TEST_P(AmpAutocastPolicy, LowPrecisionOpsRunInTheLowDtype) {
  FLAME_SKIP_IF_NO_DEVICE();
  const DType low = GetParam();
  for (const OpCase& c : low_precision_cases()) {
    SCOPED_TRACE(c.name);
    const TensorList in = c.make(DType::f32);
    const Tensor want = c.run(cast_floats(in, c.n_float_inputs, low));
    Tensor got;
    {
      amp::AutocastGuard ac(low, dev_type());
      got = c.run(in);
      // Mixed inputs (one already low) are cast too.
      const Tensor mixed = c.run(cast_floats(in, 1, low));
      EXPECT_EQ(mixed.dtype(), low);
    }
    EXPECT_TRUE(same_values(got, want));
    EXPECT_EQ(c.run(in).dtype(), DType::f32);  // the guard is gone
  }
}

// f32 ops: low inputs are cast up and the result is f32, equal to the op on f32-cast inputs;
// f32 inputs stay f32.
TEST_P(AmpAutocastPolicy, Fp32OpsRunInFloat) {
  FLAME_SKIP_IF_NO_DEVICE();
  const DType low = GetParam();
  for (const OpCase& c : f32_cases()) {
    SCOPED_TRACE(c.name);
    const TensorList in_low = cast_floats(c.make(DType::f32), c.n_float_inputs, low);
    const Tensor want = c.run(cast_floats(in_low, c.n_float_inputs, DType::f32));
    ASSERT_EQ(want.dtype(), DType::f32);
    const Tensor plain = c.run(in_low);
    EXPECT_EQ(plain.dtype(), low);  // outside autocast: the input's dtype
    Tensor got, got_f32;
    {
      amp::AutocastGuard ac(low, dev_type());
      got = c.run(in_low);
      got_f32 = c.run(c.make(DType::f32));
    }
    EXPECT_EQ(got.dtype(), DType::f32);
    EXPECT_EQ(got_f32.dtype(), DType::f32);
    // The fused cross-entropy reads half logits directly (computing in float): same math, the
    // order of float operations may differ from the kernel run on f32 logits.
    const bool fused_ce = c.name == "cross_entropy";
    EXPECT_TRUE(fused_ce ? all_close(got, want, 1e-6, 1e-6) : same_values(got, want));
  }
}

INSTANTIATE_TEST_SUITE_P(LowDtypes, AmpAutocastPolicy, ::testing::Values(DType::bf16, DType::f16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Ops on neither list follow their inputs (promotion), f64 is never cast.
TEST(AmpAutocastPolicyOther, UnlistedOpsPromoteAndF64IsNotCast) {
  FLAME_SKIP_IF_NO_DEVICE();
  amp::AutocastGuard ac(DType::bf16, dev_type());
  const Tensor a = rnd({4, 6}, 50), b = rnd({6, 3}, 51);
  const Tensor h = matmul(a, b);
  ASSERT_EQ(h.dtype(), DType::bf16);
  EXPECT_EQ(add(h, rnd({4, 3}, 52)).dtype(), DType::f32);  // bf16 + f32 promotes
  EXPECT_EQ(gelu(h).dtype(), DType::bf16);
  EXPECT_EQ(relu(a).dtype(), DType::f32);
  EXPECT_EQ(mean(h).dtype(), DType::bf16);
  EXPECT_EQ(sum(h).dtype(), DType::f32);
  // Mixed inputs of f32-list ops: a bf16 activation with f32 parameters or targets, which the
  // ops reject outside autocast (norm parameters must match the input's dtype).
  const Tensor g = rnd({3}, 56), bta = rnd({3}, 57);
  EXPECT_EQ(layer_norm(h, {3}, g, bta).dtype(), DType::f32);
  EXPECT_TRUE(same_values(layer_norm(h, {3}, g, bta), layer_norm(h.to(DType::f32), {3}, g, bta)));
  EXPECT_EQ(mse_loss(h, rnd({4, 3}, 58)).dtype(), DType::f32);
  {
    amp::AutocastGuard off(false, dev_type());
    expect_error([&] { (void)layer_norm(h, {3}, g, bta); }, {"layer_norm", "dtype"});
  }
  const Tensor a64 = a.to(DType::f64), b64 = b.to(DType::f64);
  EXPECT_EQ(matmul(a64, b64).dtype(), DType::f64);
  EXPECT_EQ(softmax(a64, 1).dtype(), DType::f64);
  // An integer input of an f32-list op is not cast either.
  EXPECT_EQ(sum(Tensor::ones({3}, {DType::i64, test_device()})).dtype(), DType::i64);
}

// Composite ops cast once: the attention math path runs its inner matmul/softmax in the low dtype.
TEST(AmpAutocastPolicyOther, CompositeOpsDoNotRecast) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor q = rnd({1, 2, 4, 8}, 53), k = rnd({1, 2, 5, 8}, 54), v = rnd({1, 2, 5, 8}, 55);
  nn::functional::SdpaBackendGuard math(nn::functional::SdpaBackend::math);
  const Tensor want = scaled_dot_product_attention(q.to(DType::bf16), k.to(DType::bf16), v.to(DType::bf16));
  Tensor got;
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    got = scaled_dot_product_attention(q, k, v);
  }
  // Had the inner softmax been autocast, its f32 output would make the result differ.
  EXPECT_TRUE(same_values(got, want));
}

TEST(AmpAutocastGuard, NestingDisableAndRestore) {
  const DeviceType d = DeviceType::cpu, o = DeviceType::cuda;
  EXPECT_FALSE(amp::is_autocast_enabled(d));
  const Tensor a = Tensor::randn({3, 4}, {DType::f32}), b = Tensor::randn({4, 2}, {DType::f32});
  {
    amp::AutocastGuard outer(DType::bf16, d);
    EXPECT_TRUE(amp::is_autocast_enabled(d));
    EXPECT_FALSE(amp::is_autocast_enabled(o));  // per device type
    EXPECT_EQ(matmul(a, b).dtype(), DType::bf16);
    {
      amp::AutocastGuard inner(DType::f16, d);
      EXPECT_EQ(amp::get_autocast_dtype(d), DType::f16);
      EXPECT_EQ(matmul(a, b).dtype(), DType::f16);
      {
        amp::AutocastGuard off(false, d);
        EXPECT_FALSE(amp::is_autocast_enabled(d));
        EXPECT_EQ(matmul(a, b).dtype(), DType::f32);
        {
          amp::AutocastGuard on_again(true, d);  // re-enabled keeps the enclosing dtype
          EXPECT_EQ(matmul(a, b).dtype(), DType::f16);
        }
      }
      EXPECT_EQ(matmul(a, b).dtype(), DType::f16);
    }
    EXPECT_EQ(amp::get_autocast_dtype(d), DType::bf16);
    EXPECT_EQ(matmul(a, b).dtype(), DType::bf16);
    {
      auto g = amp::autocast(DType::f16, d);
      EXPECT_EQ(matmul(a, b).dtype(), DType::f16);
    }
    // A guard for the other device type leaves CPU ops alone.
    amp::AutocastGuard cuda_off(false, o);
    EXPECT_EQ(matmul(a, b).dtype(), DType::bf16);
  }
  EXPECT_FALSE(amp::is_autocast_enabled(d));
  EXPECT_EQ(matmul(a, b).dtype(), DType::f32);
}

TEST(AmpAutocastGuard, RejectsNonHalfDtypes) {
  expect_error([] { amp::AutocastGuard g(DType::f32, DeviceType::cpu); }, {"AutocastGuard", "bf16 or f16", "f32"});
  expect_error([] { amp::AutocastGuard g(DType::f64); }, {"AutocastGuard", "f64"});
  EXPECT_FALSE(amp::is_autocast_enabled(DeviceType::cpu));
}

TEST(AmpAutocastGuard, IsThreadLocal) {
  amp::AutocastGuard ac(DType::bf16, DeviceType::cpu);
  bool other_enabled = true;
  DType other_dtype = DType::bf16;
  std::thread t([&] {
    other_enabled = amp::is_autocast_enabled(DeviceType::cpu);
    other_dtype = matmul(Tensor::ones({2, 2}), Tensor::ones({2, 2})).dtype();
  });
  t.join();
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(other_dtype, DType::f32);
}

// A weight is cast once per outermost scope; activations and frozen tensors are not cached.
// (matmul casts with a recorded op; Linear's master weights keep their copies across scopes
// instead: test_amp_kept_copy.cpp.)
TEST(AmpAutocastCache, WeightCastOncePerScope) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({6, 5}, 60);
  w.requires_grad_(true);
  const Tensor x = rnd({3, 6}, 61);
  amp::clear_autocast_cache();
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    const Tensor y1 = matmul(x, w);
    const Tensor y2 = matmul(x, w.narrow(1, 0, 5));  // a view, not a leaf: cast without the cache
    {
      amp::AutocastGuard inner(DType::bf16, dev_type());  // nested scope: same cache
      const Tensor y3 = matmul(x, w);
      EXPECT_TRUE(same_values(y3, y1));
    }
    const Tensor y4 = matmul(x * 2.0, w);
    auto s = amp::autocast_cache_stats();
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(s.hits, 2u);
    EXPECT_EQ(s.entries, 1u);
    // An in-place update of the weight inside the scope makes a new cast.
    {
      NoGradGuard ng;
      w.mul_(0.5);
    }
    const Tensor y5 = matmul(x, w);
    s = amp::autocast_cache_stats();
    EXPECT_EQ(s.misses, 2u);
    const Tensor want = matmul(x.to(DType::bf16), w.detach().to(DType::bf16));
    EXPECT_TRUE(same_values(y5.detach(), want));
  }
  EXPECT_EQ(amp::autocast_cache_stats().entries, 0u);  // cleared by the outermost guard
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    (void)matmul(x, w);
    EXPECT_EQ(amp::autocast_cache_stats().misses, 1u);  // a new scope casts again
  }
}

// Gradients reach the f32 leaves in f32, through the cached cast, equal to the same computation
// with explicit casts.
TEST(AmpAutocastCache, GradientsReachF32Leaves) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({6, 6}, 62), b = rnd({6}, 63);
  w.requires_grad_(true);
  b.requires_grad_(true);
  const Tensor x = rnd({4, 6}, 64);
  Tensor loss;
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    const Tensor h = linear(x, w, b).gelu();
    const Tensor y = linear(h, w, b);  // the same weight twice: one cast, two uses
    loss = mse_loss(y, Tensor::zeros({4, 6}, {DType::f32, test_device()}));
  }
  ASSERT_EQ(loss.dtype(), DType::f32);
  const Gradients g = loss.backward();
  ASSERT_TRUE(g.contains(w) && g.contains(b));
  EXPECT_EQ(g.get(w).dtype(), DType::f32);
  EXPECT_EQ(g.get(b).dtype(), DType::f32);

  // Reference: explicit casts, no autocast.
  Tensor w2 = w.detach().clone(), b2 = b.detach().clone();
  w2.requires_grad_(true);
  b2.requires_grad_(true);
  const Tensor wl = w2.to(DType::bf16), bl = b2.to(DType::bf16), xl = x.to(DType::bf16);
  const Tensor h2 = linear(xl, wl, bl).gelu();
  const Tensor y2 = linear(h2, wl, bl);
  const Tensor loss2 = mse_loss(y2.to(DType::f32), Tensor::zeros({4, 6}, {DType::f32, test_device()}));
  const Gradients g2 = loss2.backward();
  EXPECT_TRUE(all_close(loss, loss2, 0.0, 0.0));
  // Each use's weight gradient reaches the f32 leaf on its own and the two add in f32 (Note
  // [Master-weight epilogues]), where the explicit casts add them in bf16 before the cast up.
  EXPECT_TRUE(all_close(g.get(w), g2.get(w2), 2e-2, 2e-2));
  EXPECT_TRUE(all_close(g.get(b), g2.get(b2), 2e-2, 2e-2));
}

// Two forward/backward passes inside one scope (gradient accumulation): the second pass does not
// reuse a cast whose node the first backward released.
TEST(AmpAutocastCache, SecondBackwardInOneScope) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({4, 5}, 65);
  w.requires_grad_(true);
  amp::AutocastGuard ac(DType::bf16, dev_type());
  Gradients acc;
  for (int i = 0; i < 2; ++i) {
    // matmul casts w with a recorded op (linear would hand the f32 master weight to its node and
    // read a graph-free copy, which a second pass may reuse: Note [Master-weight epilogues]).
    const Tensor loss = rnd({3, 4}, 66 + static_cast<uint64_t>(i)).matmul(w).sum();
    BackwardOptions opts;
    opts.accumulate_into = &acc;
    (void)loss.backward(opts);
  }
  ASSERT_TRUE(acc.contains(w));
  EXPECT_EQ(acc.get(w).dtype(), DType::f32);
  EXPECT_EQ(amp::autocast_cache_stats().misses, 2u);
}

// Backward runs with autocast off: a hook computing a matmul during backward gets f32.
TEST(AmpAutocastBackward, RunsWithAutocastOff) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({4, 5}, 70);
  w.requires_grad_(true);
  const Tensor x = rnd({3, 5}, 71);
  bool enabled_in_hook = true;
  DType hook_matmul = DType::bf16;
  amp::AutocastGuard ac(DType::bf16, dev_type());
  Tensor h = linear(x, w);
  h.register_hook([&](const Tensor& g) {
    enabled_in_hook = amp::is_autocast_enabled(dev_type());
    hook_matmul = matmul(x, x.t()).dtype();
    return g;
  });
  const Tensor loss = h.sum();
  EXPECT_EQ(loss.dtype(), DType::f32);
  const Gradients g = loss.backward();  // inside the autocast scope on purpose
  EXPECT_FALSE(enabled_in_hook);
  EXPECT_EQ(hook_matmul, DType::f32);
  EXPECT_EQ(g.get(w).dtype(), DType::f32);
  EXPECT_TRUE(amp::is_autocast_enabled(dev_type()));  // back on after backward
  EXPECT_EQ(matmul(x, x.t()).dtype(), DType::bf16);
}

// checkpoint() recomputes under the autocast state of its first forward: same gradients as the
// plain run, although backward itself runs with autocast off.
TEST(AmpAutocastBackward, CheckpointRecomputesUnderAutocast) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({6, 6}, 72);
  w.requires_grad_(true);
  Tensor x = rnd({4, 6}, 73);
  x.requires_grad_(true);
  auto block = [&](const TensorList& in) { return linear(in[0], w).gelu(); };
  Tensor plain, ck;
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    plain = block({x}).sum();
    ck = checkpoint(block, {x}).sum();
  }
  const Gradients gp = plain.backward(), gc = ck.backward();
  EXPECT_TRUE(all_close(plain, ck, 0.0, 0.0));
  EXPECT_TRUE(all_close(gc.get(w), gp.get(w), 0.0, 0.0));
  EXPECT_TRUE(all_close(gc.get(x), gp.get(x), 0.0, 0.0));
  EXPECT_FALSE(amp::is_autocast_enabled(dev_type()));
}

// The same autocast forward and backward on CUDA and on the CPU agree.
TEST(AmpAutocastCuda, MatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cpu = Device::cpu(), gpu = Device::cuda(0);
  auto run = [](Device dev) {
    const Tensor x0 = make_input({{8, 16}, DType::f32, Layout::contiguous, -1, 1}, dev, 80);
    Tensor w = make_input({{16, 16}, DType::f32, Layout::contiguous, -0.3, 0.3}, dev, 81);
    w.requires_grad_(true);
    Tensor loss;
    {
      amp::AutocastGuard ac(DType::bf16, dev.type);
      const Tensor h = layer_norm(linear(x0, w).gelu(), {16});
      loss = cross_entropy(linear(h, w), make_input({{8}, DType::i64, Layout::contiguous, 0, 16}, dev, 82));
    }
    const Gradients g = loss.backward();
    return std::make_pair(loss.to(Device::cpu()), g.get(w).to(Device::cpu()));
  };
  const auto [lc, gc] = run(cpu);
  const auto [lg, gg] = run(gpu);
  EXPECT_EQ(lg.dtype(), DType::f32);
  // bf16 GEMMs accumulate in float on both sides, in different orders; one bf16 rounding of an
  // intermediate may flip: 1e-2 relative.
  EXPECT_TRUE(all_close(lg, lc, 1e-2, 1e-3));
  EXPECT_TRUE(all_close(gg, gc, 2e-2, 2e-3));
}

}  // namespace
}  // namespace flame::test
