// flame-numerics-parity: FLAME's side of the PyTorch parity check of the ops added for issue #26
// (hardswish, hardsigmoid, smooth_l1 / huber, BCE-with-logits weight and pos_weight, weighted and
// soft-target cross entropy, bicubic / antialiased / 1-d interpolate, SDPA with fully hidden rows,
// and on CUDA the f32 convolution with TF32 off). Inputs come from formulas (no random numbers);
// each case writes its inputs ("<case>.in.<i>_<name>", i the argument position), its output
// ("<case>.out") and the gradients of sum(out * upstream) ("<case>.grad.<i>_<name>", upstream
// "<case>.in.gout") to one safetensors file.
// tools/parity_numerics.py reads it, runs PyTorch on the same inputs and prints the differences.
//
//   flame-numerics-parity OUT.safetensors [cpu|cuda]
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "flame/flame.h"
#include "flame/io/safetensors.h"
#include "flame/nn.h"

using namespace flame;
namespace F = flame::nn::functional;

namespace {

// A deterministic tensor: sin(a * i + b) * scale + shift over the flat index i, in f64.
Tensor wave(const Shape& shape, double a, double b, double scale = 1.0, double shift = 0.0) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<double> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = std::sin(a * static_cast<double>(i) + b) * scale + shift;
  return Tensor::from_vec(v, shape);
}

struct Writer {
  Device dev;
  StateDict out;

  // Runs fn on the differentiable inputs (moved to dev in dtype dt), records output and gradients.
  void run(const std::string& name, const std::vector<std::pair<std::string, Tensor>>& grad_inputs,
           const std::function<Tensor(const TensorList&)>& fn, DType dt = DType::f32) {
    TensorList in;
    std::vector<std::string> keys;  // "<i>_<name>": sorted names keep the argument order
    for (const auto& [n, t] : grad_inputs) {
      keys.push_back(std::to_string(keys.size()) + "_" + n);
      out.insert(name + ".in." + keys.back(), t.to(dt).contiguous());
      in.push_back(t.to(dt).to(dev).detach().requires_grad_(true));
    }
    const Tensor y = fn(in);
    out.insert(name + ".out", y.detach().to(Device::cpu()).contiguous());
    const Tensor gout = wave(y.sizes(), 0.71, 0.3).to(y.dtype());
    out.insert(name + ".in.gout", gout);
    BackwardOptions opt;
    opt.grad_output = gout.to(dev);
    const Gradients g = y.backward(opt);
    for (std::size_t i = 0; i < in.size(); ++i)
      out.insert(name + ".grad." + keys[i], in[i].grad(g).to(Device::cpu()).contiguous());
  }
  // A constant input the op reads but the check does not differentiate (targets, masks, indices).
  Tensor fixed(const std::string& name, const Tensor& t) {
    out.insert(name, t.contiguous());
    return t.to(dev);
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.safetensors [cpu|cuda]\n", argv[0]);
    return 2;
  }
  const bool cuda = argc > 2 && std::string(argv[2]) == "cuda";
  if (cuda && !cuda_is_available()) {
    std::fprintf(stderr, "flame-numerics-parity: cuda asked for, but no CUDA device is available\n");
    return 2;
  }
  Writer w{cuda ? Device::cuda(0) : Device::cpu(), {}};
  const Tensor x1 = wave({4, 37}, 0.37, 0.1, 5.0);  // covers both kinks at +-3

  w.run("hardswish", {{"x", x1}}, [](const TensorList& t) { return hardswish(t[0]); });
  w.run("hardsigmoid", {{"x", x1}}, [](const TensorList& t) { return hardsigmoid(t[0]); });

  const Tensor ya = wave({4, 37}, 0.53, 1.1, 2.5);
  for (double beta : {0.0, 0.5, 1.0}) {
    const std::string n = "smooth_l1_beta" + std::to_string(static_cast<int>(beta * 10));
    w.run(n, {{"input", x1}, {"target", ya}},
          [beta](const TensorList& t) { return smooth_l1_loss(t[0], t[1], Reduction::mean, beta); });
  }
  for (double delta : {0.5, 2.0}) {
    const std::string n = "huber_delta" + std::to_string(static_cast<int>(delta * 10));
    w.run(n, {{"input", x1}, {"target", ya}},
          [delta](const TensorList& t) { return huber_loss(t[0], t[1], Reduction::none, delta); });
  }

  {  // BCE with logits: pos_weight over the last dim, weight over rows.
    const Tensor x = wave({6, 5}, 0.61, 0.2, 4.0), tgt = wave({6, 5}, 0.29, 0.4, 0.5, 0.5);
    const Tensor t = w.fixed("bce.fixed.target", tgt.to(DType::f32));
    const Tensor pw = w.fixed("bce.fixed.pos_weight", wave({5}, 1.3, 0.0, 1.0, 1.5).to(DType::f32));
    const Tensor wt = w.fixed("bce.fixed.weight", wave({6, 1}, 0.9, 0.5, 0.5, 1.0).to(DType::f32));
    w.run("bce", {{"input", x}}, [&](const TensorList& in) {
      return binary_cross_entropy_with_logits(in[0], t, Reduction::mean, wt, pw);
    });
  }

  {  // cross_entropy: class weights + smoothing + ignore_index, spatial dims, and soft targets.
    const Tensor cw = w.fixed("ce.fixed.weight", wave({5}, 0.8, 0.3, 0.7, 1.2).to(DType::f32));
    const Tensor idx = w.fixed("ce.fixed.target", Tensor::from_vec<int64_t>({0, 4, -100, 2, 2, 1, 3}, {7}));
    w.run("ce_weighted", {{"input", wave({7, 5}, 0.43, 0.7, 3.0)}}, [&](const TensorList& in) {
      return cross_entropy(in[0], idx, Reduction::mean, -100, 0.1, cw);
    });
    const Tensor idx3 = w.fixed("ce3.fixed.target", Tensor::from_vec<int64_t>({0, 1, 2, 3, 4, -100, 0, 1}, {2, 4}));
    w.run("ce3_weighted", {{"input", wave({2, 5, 4}, 0.33, 0.2, 3.0)}}, [&](const TensorList& in) {
      return cross_entropy(in[0], idx3, Reduction::mean, -100, 0.0, cw);
    });
    const Tensor probs = w.fixed("ce_soft.fixed.target", softmax(wave({7, 5}, 0.21, 0.9, 2.0), 1).to(DType::f32));
    w.run("ce_soft", {{"input", wave({7, 5}, 0.43, 0.7, 3.0)}}, [&](const TensorList& in) {
      return cross_entropy(in[0], probs, Reduction::mean, -100, 0.2, cw);
    });
  }

  {  // interpolate
    const Tensor img = wave({2, 3, 19, 23}, 0.113, 0.2, 1.0);
    struct Case {
      const char* name;
      F::InterpolateOptions o;
    };
    const Case cases[] = {
        {"bicubic_up", F::InterpolateOptions().with_size({31, 40}).with_mode("bicubic")},
        {"bicubic_up_align", F::InterpolateOptions().with_size({31, 40}).with_mode("bicubic").with_align_corners(true)},
        {"bicubic_down", F::InterpolateOptions().with_size({7, 9}).with_mode("bicubic")},
        {"bilinear_aa_down", F::InterpolateOptions().with_size({7, 9}).with_mode("bilinear").with_antialias(true)},
        {"bicubic_aa_down", F::InterpolateOptions().with_size({6, 10}).with_mode("bicubic").with_antialias(true)},
        {"bicubic_aa_align", F::InterpolateOptions().with_size({5, 8}).with_mode("bicubic").with_antialias(true).with_align_corners(true)},
        {"bicubic_aa_up", F::InterpolateOptions().with_size({25, 30}).with_mode("bicubic").with_antialias(true)},
        {"bicubic_scale", F::InterpolateOptions().with_scale(1.7, 0.45).with_mode("bicubic")},
    };
    for (const Case& c : cases) {
      const F::InterpolateOptions o = c.o;
      w.run(std::string("interp_") + c.name, {{"x", img}}, [o](const TensorList& t) { return F::interpolate(t[0], o); });
    }
    w.run("interp_linear_1d", {{"x", wave({2, 3, 29}, 0.2, 0.1)}}, [](const TensorList& t) {
      return F::interpolate(t[0], F::InterpolateOptions().with_size(45).with_mode("linear"));
    });
  }

  {  // SDPA with query rows 2 and 5 fully hidden (bool mask; true = may attend).
    std::vector<bool> keep(8 * 11, true);
    for (int64_t i = 0; i < 8; ++i) keep[static_cast<std::size_t>(i * 11 + (i * 3) % 11)] = i % 2 == 0;
    for (int64_t r : {2, 5})
      for (int64_t j = 0; j < 11; ++j) keep[static_cast<std::size_t>(r * 11 + j)] = false;
    const Tensor mask = w.fixed("sdpa.fixed.mask", Tensor::from_vec(keep, {8, 11}));
    auto sdpa = [&](const TensorList& t) { return F::scaled_dot_product_attention(t[0], t[1], t[2], mask); };
    const Tensor q = wave({2, 2, 8, 64}, 0.17, 0.0), k = wave({2, 2, 11, 64}, 0.23, 0.5), v = wave({2, 2, 11, 64}, 0.31, 1.0);
    w.run("sdpa_masked_f32", {{"q", q}, {"k", k}, {"v", v}}, sdpa);
    if (cuda) w.run("sdpa_masked_bf16", {{"q", q}, {"k", k}, {"v", v}}, sdpa, DType::bf16);  // the cuDNN path
  }

  if (cuda) {  // f32 convolution with TF32 off (PyTorch: torch.backends.cudnn.allow_tf32 = False)
    const bool prev = flame::cuda::allow_conv_tf32();
    flame::cuda::set_allow_conv_tf32(false);
    w.run("conv2d_f32_no_tf32", {{"x", wave({4, 32, 18, 18}, 0.011, 0.0)}, {"w", wave({48, 32, 3, 3}, 0.029, 0.3, 0.2)}},
          [](const TensorList& t) { return F::conv2d(t[0], t[1], {}, {1}, {1}); });
    flame::cuda::set_allow_conv_tf32(prev);
  }

  io::save_safetensors(argv[1], w.out, {{"device", cuda ? "cuda" : "cpu"}});
  std::printf("wrote %zu tensors to %s\n", w.out.size(), argv[1]);
  return 0;
}
