// Saved-tensor hooks, activation offload, weight streaming and the host optimizer
// (include/flame/offload.h, docs/offload.md). Cases run on the test device (FLAME_TEST_DEVICE);
// the CPU run checks the logic (hooks, the wrappers with a CPU "device"), the CUDA run the
// streams, pinned copies and memory. CUDA-only cases skip without a GPU.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "flame/nn.h"
#include "flame/offload.h"
#include "test_util.h"

namespace flame::test {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// A small SGD (with momentum) written on the optim::Optimizer base only, as the brief's
// optimizers are written elsewhere: p -= lr * (buf = momentum * buf + g).
class TestSgd : public optim::Optimizer {
 public:
  TestSgd(const TensorList& params, double lr, double momentum = 0.0) {
    optim::ParamGroup g;
    g.params = params;
    g.lr = lr;
    g.momentum = momentum;
    groups_.push_back(g);
  }
  void step(const Gradients& grads) override {
    NoGradGuard no_grad;
    for (const auto& group : groups_) {
      for (Tensor p : group.params) {
        Tensor g = grads.try_get(p);
        if (!g.defined()) continue;
        Tensor upd = g;
        if (group.momentum != 0.0) {
          Tensor& buf = buffers_[p.impl()];
          buf = buf.defined() ? buf * group.momentum + g : g.clone();
          upd = buf;
        }
        p.sub_(upd * group.lr);
      }
    }
  }
  std::string name() const override { return "TestSgd"; }
  MomentumKind momentum_kind() const override { return MomentumKind::momentum; }
  StateDict state_dict() const override {
    StateDict s;
    const TensorList& ps = groups_[0].params;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      auto it = buffers_.find(ps[k].impl());
      if (it != buffers_.end()) s.insert("buf." + std::to_string(k), it->second.clone());
    }
    return s;
  }
  void load_state_dict(const StateDict& s) override {
    const TensorList& ps = groups_[0].params;
    std::map<const TensorImpl*, Tensor> next;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      if (const Tensor* t = s.find("buf." + std::to_string(k))) next[ps[k].impl()] = t->clone();
    }
    buffers_ = std::move(next);
  }

 private:
  std::map<const TensorImpl*, Tensor> buffers_;
};

Tensor random_tensor(const Shape& shape, uint64_t seed, Device device, double scale = 1.0) {
  Generator g(seed);
  return Tensor::uniform(shape, -scale, scale, DType::f32, &g).to(device);
}

// A tanh MLP whose forward saves several activations per layer.
struct Mlp {
  TensorList weights;
  Mlp(int64_t width, int layers, Device device, uint64_t seed) {
    for (int l = 0; l < layers; ++l) {
      weights.push_back(random_tensor({width, width}, seed + l, device, 1.0 / std::sqrt(double(width))).requires_grad_());
    }
  }
  Tensor forward(const Tensor& x) const {
    Tensor h = x;
    for (const Tensor& w : weights) h = (h.matmul(w)).tanh() * 1.5 + h.sigmoid();
    return h;
  }
};

// ---- saved-tensor hooks ----

TEST(OffloadSavedHooks, PackAndUnpackSeeEverySavedActivationButNoParameter) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Mlp mlp(33, 3, dev, 100);
  Tensor x = random_tensor({7, 33}, 5, dev);
  const Gradients plain = mlp.forward(x).sum().backward();
  int packs = 0, unpacks = 0;
  Gradients hooked;
  {
    Tensor y;
    {
      autograd::SavedTensorHooks hooks(
          [&](const Tensor& t) -> std::any {
            ++packs;
            EXPECT_FALSE(t.requires_grad());  // the hook sees a detached tensor
            for (const Tensor& w : mlp.weights) EXPECT_FALSE(t.shares_storage(w)) << "a parameter was packed";
            return t.clone();  // the graph keeps only this copy
          },
          [&](const std::any& v) -> Tensor {
            ++unpacks;
            return std::any_cast<Tensor>(v);
          });
      y = mlp.forward(x).sum();
    }
    EXPECT_GT(packs, 0);
    EXPECT_EQ(unpacks, 0);
    hooked = y.backward();  // the hooks outlived their scope in the packed tensors
  }
  EXPECT_EQ(unpacks, packs);
  for (const Tensor& w : mlp.weights) EXPECT_TRUE(all_close(hooked.get(w), plain.get(w), 0, 0));
}

TEST(OffloadSavedHooks, InnermostHooksApplyAndUnpackMustReturnTheSavedShape) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor w = random_tensor({5, 5}, 1, dev).requires_grad_();
  int outer = 0, inner = 0;
  auto id_unpack = [](const std::any& v) { return std::any_cast<Tensor>(v); };
  Tensor y;
  {
    autograd::SavedTensorHooks a([&](const Tensor& t) -> std::any { ++outer; return t; }, id_unpack);
    {
      autograd::SavedTensorHooks b([&](const Tensor& t) -> std::any { ++inner; return t; }, id_unpack);
      y = (w * 2).exp().sum();
    }
    EXPECT_GT(inner, 0);
    EXPECT_EQ(outer, 0);
    Tensor z = (w * 3).exp().sum();
    EXPECT_GT(outer, 0);
  }
  (void)y.backward();
  // A broken unpack is reported with the op and the expected shape.
  Tensor bad;
  {
    autograd::SavedTensorHooks h([](const Tensor& t) -> std::any { return t; },
                                 [](const std::any& v) { return std::any_cast<Tensor>(v).reshape({-1}); });
    bad = (w * 2).exp().sum();
  }
  expect_error([&] { (void)bad.backward(); }, {"SavedTensorHooks", "[5, 5]"});
}

TEST(OffloadSavedHooks, InPlaceWriteAfterTheSaveIsStillDetected) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor w = random_tensor({4, 6}, 2, dev).requires_grad_();
  offload::OffloadActivations guard;
  Tensor e = (w * 1.0).exp();  // exp saves its output
  Tensor loss = e.sum();
  {
    NoGradGuard no_grad;
    e.add_(1.0);  // the saved output's storage is written after the save
  }
  expect_error([&] { (void)loss.backward(); }, {"modified by an in-place op"});
}

// ---- activation offload ----

TEST(OffloadActivations, GivesTheSameGradientsAsWithoutOffload) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Mlp mlp(64, 4, dev, 200);
  Tensor x = random_tensor({19, 64}, 9, dev).requires_grad_();
  const Gradients plain = mlp.forward(x).square().mean().backward();
  Gradients off;
  int64_t packed = 0, prefetched = 0;
  {
    Tensor loss;
    offload::OffloadActivations guard;
    loss = mlp.forward(x).square().mean();
    packed = guard.packed_count();
    EXPECT_GT(guard.packed_bytes(), 4u * 19 * 64 * 4);
    off = loss.backward();
    prefetched = guard.prefetched_count();
  }
  EXPECT_GE(packed, 8);
  if (dev.is_cuda()) EXPECT_GT(prefetched, 0);
  // The copies are exact: the gradients are bit-identical.
  EXPECT_TRUE(all_close(off.get(x), plain.get(x), 0, 0));
  for (const Tensor& w : mlp.weights) EXPECT_TRUE(all_close(off.get(w), plain.get(w), 0, 0));
  // With checkpointed blocks only the checkpoint inputs are saved (and offloaded).
  Gradients ck;
  {
    offload::OffloadActivations guard;
    Tensor h = x;
    for (const Tensor& w : mlp.weights) {
      h = checkpoint([w](const TensorList& in) { return (in[0].matmul(w)).tanh() * 1.5 + in[0].sigmoid(); }, {h});
    }
    Tensor loss = h.square().mean();
    // x is a leaf that requires grad (not packed): the inputs of blocks 1-3, and the loss's input.
    EXPECT_GE(guard.packed_count(), 3);
    EXPECT_LT(guard.packed_count(), packed);
    ck = loss.backward();
  }
  for (const Tensor& w : mlp.weights) EXPECT_TRUE(all_close(ck.get(w), plain.get(w), 1e-6, 1e-7));
}

// A frozen weight that a matmul saves (for its input's gradient) and anything sharing its storage
// (a transposed view) stays on the device with `keep`; the activations still move.
TEST(OffloadActivations, KeepLeavesAModulesTensorsWhereTheyAre) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor w = random_tensor({32, 32}, 4, dev);  // frozen: no gradient
  const Tensor x = random_tensor({8, 32}, 5, dev).requires_grad_();
  auto run = [&](TensorList keep, int64_t* packed) {
    offload::OffloadActivations guard({.keep = std::move(keep)});
    const Tensor loss = (x.matmul(w.t()).tanh()).matmul(w).square().sum();
    *packed = guard.packed_count();
    return loss.backward().get(x);
  };
  int64_t all = 0, kept = 0;
  const Tensor g_all = run({}, &all), g_kept = run({w}, &kept);
  EXPECT_EQ(kept, all - 2) << "both saves of w (one through its transposed view) stay";
  EXPECT_GE(kept, 1) << "the tanh output still moves";
  // (A clone of the transposed view is contiguous: another GEMM layout, within rounding.)
  EXPECT_TRUE(all_close(g_kept, g_all, 1e-5, 1e-5));
}

TEST(OffloadActivations, LowersTheGpuPeak) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  Mlp mlp(1024, 6, dev, 300);
  Tensor x = random_tensor({4096, 1024}, 3, dev);  // 16 MiB per activation
  auto run = [&](bool offload) {
    cuda::synchronize();
    cuda::reset_peak_memory_stats();
    const std::size_t base = cuda::memory_stats().allocated_bytes;
    Gradients g;
    {
      std::unique_ptr<offload::OffloadActivations> guard;
      if (offload) guard = std::make_unique<offload::OffloadActivations>();
      Tensor loss = mlp.forward(x).square().mean();
      guard.reset();
      g = loss.backward();
    }
    cuda::synchronize();
    return std::make_pair(cuda::memory_stats().peak_allocated_bytes - base, g);
  };
  const auto [peak_plain, g_plain] = run(false);
  const auto [peak_off, g_off] = run(true);
  for (const Tensor& w : mlp.weights) EXPECT_TRUE(all_close(g_off.get(w), g_plain.get(w), 0, 0));
  // Without offload every layer keeps ~3 activations (48 MiB) alive until backward.
  EXPECT_GT(peak_plain, 6 * 40 * kMiB);
  EXPECT_LT(peak_off, peak_plain * 6 / 10) << "plain " << peak_plain << " offload " << peak_off;
}

// prefetch_bytes: the first unpack of the backward starts the copies of the older tensors up to the
// window, so every later unpack finds its tensor prefetched (one tensor ahead finds all but the
// first too, but each starts only at the unpack before it); the same gradients.
TEST(OffloadActivations, PrefetchBytesBringsOlderTensorsBackAhead) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  Mlp mlp(256, 4, dev, 310);
  const Tensor x = random_tensor({512, 256}, 4, dev);
  auto run = [&](std::size_t window, int64_t* packed, int64_t* hits) {
    offload::OffloadActivations guard({.prefetch_bytes = window});
    const Tensor loss = mlp.forward(x).square().mean();
    *packed = guard.packed_count();
    Gradients g = loss.backward();
    *hits = guard.prefetched_count();
    return g;
  };
  int64_t packed1 = 0, hits1 = 0, packed_w = 0, hits_w = 0;
  const Gradients one = run(0, &packed1, &hits1);
  const Gradients wide = run(std::size_t{1} << 30, &packed_w, &hits_w);
  EXPECT_EQ(packed_w, packed1);
  EXPECT_GE(packed_w, 8);
  EXPECT_EQ(hits_w, packed_w - 1) << "every unpack but the first was prefetched";
  for (const Tensor& w : mlp.weights) EXPECT_TRUE(all_close(wide.get(w), one.get(w), 0, 0));
}

// ---- weight streaming ----

struct Block : nn::Module {
  std::shared_ptr<nn::Linear> fc;
  explicit Block(int64_t d) { fc = register_module("fc", std::make_shared<nn::Linear>(d, d)); }
  std::string name() const override { return "Block"; }
  Tensor forward(const Tensor& x) override { return x + fc->forward(x).tanh(); }
};

std::vector<nn::ModulePtr> make_blocks(int n, int64_t d) {
  std::vector<nn::ModulePtr> blocks;
  for (int i = 0; i < n; ++i) blocks.push_back(std::make_shared<Block>(d));
  return blocks;
}

// A reference copy of `blocks` (same values, CPU, not streamed).
std::vector<nn::ModulePtr> clone_blocks(const std::vector<nn::ModulePtr>& blocks, int64_t d) {
  std::vector<nn::ModulePtr> out = make_blocks(static_cast<int>(blocks.size()), d);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    StateDict sd;
    for (const auto& [k, t] : blocks[i]->state_dict()) sd.insert(k, t.to(Device::cpu()).clone());
    out[i]->load_state_dict(sd);
  }
  return out;
}

Tensor run_plain(const std::vector<nn::ModulePtr>& blocks, const Tensor& x) {
  Tensor h = x;
  for (const auto& b : blocks) h = b->forward(h);
  return h;
}

TEST(OffloadWeights, StreamedGradientsMatchTheUnstreamedOnes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t d = 48;
  auto blocks = make_blocks(5, d);
  auto ref = clone_blocks(blocks, d);
  offload::StreamedBlocks streamed(blocks, dev);
  // Parameters stay host tensors, with the usual names.
  const auto named = streamed.named_parameters();
  ASSERT_EQ(named.size(), 10u);
  EXPECT_EQ(named[0].first, "0.fc.weight");
  for (const auto& [name, p] : named) {
    EXPECT_TRUE(p.device().is_cpu()) << name;
    EXPECT_EQ(p.is_pinned(), dev.is_cuda()) << name;
  }
  Tensor x_cpu = random_tensor({6, d}, 77, Device::cpu()).requires_grad_();
  Tensor x = x_cpu.detach().to(dev).requires_grad_();
  Tensor loss = streamed.forward(x).square().mean();
  Gradients g = loss.backward();
  Gradients gr = run_plain(ref, x_cpu).square().mean().backward();
  const float want = run_plain(ref, x_cpu).square().mean().item<float>();
  EXPECT_NEAR(loss.item<float>(), want, 2e-5 * std::max(1.0f, std::abs(want)));
  EXPECT_TRUE(all_close(g.get(x).to(Device::cpu()), gr.get(x_cpu), 1e-4, 1e-6));
  const auto ref_named = [&] {
    std::vector<std::pair<std::string, Tensor>> v;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      for (const auto& [k, t] : ref[i]->named_parameters()) v.emplace_back(std::to_string(i) + "." + k, t);
    }
    return v;
  }();
  for (std::size_t k = 0; k < named.size(); ++k) {
    Tensor gp = g.get(named[k].second);
    ASSERT_TRUE(gp.defined()) << named[k].first;
    EXPECT_TRUE(gp.device().is_cpu());
    EXPECT_TRUE(all_close(gp, gr.get(ref_named[k].second), 1e-4, 1e-6)) << named[k].first;
  }
  EXPECT_GE(streamed.uploads(), 10);  // each block forward and backward
  if (dev.is_cuda()) EXPECT_GT(streamed.prefetched_uploads(), 0);
}

TEST(OffloadWeights, ComposesWithActivationOffload) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t d = 40;
  offload::StreamedBlocks streamed(make_blocks(4, d), dev);
  Tensor x = random_tensor({9, d}, 31, dev).requires_grad_();
  const Gradients plain = streamed.forward(x).square().mean().backward();
  Gradients both;
  {
    offload::OffloadActivations guard;
    Tensor loss = streamed.forward(x).square().mean();
    // The block nodes save only their inputs: blocks 1-3 (x is a leaf) and the loss's input.
    EXPECT_GE(guard.packed_count(), 3);
    EXPECT_LE(guard.packed_count(), 5);
    both = loss.backward();
  }
  EXPECT_TRUE(all_close(both.get(x), plain.get(x), 1e-6, 1e-7));
  for (const Tensor& p : streamed.parameters()) EXPECT_TRUE(all_close(both.get(p), plain.get(p), 1e-6, 1e-7));
}

TEST(OffloadWeights, AnOptimizerStepIsSeenByTheNextForwardEvenAfterAPrefetch) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t d = 16;
  auto blocks = make_blocks(3, d);
  auto ref = clone_blocks(blocks, d);
  nn::ModuleList list;
  for (const auto& b : blocks) list.push_back(b);
  offload::StreamedBlocks streamed(list, dev);
  ASSERT_EQ(streamed.size(), 3u);
  EXPECT_EQ(streamed.block(2), blocks[2]);
  Tensor x = random_tensor({4, d}, 8, dev);
  (void)streamed.forward(x).sum();  // leaves the last block's upload prefetched for a backward
  {
    NoGradGuard no_grad;  // change every host weight, as an optimizer step would
    for (Tensor p : streamed.parameters()) p.mul_(0.5);
    for (const auto& b : ref) {
      for (Tensor p : b->parameters()) p.mul_(0.5);
    }
  }
  Tensor y = streamed.forward(x);
  EXPECT_TRUE(all_close(y.to(Device::cpu()), run_plain(ref, x.to(Device::cpu())), 1e-5, 1e-6));
}

TEST(OffloadWeights, AModelLargerThanTheMemoryCapTrainsAndMatchesTheCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  const int64_t d = 2048;  // 16 MiB of weights per block, 256 MiB in all (512 MiB with gradients)
  auto blocks = make_blocks(16, d);
  auto ref = clone_blocks(blocks, d);
  cuda::synchronize();
  cuda::empty_cache();
  // The cap holds 10 blocks' weights but streaming needs ~3 blocks live (the one running, the one
  // prefetched, a weight gradient). The driver pool reserves memory in chunks larger than a block
  // (H100: two live 16 MiB blocks kept 64 MiB reserved after a trim), so the cap leaves room for
  // that; the whole model (weights alone) is 1.6 times the cap.
  const std::size_t cap = cuda::memory_stats().reserved_bytes + 160 * kMiB;
  offload::StreamedBlocks streamed(blocks, dev);
  TestSgd opt(streamed.parameters(), 0.05);
  TestSgd opt_ref([&] {
    TensorList ps;
    for (const auto& b : ref) for (const Tensor& p : b->parameters()) ps.push_back(p);
    return ps;
  }(), 0.05);
  Tensor x_cpu = random_tensor({16, d}, 4, Device::cpu());
  Tensor target_cpu = random_tensor({16, d}, 5, Device::cpu());
  Tensor x = x_cpu.to(dev), target = target_cpu.to(dev);
  cuda::set_memory_limit(cap);
  struct Reset {
    ~Reset() { cuda::set_memory_limit(0); }
  } reset;
  // The whole model does not fit under the cap.
  expect_error([&] {
    TensorList on_gpu;
    for (const auto& b : blocks) for (const Tensor& p : b->parameters()) on_gpu.push_back(p.to(dev));
  }, {"out of memory", "memory limit"});
  for (int step = 0; step < 3; ++step) {
    Tensor loss = mse_loss(streamed.forward(x), target);
    Gradients g = loss.backward();
    EXPECT_LE(cuda::memory_stats().reserved_bytes, cap);
    Tensor loss_ref = mse_loss(run_plain(ref, x_cpu), target_cpu);
    Gradients g_ref = loss_ref.backward();
    EXPECT_NEAR(loss.item<float>(), loss_ref.item<float>(), 1e-4 * std::abs(loss_ref.item<float>()) + 1e-6) << step;
    opt.step(g);
    opt_ref.step(g_ref);
  }
  const TensorList ps = streamed.parameters();
  TensorList ps_ref;
  for (const auto& b : ref) for (const Tensor& p : b->parameters()) ps_ref.push_back(p);
  ASSERT_EQ(ps.size(), ps_ref.size());
  for (std::size_t k = 0; k < ps.size(); ++k) EXPECT_TRUE(all_close(ps[k], ps_ref[k], 1e-4, 1e-5)) << k;
  EXPECT_GT(streamed.prefetched_uploads(), 0);
}

// ---- block swapping ----

// A block of a frozen base with adapters and two inputs, as a transformer block is used: x goes
// through a LoRA Linear (optionally with an 8-bit base) gated by a projection of c, with dropout.
struct SwapBlock : nn::Module {
  std::shared_ptr<nn::Linear> fc, gate;
  std::shared_ptr<nn::Dropout> drop;
  SwapBlock(int64_t d, uint64_t seed, bool float8) {
    Generator g(seed);
    fc = register_module("fc", std::make_shared<nn::Linear>(d, d));
    gate = register_module("gate", std::make_shared<nn::Linear>(d, d, false));
    drop = register_module("drop", std::make_shared<nn::Dropout>(0.2));
    NoGradGuard no_grad;
    for (Tensor p : parameters()) p.copy_(Tensor::uniform(p.sizes(), -0.3, 0.3, DType::f32, &g));
    fc->add_lora({.rank = 4, .alpha = 8.0});
    for (const auto& m : {fc->lora_A(), fc->lora_B()}) {
      Tensor w = m->weight();
      w.copy_(Tensor::uniform(w.sizes(), -0.2, 0.2, DType::f32, &g));
    }
    for (Tensor frozen : {gate->weight(), fc->bias()}) frozen.requires_grad_(false);
    if (float8) fc->to_float8();
  }
  std::string name() const override { return "SwapBlock"; }
  Tensor run(const TensorList& in) { return in[0] + drop->forward(fc->forward(in[0]).tanh() * gate->forward(in[1]).sigmoid()); }
};

// The trained (small) tensors of every block are moved first and the frozen weights after them, so
// that swapping the frozen weights out leaves whole pool chunks free rather than chunks a small live
// tensor keeps reserved.
std::vector<nn::ModulePtr> swap_blocks(int n, int64_t d, Device dev, bool float8) {
  std::vector<nn::ModulePtr> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_shared<SwapBlock>(d, 500 + i, float8));
  for (const auto& b : out)
    for (Tensor p : b->parameters())
      if (p.requires_grad()) p.set_data(p.to(dev));
  for (const auto& b : out) b->to(dev);
  return out;
}

// The stack's output for x and c, each block through `run` (a BlockSwap's or the plain call).
Tensor run_swap_stack(const std::vector<nn::ModulePtr>& blocks, const Tensor& x, const Tensor& c,
                      const std::function<Tensor(std::size_t, const std::function<Tensor(const TensorList&)>&,
                                                 const TensorList&)>& run) {
  Tensor h = x;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    auto b = std::static_pointer_cast<SwapBlock>(blocks[i]);
    h = run(i, [b](const TensorList& in) { return b->run(in); }, {h, c});
  }
  return h;
}

TEST(OffloadBlockSwap, SwappedBlocksGiveTheGradientsOfTheResidentModel) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t d = 32;
  for (bool float8 : {false, true}) {
    SCOPED_TRACE(float8 ? "8-bit base" : "f32 base");
    auto blocks = swap_blocks(5, d, dev, float8);
    auto ref = swap_blocks(5, d, dev, float8);
    offload::BlockSwap swap(blocks, dev);
    ASSERT_EQ(swap.size(), 5u);
    // Frozen: the base weight (or its codes), the base bias, the gate and the 8-bit scale buffer.
    const std::size_t want_bytes = float8 ? d * d + d * 4 + d * d * 4 + d * 4 : (d * d + d + d * d) * 4;
    EXPECT_EQ(swap.frozen_bytes(2), want_bytes);
    swap.set_swapped({false, true, false, true, true});
    for (std::size_t i = 0; i < 5; ++i) {
      const auto b = std::static_pointer_cast<SwapBlock>(blocks[i]);
      // Swapped frozen tensors live in pinned host memory; the adapters stay on the device.
      EXPECT_EQ(b->gate->weight().device(), swap.swapped(i) ? (dev.is_cuda() ? Device::cpu() : dev) : dev) << i;
      if (swap.swapped(i) && dev.is_cuda()) EXPECT_TRUE(b->gate->weight().is_pinned()) << i;
      EXPECT_EQ(b->fc->lora_A()->weight().device(), dev) << i;
    }
    Tensor x = random_tensor({6, d}, 11, dev).requires_grad_();
    Tensor c = random_tensor({6, d}, 12, dev).requires_grad_();
    Generator& g = default_generator();
    const Generator::State rng = g.get_state();
    Tensor loss = run_swap_stack(blocks, x, c, [&](std::size_t i, const auto& fn, const TensorList& in) {
      return swap.run(i, fn, in);
    }).square().mean();
    const Gradients gs = loss.backward();
    g.set_state(rng);  // the same dropout masks
    Tensor xr = x.detach().requires_grad_(), cr = c.detach().requires_grad_();
    Tensor loss_ref = run_swap_stack(ref, xr, cr, [](std::size_t, const auto& fn, const TensorList& in) {
      return fn(in);
    }).square().mean();
    const Gradients gr = loss_ref.backward();
    EXPECT_NEAR(loss.item<double>(), loss_ref.item<double>(), 1e-6 * std::abs(loss_ref.item<double>()));
    EXPECT_TRUE(all_close(gs.get(x), gr.get(xr), 1e-5, 1e-7));
    EXPECT_TRUE(all_close(gs.get(c), gr.get(cr), 1e-5, 1e-7));
    for (std::size_t i = 0; i < 5; ++i) {
      const auto b = std::static_pointer_cast<SwapBlock>(blocks[i]);
      const auto r = std::static_pointer_cast<SwapBlock>(ref[i]);
      for (const auto& [k, a] : std::vector<std::pair<Tensor, Tensor>>{
               {b->fc->lora_A()->weight(), r->fc->lora_A()->weight()},
               {b->fc->lora_B()->weight(), r->fc->lora_B()->weight()}}) {
        ASSERT_TRUE(gs.try_get(k).defined()) << "block " << i;
        EXPECT_TRUE(all_close(gs.get(k), gr.get(a), 1e-5, 1e-7)) << "block " << i;
      }
      // After the step the swapped tensors are back in host memory, the same tensors as before.
      EXPECT_EQ(b->gate->weight().device(), swap.swapped(i) ? (dev.is_cuda() ? Device::cpu() : dev) : dev) << i;
    }
    // Blocks 1, 3, 4 uploaded in forward and again in backward; on the way, ahead of their use.
    const offload::BlockSwapReport rep = swap.report();
    EXPECT_EQ(rep.swapped, 3u);
    EXPECT_EQ(rep.swapped_bytes, 3 * want_bytes);
    EXPECT_EQ(rep.resident_bytes, 2 * want_bytes);
    EXPECT_EQ(rep.uploads, 6);
    EXPECT_EQ(rep.prefetched_uploads, 6);
    EXPECT_NE(rep.str().find("3 of 5 blocks swapped"), std::string::npos) << rep.str();
  }
}

TEST(OffloadBlockSwap, ResidentCheckpointedAndInferenceRunsAgree) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t d = 24;
  auto blocks = swap_blocks(4, d, dev, false);
  offload::BlockSwap swap(blocks, dev);
  Tensor x = random_tensor({5, d}, 21, dev), c = random_tensor({5, d}, 22, dev);
  for (auto& b : blocks) b->eval();  // no dropout: the runs below must agree exactly
  const auto run = [&](bool checkpoint) {
    return run_swap_stack(blocks, x, c, [&](std::size_t i, const auto& fn, const TensorList& in) {
      return swap.run(i, fn, in, checkpoint);
    });
  };
  const Tensor plain = run(false);
  Gradients g_plain = plain.square().sum().backward();
  const Tensor ckpt = run(true);
  Gradients g_ckpt = ckpt.square().sum().backward();
  swap.set_swapped({true, true, true, true});
  Tensor inference;
  {
    NoGradGuard no_grad;
    inference = run(false);
  }
  const Tensor swapped = run(false);
  Gradients g_swapped = swapped.square().sum().backward();
  EXPECT_TRUE(all_close(ckpt, plain, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(inference, plain, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(swapped, plain, 1e-6, 1e-7));
  for (const auto& b : blocks) {
    const Tensor a = std::static_pointer_cast<SwapBlock>(b)->fc->lora_A()->weight();
    EXPECT_TRUE(all_close(g_ckpt.get(a), g_plain.get(a), 1e-6, 1e-8));
    EXPECT_TRUE(all_close(g_swapped.get(a), g_plain.get(a), 1e-6, 1e-8));
  }
  // Back to resident: the weights return to the device and runs need no upload.
  swap.set_swapped({false, false, false, false});
  const int64_t uploads = swap.report().uploads;
  EXPECT_TRUE(all_close(run(false), plain, 1e-6, 1e-7));
  EXPECT_EQ(swap.report().uploads, uploads);
  EXPECT_EQ(std::static_pointer_cast<SwapBlock>(blocks[2])->gate->weight().device(), dev);
  expect_error([&] { swap.set_swapped({true}); }, {"offload::BlockSwap::set_swapped", "1 flags for 4 blocks"});
  expect_error([&] { swap.run(4, [](const TensorList& in) { return in[0]; }, {x}); },
               {"offload::BlockSwap", "block 4 out of range (4 blocks)"});
}

TEST(OffloadBlockSwap, PlanKeepsTheMostBlocksThatFitAndSpreadsTheOthers) {
  const std::vector<std::size_t> sizes(10, 100);
  const auto swapped = [&](std::size_t capacity) {
    const std::vector<bool> p = offload::plan_block_swap(sizes, capacity);
    return std::count(p.begin(), p.end(), true);
  };
  EXPECT_EQ(swapped(1000), 0);  // everything fits
  // k swapped blocks leave 1000 - 100 k resident plus 200 in flight (100 for k = 1).
  EXPECT_EQ(offload::plan_block_swap(sizes, 700),
            (std::vector<bool>{false, true, false, true, false, true, false, true, false, true}));
  EXPECT_EQ(swapped(950), 3);  // 1 and 2 swapped blocks leave 1000 on the device
  EXPECT_EQ(swapped(200), 10);  // all swapped: two blocks' room
  expect_error([&] { offload::plan_block_swap(sizes, 150); },
               {"offload::plan_block_swap", "even with all 10 swapped", "raise the budget"});
  EXPECT_TRUE(offload::plan_block_swap({}, 0).empty());
  // Unequal blocks [400, 100, 400, 100] and 900: one swapped (block 2) leaves 600 + 400, two (1, 3)
  // 800 + 200, three (0, 2, 3) 100 + 800.
  EXPECT_EQ(offload::plan_block_swap({400, 100, 400, 100}, 900), (std::vector<bool>{true, false, true, true}));
}

TEST(OffloadBlockSwap, ABudgetTooSmallFailsNamingItAndSwappingFitsUnderIt) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  const int64_t d = 1536;  // 18 MiB of frozen weights per block
  // Memory the pool holds that no tensor uses (left by earlier cases of the process) serves
  // allocations without growing what it reserves: the model is made larger than that slack plus the
  // budget's margin, so that keeping every block resident cannot fit.
  // Swapping the blocks out frees their device copies, which may stay reserved in chunks that other
  // tensors share: when the slack measured after that could hold the model, the model is made
  // again, larger than the slack now seen.
  Tensor x = random_tensor({64, d}, 31, dev), c = random_tensor({64, d}, 32, dev);
  cuda::synchronize();
  cuda::empty_cache();
  std::size_t n = std::max<std::size_t>(16, (cuda::memory_stats().fragmentation_bytes + 256 * kMiB) / (18 * kMiB) + 1);
  std::vector<nn::ModulePtr> blocks;
  std::unique_ptr<offload::BlockSwap> owned;
  cuda::MemoryStats before;
  for (int attempt = 0;; ++attempt) {
    blocks = swap_blocks(static_cast<int>(n), d, dev, false);
    owned = std::make_unique<offload::BlockSwap>(blocks, dev);
    owned->set_swapped(std::vector<bool>(n, true));
    cuda::synchronize();
    cuda::empty_cache();
    before = cuda::memory_stats();
    if (n * 18 * kMiB > before.fragmentation_bytes + 224 * kMiB) break;
    ASSERT_LT(attempt, 3) << "the pool keeps " << (before.fragmentation_bytes >> 20) << " MiB no tensor uses after "
                          << "a model of " << n << " blocks was swapped out";
    n = std::max(2 * n, (before.fragmentation_bytes + 256 * kMiB) / (18 * kMiB) + 1);
    owned.reset();
    blocks.clear();
    cuda::synchronize();
    cuda::empty_cache();
  }
  offload::BlockSwap& swap = *owned;
  // The driver pool reserves in chunks larger than a block: the budget leaves room for that, and the
  // whole model is far above it.
  const std::size_t budget = before.reserved_bytes + 160 * kMiB;
  const auto step = [&] {
    Tensor loss = run_swap_stack(blocks, x, c, [&](std::size_t i, const auto& fn, const TensorList& in) {
      return swap.run(i, fn, in);
    }).square().mean();
    return loss.backward();
  };
  cuda::set_memory_limit(budget);
  struct Reset {
    ~Reset() { cuda::set_memory_limit(0); }
  } reset;
  // Every block resident does not fit; the blocks moved before the failure stay consistent with
  // their flags.
  expect_error([&] { swap.set_swapped(std::vector<bool>(n, false)); }, {"out of memory", "memory limit"});
  swap.set_swapped(offload::plan_block_swap(swap.frozen_bytes(), 80 * kMiB));
  const offload::BlockSwapReport rep = swap.report();
  EXPECT_GT(rep.swapped, 0u);
  EXPECT_LT(rep.swapped, n);
  EXPECT_LE(rep.resident_bytes + 2 * rep.largest_swapped, 80 * kMiB);
  for (int k = 0; k < 2; ++k) {
    const Gradients g = step();
    EXPECT_LE(cuda::memory_stats().reserved_bytes, budget);
  }
  EXPECT_GT(swap.report().prefetched_uploads, 0);
}

// ---- optimizer-state offload ----

TEST(OffloadHostOptimizer, FollowsThePlainOptimizersTrajectory) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Mlp a(24, 3, dev, 400), b(24, 3, dev, 400);
  TestSgd plain(a.weights, 0.1, 0.9);
  offload::HostOptimizer host(b.weights, [](const TensorList& masters) {
    return std::make_unique<TestSgd>(masters, 0.1, 0.9);
  });
  EXPECT_EQ(host.name(), "HostOptimizer(TestSgd)");
  ASSERT_EQ(host.masters().size(), 3u);
  for (const Tensor& m : host.masters()) {
    EXPECT_TRUE(m.device().is_cpu());
    EXPECT_EQ(m.is_pinned(), dev.is_cuda());
  }
  Tensor x = random_tensor({10, 24}, 12, dev);
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {  // a scheduler's change reaches the inner optimizer
      plain.set_lr(0.05);
      host.set_lr(0.05);
      EXPECT_EQ(host.inner().lr(), 0.1);  // applied at the next step
    }
    Gradients ga = a.forward(x).square().mean().backward();
    Gradients gb = b.forward(x).square().mean().backward();
    plain.step(ga);
    host.step(gb);
    for (std::size_t k = 0; k < a.weights.size(); ++k) {
      EXPECT_TRUE(all_close(b.weights[k], a.weights[k], 1e-5, 1e-6)) << "step " << step << " weight " << k;
      EXPECT_TRUE(all_close(host.masters()[k], a.weights[k].to(Device::cpu()), 1e-5, 1e-6));
    }
  }
  EXPECT_EQ(host.inner().lr(), 0.05);
  // A parameter without a gradient is left alone.
  const Tensor before = b.weights[0].to(Device::cpu()).clone();
  Gradients partial = b.forward(x).square().mean().backward();
  partial.erase(b.weights[0]);
  host.step(partial);
  EXPECT_TRUE(all_close(b.weights[0], before, 0, 0));
}

TEST(OffloadHostOptimizer, StateDictRoundTripRestoresMastersAndParameters) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Mlp a(8, 2, dev, 500);
  offload::HostOptimizer host(a.weights, [](const TensorList& m) { return std::make_unique<TestSgd>(m, 0.2, 0.5); });
  Tensor x = random_tensor({5, 8}, 13, dev);
  host.step(a.forward(x).sum().backward());
  const StateDict saved = host.state_dict();
  EXPECT_TRUE(saved.contains("master.0"));
  EXPECT_TRUE(saved.contains("inner.buf.1"));
  StateDict snapshot;
  for (const auto& [k, t] : saved) snapshot.insert(k, t.clone());
  const Tensor w0 = a.weights[0].to(Device::cpu()).clone();
  host.step(a.forward(x).sum().backward());
  EXPECT_FALSE(all_close(a.weights[0], w0, 0, 0));
  // A bad state changes nothing.
  StateDict bad = snapshot;
  bad.set("master.1", Tensor::zeros({3}));
  const Tensor w1 = a.weights[1].to(Device::cpu()).clone();
  expect_error([&] { host.load_state_dict(bad); }, {"HostOptimizer", "master.1"});
  EXPECT_TRUE(all_close(a.weights[1], w1, 0, 0));
  host.load_state_dict(snapshot);
  EXPECT_TRUE(all_close(a.weights[0], w0, 0, 0));
  EXPECT_TRUE(all_close(host.masters()[0], w0, 0, 0));
}

}  // namespace
}  // namespace flame::test
