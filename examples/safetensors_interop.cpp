// The FLAME side of the two-way safetensors check with Python's safetensors + PyTorch
// (scripts/interop_safetensors.py drives it; docs/safetensors.md).
//
//   safetensors_interop read  DIR [cpu|cuda]  loads DIR/py_all.safetensors onto the device, checks
//                                             every tensor against DIR/py_manifest.txt (dtype,
//                                             shape, FNV-1a hash of the bytes) and the metadata,
//                                             then saves it again (from the device) as
//                                             DIR/flame_resaved.safetensors for Python to compare.
//   safetensors_interop write DIR [cpu|cuda]  saves tensors of every dtype (random values, odd
//                                             shapes, 0-d, empty, non-contiguous) made on the device
//                                             to DIR/flame_all.safetensors, and their manifest to
//                                             DIR/flame_manifest.txt.
//   safetensors_interop mlp   DIR [cpu|cuda]  loads a PyTorch model's state dict (with its input
//                                             and output) from DIR/mlp.safetensors, runs the same
//                                             forward with FLAME ops and compares the outputs.
// Manifest lines are tab-separated: `tensor NAME DTYPE DIMS HASH` (DIMS comma-separated, "-" for
// a 0-d tensor) and `meta KEY VALUE`. Exit status 0 when everything matches, 1 otherwise.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "flame/flame.h"
#include "flame/io.h"

using namespace flame;

namespace {

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// FNV-1a 64 of a tensor's elements in row-major order (read back to the host).
std::string hash_of(const Tensor& t) {
  const Tensor h = t.detach().contiguous().to(Device::cpu());
  const auto* p = static_cast<const unsigned char*>(h.data_ptr());
  uint64_t x = 0xcbf29ce484222325ULL;
  for (std::size_t i = 0; i < h.nbytes(); ++i) x = (x ^ p[i]) * 0x100000001b3ULL;
  return hex64(x);
}

std::string dims_of(const Shape& s) {
  if (s.empty()) return "-";
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out;
}

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == '\t') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(cur);
  return out;
}

int read_mode(const std::string& dir, Device dev) {
  const std::string path = dir + "/py_all.safetensors";
  const io::SafetensorsFile file(path);
  const StateDict sd = file.load_all(dev);
  std::ifstream mf(dir + "/py_manifest.txt");
  if (!mf) {
    std::cerr << "read: no " << dir << "/py_manifest.txt\n";
    return 1;
  }
  int bad = 0, tensors = 0;
  io::Metadata want_meta;
  std::string line;
  while (std::getline(mf, line)) {
    const std::vector<std::string> f = split_tabs(line);
    if (f.size() == 3 && f[0] == "meta") {
      want_meta[f[1]] = f[2];
      continue;
    }
    if (f.size() != 5 || f[0] != "tensor") {
      std::cerr << "read: bad manifest line: " << line << "\n";
      return 1;
    }
    ++tensors;
    const std::string& name = f[1];
    const Tensor* t = sd.find(name);
    if (t == nullptr) {
      std::cerr << "read: missing tensor " << name << "\n";
      ++bad;
      continue;
    }
    const std::string got_dtype = io::safetensors_dtype(t->dtype());
    const std::string got_dims = dims_of(t->sizes()), got_hash = hash_of(*t);
    if (got_dtype != f[2] || got_dims != f[3] || got_hash != f[4] || t->device() != dev) {
      std::cerr << "read: " << name << ": got " << got_dtype << " [" << got_dims << "] " << got_hash << " on "
                << t->device() << ", want " << f[2] << " [" << f[3] << "] " << f[4] << "\n";
      ++bad;
    }
  }
  if (static_cast<std::size_t>(tensors) != sd.size()) {
    std::cerr << "read: the file holds " << sd.size() << " tensors, the manifest " << tensors << "\n";
    ++bad;
  }
  if (file.metadata() != want_meta) {
    std::cerr << "read: metadata differs\n";
    ++bad;
  }
  io::save_safetensors(dir + "/flame_resaved.safetensors", sd, file.metadata());
  std::cout << "read: " << tensors << " tensors from Python checked on " << dev << ", " << bad << " mismatches\n";
  return bad == 0 ? 0 : 1;
}

int write_mode(const std::string& dir, Device dev) {
  Generator gen(2024);
  StateDict sd;
  for (DType dt : kAllDTypes) {
    const std::string d = io::safetensors_dtype(dt);
    auto make = [&](const Shape& s) {
      Tensor t;
      if (is_floating(dt)) {
        t = Tensor::randn(s, 0.0, 5.0, {DType::f64, dev}, &gen).to(dt);
      } else if (dt == DType::boolean) {
        t = Tensor::rand(s, {dev}, &gen).lt(Tensor::scalar(0.5, dev));
      } else if (dt == DType::u8) {
        t = Tensor::randint(0, 256, s, {dt, dev}, &gen);
      } else {
        t = Tensor::randint(-100000, 100000, s, {dt, dev}, &gen);
      }
      return t;
    };
    sd.insert("odd." + d, make({3, 5, 7}));
    sd.insert("scalar." + d, make({}));
    sd.insert("empty." + d, make({0, 3}));
    sd.insert("transposed." + d, make({4, 9}).t());
  }
  // Values whose bits matter: signed zero, infinities, NaN, subnormals.
  sd.insert("special.F32", Tensor::from_vec(std::vector<float>{-0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3.5f},
                                            {6}, dev));
  sd.insert("special.F64", Tensor::from_vec(std::vector<double>{-0.0, INFINITY, NAN, 4.9e-324, 1e308}, {5}, dev));
  const io::Metadata meta{{"format", "pt"}, {"writer", "flame"}, {"utf8", "\xce\xbb=0.5"}};
  io::save_safetensors(dir + "/flame_all.safetensors", sd, meta);
  std::ofstream mf(dir + "/flame_manifest.txt");
  for (const auto& [name, t] : sd) {
    mf << "tensor\t" << name << "\t" << io::safetensors_dtype(t.dtype()) << "\t" << dims_of(t.sizes()) << "\t"
       << hash_of(t) << "\n";
  }
  for (const auto& [k, v] : meta) mf << "meta\t" << k << "\t" << v << "\n";
  std::cout << "write: " << sd.size() << " tensors saved from " << dev << "\n";
  return mf.good() ? 0 : 1;
}

// The model of scripts/interop_safetensors.py: mlp = Linear -> GELU -> Linear, then a LayerNorm
// written with elementwise ops and reductions.
int mlp_mode(const std::string& dir, Device dev) {
  const StateDict sd = io::load_safetensors(dir + "/mlp.safetensors", dev);
  const Tensor& x = sd.at("input");
  auto linear = [&](const Tensor& in, const std::string& prefix) {
    return in.matmul(sd.at(prefix + ".weight").t()).add(sd.at(prefix + ".bias"));
  };
  Tensor h = linear(x, "mlp.0").gelu();
  h = linear(h, "mlp.2");
  const Tensor mu = h.mean(-1, true);
  const Tensor xc = h.sub(mu);
  const Tensor var = xc.mul(xc).mean(-1, true);
  const Tensor y = xc.mul(var.add_scalar(1e-5).rsqrt()).mul(sd.at("norm.weight")).add(sd.at("norm.bias"));

  const Tensor want = sd.at("output");
  if (y.sizes() != want.sizes()) {
    std::cerr << "mlp: output shape " << shape_str(y.sizes()) << ", PyTorch's " << shape_str(want.sizes()) << "\n";
    return 1;
  }
  const std::vector<double> a = y.to_vec<double>(), b = want.to_vec<double>();
  double max_err = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) max_err = std::max(max_err, std::abs(a[i] - b[i]));
  const double tol = x.dtype() == DType::f64 ? 1e-10 : 2e-4;
  std::cout << "mlp: " << a.size() << " outputs on " << dev << ", max |FLAME - PyTorch| = " << max_err
            << " (tolerance " << tol << ")\n";
  return max_err <= tol ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: safetensors_interop read|write|mlp DIR [cpu|cuda]\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  const Device dev = (argc > 3 && std::string(argv[3]) == "cuda") ? Device::cuda(0) : Device::cpu();
  try {
    if (mode == "read") return read_mode(dir, dev);
    if (mode == "write") return write_mode(dir, dev);
    if (mode == "mlp") return mlp_mode(dir, dev);
  } catch (const std::exception& e) {
    std::cerr << mode << ": error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "unknown mode " << mode << "\n";
  return 2;
}
