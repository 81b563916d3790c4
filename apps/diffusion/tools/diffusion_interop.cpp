// diffusion_interop: the FLAME side of the PyTorch-twin interop check
// (apps/diffusion/reference/interop.py drives it).
//
//   diffusion_interop init    --model PRESET --out W.safetensors [--seed N] [--perturb STD]
//       builds the preset with FLAME's init (seed N), optionally adds N(0, STD) noise to every
//       parameter (so the zero-initialised layers take part in a comparison), saves the weights.
//   diffusion_interop forward --model PRESET --weights W.safetensors --inputs I.safetensors
//                             --out O.safetensors [--device cpu|cuda]
//       loads the weights strictly (PyTorch key names), reads x [B, C, H, W] f32, t [B] f32 and
//       y [B] i64 from the inputs, writes the model's output as "out" (f32, on the CPU).
//   diffusion_interop keys    --model PRESET
//       prints "name shape" per state-dict entry.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <string>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>

#include "embed.h"

namespace fd = flame_diffusion;
using flame::Tensor;

namespace {

const char* kUsage =
    "usage:\n"
    "  diffusion_interop init    --model PRESET --out W.safetensors [--seed N] [--perturb STD]\n"
    "  diffusion_interop forward --model PRESET --weights W.safetensors --inputs I.safetensors\n"
    "                            --out O.safetensors [--device cpu|cuda]\n"
    "  diffusion_interop keys    --model PRESET\n";

struct Args {
  std::string command;
  std::map<std::string, std::string> flags;
  const std::string& need(const std::string& name) const {
    auto it = flags.find(name);
    if (it == flags.end()) throw std::runtime_error("missing --" + name + " for '" + command + "'\n" + kUsage);
    return it->second;
  }
  std::string get(const std::string& name, const std::string& fallback) const {
    auto it = flags.find(name);
    return it == flags.end() ? fallback : it->second;
  }
};

Args parse(int argc, char** argv) {
  if (argc < 2) throw std::runtime_error(std::string("no command\n") + kUsage);
  Args a;
  a.command = argv[1];
  static const std::map<std::string, bool> known = {{"model", true}, {"out", true},    {"seed", true},
                                                    {"perturb", true}, {"weights", true}, {"inputs", true},
                                                    {"device", true}};
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    if (f.rfind("--", 0) != 0 || !known.count(f.substr(2)))
      throw std::runtime_error("unknown flag '" + f + "'\n" + kUsage);
    if (i + 1 >= argc) throw std::runtime_error("flag '" + f + "' needs a value");
    a.flags[f.substr(2)] = argv[++i];
  }
  return a;
}

double to_double(const std::string& flag, const std::string& v) {
  try {
    std::size_t used = 0;
    const double d = std::stod(v, &used);
    if (used == v.size()) return d;
  } catch (const std::exception&) {
  }
  throw std::runtime_error("--" + flag + ": '" + v + "' is not a number");
}

flame::Device parse_device(const std::string& v) {
  if (v == "cpu") return flame::Device::cpu();
  if (v == "cuda") {
    if (!flame::cuda_is_available()) throw std::runtime_error("--device cuda: no CUDA device is available");
    return flame::Device::cuda(0);
  }
  throw std::runtime_error("--device: '" + v + "' is not cpu or cuda");
}

Tensor input(const flame::StateDict& sd, const std::string& name, const std::string& path) {
  if (!sd.contains(name)) throw std::runtime_error(path + ": no tensor '" + name + "' (needs x, t, y)");
  return sd.at(name);
}

int run(const Args& a) {
  if (a.command == "init") {
    const auto seed = static_cast<uint64_t>(to_double("seed", a.get("seed", "0")));
    auto model = fd::make_model(a.need("model"), seed);
    const double perturb = to_double("perturb", a.get("perturb", "0"));
    if (perturb > 0.0) {
      flame::NoGradGuard no_grad;
      flame::Generator gen(seed + 1);
      for (Tensor p : model->parameters()) p.add_(Tensor::randn(p.sizes(), 0.0, perturb, {p.dtype(), p.device()}, &gen));
    }
    flame::nn::save_state_dict(*model, a.need("out"), {{"format", "pt"}, {"model", a.need("model")}});
    std::printf("%s: %lld parameters -> %s\n", a.need("model").c_str(),
                static_cast<long long>(model->num_parameters()), a.need("out").c_str());
    return 0;
  }
  if (a.command == "forward") {
    const flame::Device dev = parse_device(a.get("device", "cpu"));
    auto model = fd::make_model(a.need("model"));
    flame::nn::LoadReport r = flame::nn::load_state_dict(*model, a.need("weights"));  // strict: raises listing problems
    (void)r;
    model->to(dev);
    model->eval();
    const std::string& ipath = a.need("inputs");
    flame::StateDict in = flame::io::load_safetensors(ipath, dev);
    flame::NoGradGuard no_grad;
    Tensor out = model->forward(input(in, "x", ipath), input(in, "t", ipath), input(in, "y", ipath));
    flame::StateDict res;
    res.insert("out", out.to(flame::DType::f32).to(flame::Device::cpu()));
    flame::io::save_safetensors(a.need("out"), res);
    return 0;
  }
  if (a.command == "keys") {
    auto model = fd::make_model(a.need("model"));
    for (const auto& [name, t] : model->state_dict()) std::cout << name << " " << flame::shape_str(t.sizes()) << "\n";
    return 0;
  }
  throw std::runtime_error("unknown command '" + a.command + "'\n" + kUsage);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diffusion_interop: error: %s\n", e.what());
    return 1;
  }
}
