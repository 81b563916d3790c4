// vae_parity: FLAME's AutoencoderKL against diffusers' outputs written by
// apps/diffusion/reference/models_vae.py (--config ... --out DIR), from both files of DIR.
//
//   vae_parity --dir DIR [--device cuda|cpu] [--tol T] [--single-file-config] [--time] [--memory] [--time-size 1024]
//
// For DIR/diffusers (a sharded diffusers folder) and DIR/<single file> (original names; its family
// is guessed from the keys and must be the one the script wrote, unless --single-file-config builds
// it from DIR/diffusers/config.json as the reduced configurations need), it loads the VAE in the
// reference's dtype, runs encode (mean, logvar), decode, tiled encode and tiled decode on the
// stored inputs, and prints per output the max abs error and the max error relative to the
// reference's largest value, then PASS or FAIL (relative error <= T; T = 1e-3 for f32, which runs
// with TF32 off, and 5e-2 for bf16). --time: decode and encode of a TIME_SIZE^2 image from the
// diffusers folder, 3 warm-ups then the median of 10 timed with CUDA events, and the peak memory
// (JSON lines, comparable with the script's --time rows), then tiled against untiled at that size.
// --memory: one decode and one encode of a TIME_SIZE^2 image under profiler::MemoryProfiler (on any
// device): the peak above what was held before and the ops holding it. Exit status 1 on FAIL.
#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/profiler.h>

#include "models/vae.h"
#include "parity_util.h"

namespace fs = std::filesystem;
namespace m = flame_diffusion::models;
using flame::DType;
using flame::Tensor;

namespace {

const char* kUsage =
    "usage: vae_parity --dir DIR [--device cuda|cpu] [--tol T] [--single-file-config] [--time] [--memory] [--time-size N]\n";

struct Err {
  double abs = 0, rel = 0;
};

Err compare(const Tensor& got, const Tensor& ref) {
  FLAME_CHECK(got.sizes() == ref.sizes(), "vae_parity", "output shape ", got.sizes(), " vs reference ", ref.sizes());
  const Tensor g = got.to(DType::f64, flame::Device::cpu()), r = ref.to(DType::f64, flame::Device::cpu());
  Err e;
  e.abs = (g - r).abs().max().item<double>();
  e.rel = e.abs / std::max(1e-30, r.abs().max().item<double>());
  return e;
}

using flame_diffusion::tools::median_ms;

}  // namespace

int main(int argc, char** argv) {
  try {
    std::map<std::string, std::string> flags;
    for (int i = 1; i < argc; ++i) {
      std::string f = argv[i];
      if (f == "--help" || f == "-h") {
        std::cout << kUsage;
        return 0;
      }
      FLAME_CHECK(f.rfind("--", 0) == 0, "vae_parity", "unexpected argument ", f, "\n", kUsage);
      f = f.substr(2);
      if (f == "time" || f == "single-file-config" || f == "memory") {
        flags[f] = "1";
      } else {
        FLAME_CHECK(f == "dir" || f == "device" || f == "tol" || f == "time-size", "vae_parity", "unknown flag --", f,
                    "\n", kUsage);
        FLAME_CHECK(i + 1 < argc, "vae_parity", "--", f, " needs a value");
        flags[f] = argv[++i];
      }
    }
    FLAME_CHECK(flags.count("dir"), "vae_parity", "--dir is required\n", kUsage);
    const fs::path dir = flags["dir"];
    const std::string dev = flags.count("device") ? flags["device"] : (flame::cuda_is_available() ? "cuda" : "cpu");
    const flame::Device device = dev == "cuda" ? flame::Device::cuda(0) : flame::Device::cpu();
    const bool cuda = device.is_cuda();

    const std::string ref_path = (dir / "reference.safetensors").string();
    const flame::io::Metadata meta = flame::io::load_safetensors_metadata(ref_path);
    const flame::StateDict ref = flame::io::load_safetensors(ref_path);
    const DType dtype = meta.at("dtype") == "bf16" ? DType::bf16 : DType::f32;
    const double tol = flags.count("tol") ? std::stod(flags["tol"]) : (dtype == DType::f32 ? 1e-3 : 5e-2);
    const int64_t tile = std::stoll(meta.at("tile_sample_size"));
    if (cuda) {  // parity in f32 means f32: no TF32 in convolutions or matmuls (the script sets the same)
      flame::cuda::set_allow_conv_tf32(false);
      flame::cuda::set_allow_tf32(false);
    }
    std::printf("reference %s: family %s, dtype %s, device %s\n", ref_path.c_str(), meta.at("family").c_str(),
                meta.at("dtype").c_str(), dev.c_str());

    bool ok = true;
    const std::string folder = (dir / "diffusers").string(), single = (dir / meta.at("single_file")).string();
    for (const std::string& path : {folder, single}) {
      m::VaeLoadOptions o;
      o.device = device;
      o.dtype = dtype;
      if (path == single && flags.count("single-file-config")) o.config_json = folder + "/config.json";
      m::Checkpoint ck = m::Checkpoint::open(path, {"vae", ""});
      const m::VaeFileInfo info = m::inspect_vae(ck, "", o.config_json);
      std::printf("%s: layout %s, prefix \"%s\", family %s\n", ck.description().c_str(), info.format.c_str(),
                  info.prefix.c_str(), info.family.c_str());
      if (path == single && o.config_json.empty() && info.family != meta.at("family")) {
        std::printf("FAIL family guessed %s, expected %s\n", info.family.c_str(), meta.at("family").c_str());
        ok = false;
      }
      auto vae = m::load_vae(ck, o);
      flame::NoGradGuard no_grad;
      auto in = [&](const char* name) { return ref.at(name).to(dtype, device); };
      const m::LatentDistribution dist = vae->encode(in("image"));
      const m::LatentDistribution tiled = vae->tiled_encode(in("tiled_image"), {tile, 0.25});
      const std::vector<std::pair<std::string, Tensor>> outs = {
          {"mean", dist.mean},
          {"logvar", dist.logvar},
          {"decoded", vae->decode(in("latent"))},
          {"tiled_mean", tiled.mean},
          {"tiled_logvar", tiled.logvar},
          {"tiled_decoded", vae->tiled_decode(in("tiled_latent"), {tile, 0.25})}};
      for (const auto& [name, t] : outs) {
        const Err e = compare(t, ref.at(name));
        const bool pass = e.rel <= tol;
        ok = ok && pass;
        std::printf("  %-14s max abs %.3e  max rel %.3e  %s\n", name.c_str(), e.abs, e.rel, pass ? "ok" : "FAIL");
      }
    }
    std::printf("%s vae_parity %s %s (tolerance %.1e relative to the reference's max)\n", ok ? "PASS" : "FAIL",
                meta.at("family").c_str(), meta.at("dtype").c_str(), tol);

    if (flags.count("memory") || flags.count("time")) {
      const int64_t size = flags.count("time-size") ? std::stoll(flags["time-size"]) : 1024;
      m::VaeLoadOptions o;
      o.device = device;
      o.dtype = dtype;
      auto vae = m::load_vae(folder, o);
      flame::NoGradGuard no_grad;
      const int64_t f = vae->config().downscale();
      flame::Generator gen(1);
      const Tensor img = Tensor::uniform({1, 3, size, size}, -1.0, 1.0, {dtype, device}, &gen);
      const Tensor lat = Tensor::randn({1, vae->config().latent_channels, size / f, size / f}, 0.0, 1.0,
                                       {dtype, device}, &gen);
      if (flags.count("memory")) {
        // Where the memory of one decode and one encode at TIME_SIZE² goes (profiler::MemoryProfiler;
        // works on the CPU too): the peak above what was allocated before, and the ops holding it.
        for (const std::string what : {"decode", "encode"}) {
          flame::profiler::MemoryProfiler prof;
          prof.start();
          if (what == "decode") {
            (void)vae->decode(lat);
          } else {
            (void)vae->encode(img);
          }
          prof.stop();
          for (const auto& d : prof.summary()) {
            if (d.device != device) continue;
            std::printf("memory %s %lld² %s on %s: peak %.3f GiB above the %.3f GiB held before\n", what.c_str(),
                        static_cast<long long>(size), meta.at("dtype").c_str(), dev.c_str(),
                        static_cast<double>(d.peak_bytes - d.start_bytes) / (1 << 30),
                        static_cast<double>(d.start_bytes) / (1 << 30));
          }
          int shown = 0;
          for (const auto& g : prof.peak_groups(device, flame::profiler::GroupBy::op)) {
            if (++shown > 6) break;
            std::printf("  at the peak: %-40s %.3f GiB in %lld blocks\n", (g.phase == "before" ? std::string("(held before)") : g.op).c_str(),
                        static_cast<double>(g.bytes) / (1 << 30), static_cast<long long>(g.count));
          }
        }
      }
      if (flags.count("time")) {
        const m::TileOptions tiles{size / 2, 0.25};  // four tiles of half the image, as diffusers' 512 at 1024²
        const std::vector<std::pair<std::string, std::function<void()>>> work = {
            {"decode", [&] { vae->decode(lat); }},
            {"encode", [&] { vae->encode(img); }},
            {"tiled_decode", [&] { vae->tiled_decode(lat, tiles); }},
            {"tiled_encode", [&] { vae->tiled_encode(img, tiles); }}};
        for (const auto& [what, fn] : work) {
          fn();
          double base = 0, peak = 0;
          if (cuda) {
            flame::cuda::synchronize();
            flame::cuda::reset_peak_memory_stats();
            base = static_cast<double>(flame::cuda::memory_stats().allocated_bytes);
          }
          const double ms = median_ms(fn, cuda);
          if (cuda) peak = static_cast<double>(flame::cuda::memory_stats().peak_allocated_bytes);
          std::printf(
              "{\"impl\": \"flame\", \"work\": \"%s\", \"size\": %lld, \"dtype\": \"%s\", \"ms\": %.3f, \"peak_gib\": "
              "%.3f, \"peak_over_weights_gib\": %.3f, \"device\": \"%s\"}\n",
              what.c_str(), static_cast<long long>(size), meta.at("dtype").c_str(), ms, peak / (1 << 30),
              (peak - base) / (1 << 30), dev.c_str());
        }
        // Tiled against untiled at the timed size (tiles of half the image, 0.25 overlap, as
        // diffusers' enable_tiling with 512-pixel tiles at 1024²): how far the blended seams move it.
        const Tensor full = vae->decode(lat), tiled = vae->tiled_decode(lat, tiles);
        const m::LatentDistribution full_enc = vae->encode(img), tiled_enc = vae->tiled_encode(img, tiles);
        const std::vector<std::tuple<const char*, Tensor, Tensor>> pairs = {{"decode", full, tiled},
                                                                            {"encode mean", full_enc.mean, tiled_enc.mean}};
        for (const auto& [what, a, b] : pairs) {
          const Err e = compare(b, a);
          const Tensor d = (b.to(DType::f32) - a.to(DType::f32)).abs();
          std::printf("tiled vs untiled %s at %lld² (tile %lld px): max abs %.3e, max rel %.3e, mean abs %.3e, "
                      "mean |untiled| %.3e\n",
                      what, static_cast<long long>(size), static_cast<long long>(tiles.sample_tile), e.abs,
                      e.rel, d.mean().item<double>(), a.to(DType::f32).abs().mean().item<double>());
        }
      }
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vae_parity: %s\n", e.what());
    return 2;
  }
}
