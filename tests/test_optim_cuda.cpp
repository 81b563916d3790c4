// The fused CUDA optimizer and EMA kernels against the CPU reference backend: the same problem,
// dtypes and options on both devices; one kernel launch per step for a 200-tensor group; device
// mix errors. Every case skips cleanly without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "flame/optim/ema.h"
#include "optim_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

using namespace optim_ref;

struct DtypeCase {
  DType dtype;
  bool master;
  double rtol, atol;
};

void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  const auto g = got.to_vec<double>(), w = want.to_vec<double>();
  ASSERT_EQ(g.size(), w.size()) << what;
  for (std::size_t k = 0; k < g.size(); ++k)
    ASSERT_NEAR(g[k], w[k], atol + rtol * std::abs(w[k])) << what << " element " << k;
}

TEST(OptimCuda, FusedStepMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const Problem pb = make_problem(20, 3);
  const std::vector<DtypeCase> dts = {
      {DType::f32, true, 1e-5, 1e-6},   {DType::f64, true, 1e-12, 1e-13}, {DType::bf16, true, 1e-2, 1e-2},
      {DType::bf16, false, 2e-2, 2e-2}, {DType::f16, true, 2e-3, 2e-3},   {DType::f16, false, 4e-3, 4e-3}};
  for (const Case& c : cases()) {
    for (const DtypeCase& d : dts) {
      const std::string what = std::string(c.name) + " " + dtype_name(d.dtype) + (d.master ? " master" : "");
      Precision pr{d.master, false, 0};
      const TensorList cpu = make_params(pb, d.dtype, Device::cpu());
      auto a = make_optimizer(c.kind, c.config, cpu, pr);
      run_steps(*a, pb, cpu, 0, pb.steps);
      const TensorList gpu = make_params(pb, d.dtype, Device::cuda());
      auto b = make_optimizer(c.kind, c.config, gpu, pr);
      run_steps(*b, pb, gpu, 0, pb.steps);
      for (std::size_t i = 0; i < cpu.size(); ++i) {
        EXPECT_EQ(gpu[i].device(), Device::cuda());
        expect_close(gpu[i], cpu[i], d.rtol, d.atol, what + " parameter " + std::to_string(i));
        if (a->master_weights(i).defined())
          expect_close(b->master_weights(i), a->master_weights(i), 1e-5, 1e-6, what + " master " + std::to_string(i));
      }
      // The state dict of the CUDA run loads into the CPU optimizer (device moves on load).
      a->load_state_dict(b->state_dict());
      EXPECT_EQ(a->param_step(3), b->param_step(3));
    }
  }
}

// Large, unaligned and multi-chunk tensors: vector and scalar paths, chunk boundaries, and more
// tensors than one launch holds.
TEST(OptimCuda, ManyTensorsAndOddSizesMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  std::vector<int64_t> sizes = {1, 3, 5, 70001, 32768, 32769, 4, 131071};
  for (int i = 0; i < 300; ++i) sizes.push_back(1 + (i * 7919) % 3001);
  TensorList cpu, gpu;
  Gradients gc, gg;
  Tensor big = Tensor::randn({70001 + 3});
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    Tensor p = i == 3 ? big.narrow(0, 1, 70001).clone() : Tensor::randn({sizes[i]});
    Tensor q = p.to(Device::cuda());
    p.requires_grad_(true);
    q.requires_grad_(true);
    cpu.push_back(p);
    gpu.push_back(q);
  }
  optim::AdamW a(cpu, {.lr = 1e-2, .weight_decay = 0.1});
  optim::AdamW b(gpu, {.lr = 1e-2, .weight_decay = 0.1});
  for (int s = 0; s < 3; ++s) {
    for (std::size_t i = 0; i < cpu.size(); ++i) {
      Tensor g = Tensor::randn(cpu[i].sizes());
      gc.set(cpu[i], g);
      gg.set(gpu[i], g.to(Device::cuda()));
    }
    a.step(gc);
    b.step(gg);
  }
  for (std::size_t i = 0; i < cpu.size(); ++i)
    expect_close(gpu[i], cpu[i], 1e-5, 1e-6, "parameter " + std::to_string(i));
  // Unaligned parameters (views at an odd offset into one buffer) go through the scalar path.
  Tensor flat = Tensor::randn({1000}, Device::cuda());
  Tensor flat_cpu = flat.to(Device::cpu());
  Tensor u = flat.narrow(0, 1, 999).detach();
  Tensor uc = flat_cpu.narrow(0, 1, 999).detach();
  u.requires_grad_(true);
  uc.requires_grad_(true);
  optim::SGD su({u}, {.lr = 0.1, .momentum = 0.9});
  optim::SGD sc({uc}, {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < 3; ++s) {
    Tensor g = Tensor::randn({999});
    Gradients x, y;
    x.set(u, g.to(Device::cuda()));
    y.set(uc, g);
    su.step(x);
    sc.step(y);
  }
  expect_close(u, uc, 1e-5, 1e-6, "unaligned");
}

TEST(OptimCuda, OneLaunchPerStepFor200Tensors) {
  FLAME_SKIP_IF_NO_CUDA();
  TensorList ps;
  Gradients g;
  for (int i = 0; i < 200; ++i) {
    Tensor t = Tensor::randn({1 + (i * 37) % 1001}, Device::cuda());
    t.requires_grad_(true);
    ps.push_back(t);
    g.set(t, Tensor::randn(t.sizes(), Device::cuda()));
  }
  for (int kind = 0; kind < 3; ++kind) {
    std::unique_ptr<optim::Optimizer> opt;
    if (kind == 0) opt = std::make_unique<optim::AdamW>(ps, optim::AdamWOptions{});
    if (kind == 1) opt = std::make_unique<optim::SGD>(ps, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    if (kind == 2) opt = std::make_unique<optim::Lion>(ps, optim::LionOptions{});
    opt->step(g);  // creates the state
    const int64_t before = optim::fused_launch_count();
    opt->step(g);
    EXPECT_EQ(optim::fused_launch_count() - before, 1) << opt->name();
  }
  optim::EMA ema(ps, {.decay = 0.99});
  const int64_t before = optim::fused_launch_count();
  ema.update();
  EXPECT_EQ(optim::fused_launch_count() - before, 1);
}

TEST(OptimCuda, StochasticRoundingMatchesCpuAndIsUnbiased) {
  FLAME_SKIP_IF_NO_CUDA();
  auto run = [](Device dev) {
    Tensor p = Tensor::full({1 << 16}, 1.0, TensorOptions(DType::bf16, dev));
    p.requires_grad_(true);
    optim::SGD opt({p}, {.lr = 1e-3, .stochastic_rounding = true, .seed = 9});
    for (int s = 0; s < 3; ++s) {
      Gradients g;
      g.set(p, Tensor::full({1 << 16}, 1.0, TensorOptions(DType::bf16, dev)));
      opt.step(g);
    }
    return std::make_pair(p.to_vec<double>(), opt.master_weights(0).to_vec<double>()[0]);
  };
  const auto [gpu, m] = run(Device::cuda());
  const auto [cpu, mc] = run(Device::cpu());
  EXPECT_EQ(m, mc);
  EXPECT_EQ(gpu, cpu) << "the same Philox bits on both devices";
  double mean = 0;
  for (double x : gpu) mean += x;
  EXPECT_NEAR(mean / static_cast<double>(gpu.size()), m, 4e-5);
}

TEST(OptimCuda, DeviceMixIsAnError) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor p = Tensor::randn({4}, Device::cuda());
  p.requires_grad_(true);
  optim::Adam opt({p});
  Gradients g;
  g.set(p, Tensor::randn({4}, Device::cuda()));
  g.at(p) = Tensor::randn({4});
  expect_error([&] { opt.step(g); }, {"Adam.step", "parameter 0", "cpu", "cuda"});
}

TEST(OptimCuda, EmaMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    TensorList cpu, gpu;
    for (int64_t n : {1, 7, 4096, 33001}) {
      Tensor p = Tensor::randn({n}).to(dt);
      cpu.push_back(p);
      gpu.push_back(p.to(Device::cuda()));
    }
    optim::EMA a(cpu, {.decay = 0.999, .warmup = true});
    optim::EMA b(gpu, {.decay = 0.999, .warmup = true});
    for (int s = 0; s < 5; ++s) {
      for (std::size_t i = 0; i < cpu.size(); ++i) {
        Tensor nv = Tensor::randn(cpu[i].sizes()).to(dt);
        cpu[i].copy_(nv);
        gpu[i].copy_(nv.to(Device::cuda()));
      }
      a.update(s);
      b.update(s);
    }
    for (std::size_t i = 0; i < cpu.size(); ++i)
      expect_close(b.shadow()[i], a.shadow()[i], 1e-6, 1e-6, std::string("ema ") + dtype_name(dt));
  }
}

}  // namespace
}  // namespace flame::test
