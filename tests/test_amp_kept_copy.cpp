// Kept low-precision copies of f32 master weights (Note [Kept low-precision copies] in
// src/amp/autocast.cpp): Linear under autocast reads a bf16 copy that lives across steps, the
// fused optimizers rewrite it beside the weight, anything else that changes the weight makes the
// next forward rewrite it, and a captured step's replays find it up to date. Suite AmpKeptCopy
// runs on the device under test (the CPU by default); AmpKeptCopyCuda needs a GPU.
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flame/amp.h"
#include "flame/cuda.h"
#include "flame/cuda/graph_step.h"
#include "flame/flame.h"
#include "flame/nn.h"
#include "flame/nn/linear_gelu.h"
#include "flame/optim/optimizers.h"
#include "test_util.h"

// Internal (src/amp/autocast.h; libflame exports it): the kept copy an optimizer would write.
namespace flame::amp::detail {
Tensor low_copy_for_update(const Tensor& w);
}

namespace flame::test {
namespace {

namespace F = nn::functional;

DeviceType dev_type() { return test_device().type; }

Tensor rnd(const Shape& shape, uint64_t seed, double scale = 1.0) {
  return make_input({shape, DType::f32, Layout::contiguous, -scale, scale}, test_device(), seed);
}

// A two-layer MLP on f32 master weights: linear_gelu then linear, both through the master path.
struct Net {
  TensorList params;  // w1, b1, w2, b2
  Net(int64_t in, int64_t hidden, int64_t out, uint64_t seed) {
    params = {rnd({hidden, in}, seed, 0.3), rnd({hidden}, seed + 1, 0.1), rnd({out, hidden}, seed + 2, 0.2),
              rnd({out}, seed + 3, 0.1)};
    for (Tensor& p : params) p.requires_grad_(true);
  }
  Net(const Net& o, int) {
    for (const Tensor& p : o.params) params.push_back(p.detach().clone().requires_grad_(true));
  }
  Tensor forward(const Tensor& x) const {
    const Tensor h = F::linear_gelu(x, params[0], params[1]);
    return F::linear(h, params[2], params[3]);
  }
  // Makes every weight's kept copy stale without changing a bit of the weight.
  void touch() {
    NoGradGuard ng;
    for (Tensor& p : params) p.mul_(1.0);
  }
};

struct StepStats {
  Tensor loss;
  amp::AutocastCacheStats cache;
};

StepStats train_step(const Net& net, const Tensor& x, const Tensor& y, optim::Optimizer& opt,
                     DeviceType dt = dev_type()) {
  StepStats out;
  {
    amp::AutocastGuard ac(DType::bf16, dt);
    out.loss = mse_loss(net.forward(x), y);
    out.cache = amp::autocast_cache_stats();
  }
  const Gradients g = out.loss.backward();
  opt.step(g);
  out.loss = out.loss.detach();
  return out;
}

TEST(AmpKeptCopy, LinearKeepsItsCopyAcrossScopes) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({8, 16}, 1), b = rnd({8}, 2);
  w.requires_grad_(true);
  b.requires_grad_(true);
  const Tensor x = rnd({4, 16}, 3);
  auto want = [&] { return F::linear(x.to(DType::bf16), w.detach().to(DType::bf16), b.detach().to(DType::bf16)); };
  // One forward in a new scope: the copies it wrote and found, and its value.
  auto expect_forward = [&](uint64_t writes, uint64_t hits) {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    const Tensor y = F::linear(x, w, b);
    const auto s = amp::autocast_cache_stats();
    EXPECT_EQ(s.low_copy_writes, writes);
    EXPECT_EQ(s.low_copy_hits, hits);
    EXPECT_TRUE(all_close(y.detach(), want(), 0.0, 0.0));
  };
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    const Tensor y = F::linear(x, w, b);
    auto s = amp::autocast_cache_stats();
    EXPECT_EQ(s.low_copy_writes, 2u);  // weight and bias
    EXPECT_EQ(s.low_copy_hits, 0u);
    EXPECT_EQ(s.misses, 0u);  // not the scope cache
    EXPECT_TRUE(all_close(y.detach(), want(), 0.0, 0.0));
    (void)F::linear(x * 2.0, w, b);
    EXPECT_EQ(amp::autocast_cache_stats().low_copy_hits, 2u);
  }
  expect_forward(0, 2);  // a new scope keeps the copies
  {
    NoGradGuard ng;
    w.mul_(0.5);  // an edit outside any optimizer: the next forward rewrites w's copy only
  }
  expect_forward(1, 1);
  {
    // No gradient wanted (evaluation): an up-to-date copy is used, none is made or rewritten.
    NoGradGuard ng;
    amp::AutocastGuard ac(DType::bf16, dev_type());
    const Tensor y = F::linear(x, w, b);
    EXPECT_EQ(amp::autocast_cache_stats().low_copy_hits, 2u);
    EXPECT_TRUE(all_close(y, want(), 0.0, 0.0));
    w.mul_(2.0);
    const Tensor y2 = F::linear(x, w, b);
    const auto s = amp::autocast_cache_stats();
    EXPECT_EQ(s.low_copy_hits, 3u);  // the bias only; the stale weight copy is left alone
    EXPECT_EQ(s.low_copy_writes, 0u);
    EXPECT_TRUE(all_close(y2, want(), 0.0, 0.0));
  }
}

// set_data (Module::to, weight streaming) gives the handle other data: the copy is dropped with
// the old data (no device memory kept for it), and the next forward makes one from the new data.
TEST(AmpKeptCopy, SetDataDropsTheCopy) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({8, 16}, 6);
  w.requires_grad_(true);
  const Tensor x = rnd({4, 16}, 7);
  {
    amp::AutocastGuard ac(DType::bf16, dev_type());
    (void)F::linear(x, w);
  }
  EXPECT_TRUE(amp::detail::low_copy_for_update(w).defined());
  w.set_data(rnd({8, 16}, 8));
  EXPECT_FALSE(amp::detail::low_copy_for_update(w).defined());
  amp::AutocastGuard ac(DType::bf16, dev_type());
  const Tensor y = F::linear(x, w);
  EXPECT_EQ(amp::autocast_cache_stats().low_copy_writes, 1u);
  EXPECT_TRUE(all_close(y.detach(), F::linear(x.to(DType::bf16), w.detach().to(DType::bf16)), 0.0, 0.0));
}

// A graph that saved the copy before a rewrite cannot silently read the new values.
TEST(AmpKeptCopy, BackwardAfterTheCopyWasRewrittenRaises) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = rnd({8, 16}, 4), x = rnd({4, 16}, 5);
  w.requires_grad_(true);
  x.requires_grad_(true);  // the data gradient reads the copy
  amp::AutocastGuard ac(DType::bf16, dev_type());
  const Tensor y1 = F::linear(x, w);
  {
    NoGradGuard ng;
    w.mul_(0.5);
  }
  (void)F::linear(x, w);  // rewrites the copy y1's node saved
  expect_error([&] { (void)y1.sum().backward(); }, {"in-place"});
}

// Runs `steps` training steps of two equal nets with optimizers built by `make`: in `kept` the
// copies are whatever the optimizer left; in `ref` they are made stale after every step, so each
// forward casts afresh. Everything must agree bit for bit. `written` says whether the optimizer
// writes the copies (then `kept`'s forwards after the first make none).
void expect_kept_copies_exact(const std::function<std::unique_ptr<optim::Optimizer>(const TensorList&)>& make,
                              bool written, const char* name) {
  Net kept(32, 64, 16, 10), ref(kept, 0);
  auto ok = make(kept.params), oref = make(ref.params);
  for (int t = 0; t < 4; ++t) {
    const Tensor x = rnd({24, 32}, 100 + t), y = rnd({24, 16}, 200 + t);
    const StepStats a = train_step(kept, x, y, *ok);
    const StepStats b = train_step(ref, x, y, *oref);
    ref.touch();
    const std::string at = std::string(name) + " step " + std::to_string(t);
    EXPECT_TRUE(same_bits(a.loss, b.loss, at + " loss"));
    for (std::size_t i = 0; i < kept.params.size(); ++i)
      EXPECT_TRUE(same_bits(kept.params[i], ref.params[i], at + " param " + std::to_string(i)));
    EXPECT_EQ(b.cache.low_copy_writes, 4u) << at;
    EXPECT_EQ(a.cache.low_copy_writes, t == 0 || !written ? 4u : 0u) << at;
    EXPECT_EQ(a.cache.low_copy_hits, t == 0 || !written ? 0u : 4u) << at;
  }
}

TEST(AmpKeptCopy, FusedOptimizersWriteTheCopyBitForBit) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_kept_copies_exact(
      [](const TensorList& p) { return std::make_unique<optim::AdamW>(p, optim::AdamWOptions{.lr = 1e-2}); }, true,
      "AdamW");
  expect_kept_copies_exact(
      [](const TensorList& p) {
        return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 1e-2, .momentum = 0.9});
      },
      true, "SGD");
  expect_kept_copies_exact(
      [](const TensorList& p) { return std::make_unique<optim::Lion>(p, optim::LionOptions{.lr = 1e-3}); }, true,
      "Lion");
}

// Adafactor updates with ordinary ops: its steps leave the copies stale, and the next forward
// rewrites them.
TEST(AmpKeptCopy, UnfusedOptimizerLeavesCopiesToTheForward) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_kept_copies_exact(
      [](const TensorList& p) { return std::make_unique<optim::Adafactor>(p, optim::AdafactorOptions{}); }, false,
      "Adafactor");
}

// A captured step reads the copies without casting; its own optimizer keeps them equal to the
// weights, and an edit of a weight between replays reaches the next replay.
TEST(AmpKeptCopyCuda, ReplayedStepsReadCopiesTheOptimizerWrites) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cuda = Device::cuda(0);
  auto on_cuda = [&](Net& n) {
    for (Tensor& p : n.params) p = p.detach().to(cuda).requires_grad_(true);
  };
  Net eager(32, 64, 16, 20), graphed(eager, 0);
  on_cuda(eager);
  on_cuda(graphed);
  optim::AdamW oe(eager.params, {.lr = 1e-2}), og(graphed.params, {.lr = 1e-2, .capturable = true});
  Tensor x = Tensor::empty({24, 32}, {DType::f32, cuda}), y = Tensor::empty({24, 16}, {DType::f32, cuda});
  StepStats out;
  cuda::GraphedStep step([&] { out = train_step(graphed, x, y, og, DeviceType::cuda); }, {.warmup_steps = 2});
  for (int t = 0; t < 7; ++t) {
    const Tensor xt = rnd({24, 32}, 300 + t).to(cuda), yt = rnd({24, 16}, 400 + t).to(cuda);
    const StepStats ref = train_step(eager, xt, yt, oe, DeviceType::cuda);
    cuda::GraphedStep::copy_input(x, xt);
    cuda::GraphedStep::copy_input(y, yt);
    step();
    if (t == 2) EXPECT_EQ(out.cache.low_copy_hits, 4u) << "the captured forward reads the kept copies";
    const std::string at = "step " + std::to_string(t);
    EXPECT_TRUE(same_bits(out.loss, ref.loss, at + " loss"));
    for (std::size_t i = 0; i < eager.params.size(); ++i)
      EXPECT_TRUE(same_bits(graphed.params[i], eager.params[i], at + " param " + std::to_string(i)));
    if (t == 4) {
      NoGradGuard ng;
      for (Net* n : {&eager, &graphed}) {
        n->params[0].mul_(0.5);
        n->params[3].add_(0.25);
      }
    }
  }
  EXPECT_EQ(step.replays(), 5);
}

// An optimizer step captured alone (cuda::Graph) and replayed: each replay advances the weights'
// versions as an eager step would, so a forward after it never reads a copy made before it.
// copies_at_capture: the copies exist when the step is captured (the graph writes them) or are
// made only afterwards (the graph cannot write them; the forward must rewrite them).
void expect_replayed_optimizer_keeps_copies_right(bool copies_at_capture) {
  SCOPED_TRACE(copies_at_capture ? "copies made before the capture" : "copies made after the capture");
  const Device cuda = Device::cuda(0);
  Net net(32, 64, 16, 40);
  for (Tensor& p : net.params) p = p.detach().to(cuda).requires_grad_(true);
  optim::AdamW opt(net.params, {.lr = 1e-2, .capturable = true});
  Gradients grads;
  for (std::size_t i = 0; i < net.params.size(); ++i) grads.set(net.params[i], rnd(net.params[i].sizes(), 50 + i).to(cuda));
  const Tensor x = rnd({24, 32}, 60).to(cuda), y = rnd({24, 16}, 61).to(cuda);
  auto forward = [&](amp::AutocastCacheStats* stats) {
    amp::AutocastGuard ac(DType::bf16, DeviceType::cuda);
    const Tensor loss = mse_loss(net.forward(x), y).detach();
    if (stats) *stats = amp::autocast_cache_stats();
    return loss;
  };
  opt.step(grads);  // eager: the optimizer's state
  if (copies_at_capture) (void)forward(nullptr);
  cuda::Graph graph;
  cuda::capture(graph, [&] { opt.step(grads); });
  if (!copies_at_capture) (void)forward(nullptr);
  const uint64_t v0 = net.params[0].version();
  graph.replay();
  EXPECT_GT(net.params[0].version(), v0) << "a replay advances the updated weights' versions";
  amp::AutocastCacheStats st;
  const Tensor got = forward(&st);
  EXPECT_EQ(st.low_copy_writes, copies_at_capture ? 0u : 4u);
  EXPECT_EQ(st.low_copy_hits, copies_at_capture ? 4u : 0u);
  net.touch();  // the reference: every copy rewritten from the weights as they are now
  EXPECT_TRUE(same_bits(got, forward(nullptr), "loss after the replay"));
}

TEST(AmpKeptCopyCuda, ReplayedOptimizerStepAdvancesVersions) {
  FLAME_SKIP_IF_NO_CUDA();
  expect_replayed_optimizer_keeps_copies_right(true);
  expect_replayed_optimizer_keeps_copies_right(false);
}

}  // namespace
}  // namespace flame::test
