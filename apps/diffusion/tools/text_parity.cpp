// text_parity: FLAME's text encoders against transformers' outputs written by
// apps/diffusion/reference/models_text.py (--config clip-l|clip-g|t5-xxl --dtype f32|bf16 --out DIR).
//
//   text_parity --dir DIR [--device cuda|cpu] [--tol T]
//   text_parity --time --model clip-l|clip-g|t5-xxl [--batch N] [--length L] [--device cuda]
//
// Check mode: every file of DIR the reference lists (the transformers folder and each single-file
// layout, fp8 ones against the outputs of their dequantized weights) is loaded in the reference's
// dtype (single files of the real configurations as a user's file: configuration from the family
// preset and the shapes; of the reduced ones with DIR/transformers/config.json), run on the stored
// ids with and without the attention mask, and each output is printed with its max abs error and
// its max error relative to the
// reference's largest value, then ok/FAIL (relative error <= T; T = 1e-4 for f32, which runs with
// TF32 off, 3e-2 for bf16). A real bf16 reference also holds the f32 outputs of the same weights:
// then an output also passes when its error against them is at most 1.5 x transformers' own (both
// printed; a 32-layer stack in bf16 drifts a few bf16 ulps from any other bf16 run). Exit status 1
// on FAIL.
// Time mode: random bf16 weights of the real configuration, random ids [N, L] (T5-XXL 16 x 512 with
// a full mask; CLIP 64 x 77 with every hidden state kept, as SDXL needs), 3 warm-ups then the median
// of 10 encodes timed with CUDA events, and the peak memory, as one JSON line comparable with
// models_text.py --time.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/io/safetensors.h>

#include "models/text_checkpoint.h"
#include "parity_util.h"

namespace fs = std::filesystem;
namespace m = flame_diffusion::models;
using flame::DType;
using flame::Tensor;

namespace {

const char* kUsage =
    "usage: text_parity --dir DIR [--device cuda|cpu] [--tol T]\n"
    "       text_parity --time --model clip-l|clip-g|t5-xxl [--batch N] [--length L] [--device cuda|cpu]\n";

using flame_diffusion::tools::median_ms;
using Err = flame_diffusion::tools::ParityError;

Err compare(const Tensor& got, const Tensor& ref) { return flame_diffusion::tools::parity_error(got, ref, "text_parity"); }

int check(const fs::path& dir, flame::Device device, const std::map<std::string, std::string>& flags) {
  const std::string ref_path = (dir / "reference.safetensors").string();
  const flame::io::Metadata meta = flame::io::load_safetensors_metadata(ref_path);
  const flame::StateDict ref = flame::io::load_safetensors(ref_path);
  const DType dtype = meta.at("dtype") == "bf16" ? DType::bf16 : DType::f32;
  const double tol = flags.count("tol") ? std::stod(flags.at("tol")) : (dtype == DType::f32 ? 1e-4 : 3e-2);
  const std::string family = meta.at("family");
  const bool t5 = family == "t5-xxl";
  std::printf("reference %s: %s (%s), dtype %s, device %s, %s\n", ref_path.c_str(), meta.at("name").c_str(),
              family.c_str(), meta.at("dtype").c_str(), device.is_cuda() ? "cuda" : "cpu", meta.at("versions").c_str());
  const Tensor ids = ref.at("input_ids"), mask = ref.at("attention_mask");
  bool ok = true;
  auto report = [&](const std::string& name, const Tensor& got) {
    const Err e = compare(got, ref.at(name));
    bool pass = e.rel <= tol;
    std::string drift;
    if (const Tensor* exact = ref.find("f32ref_" + name)) {
      // bf16: both implementations against the f32 outputs of the same weights. Within the
      // tolerance of transformers, or no further from f32 than 1.5 x transformers' own bf16 error.
      const Err mine = compare(got, *exact), theirs = compare(ref.at(name), *exact);
      pass = pass || mine.rel <= 1.5 * theirs.rel;
      char buf[96];
      std::snprintf(buf, sizeof buf, "  vs f32: flame %.3e, transformers %.3e", mine.rel, theirs.rel);
      drift = buf;
    }
    ok = ok && pass;
    std::printf("  %-40s max abs %.3e  max rel %.3e  %s%s\n", name.c_str(), e.abs, e.rel, pass ? "ok" : "FAIL",
                drift.c_str());
  };
  const m::JsonConfig files = m::JsonConfig::parse(meta.at("files"), ref_path + " metadata \"files\"");
  for (const std::string& file : files.keys()) {
    const std::string prefix = files.get_string(file);
    m::TextEncoderLoadOptions o;
    o.device = device;
    o.dtype = dtype;
    o.family = family;
    // Single files of the real configurations load as a user's file does: the configuration from
    // the family's preset and the shapes. The reduced ones take the folder's config.json.
    const bool reduced = meta.at("name").rfind("tiny", 0) == 0;
    if (file == "transformers" || reduced) o.config_json = (dir / "transformers" / "config.json").string();
    const std::string path = (dir / file).string();
    const m::Checkpoint ck = m::open_text_encoder_checkpoint(path, t5 ? "t5" : "clip", o);
    flame::NoGradGuard no_grad;
    if (t5) {
      const m::T5FileInfo info = m::inspect_t5_encoder(ck, o.config_json);
      std::printf("%s: layout %s, prefix \"%s\"%s\n", ck.description().c_str(), info.entry.format.c_str(),
                  info.entry.prefix.c_str(), info.fp8_scaled ? ", fp8 scaled" : "");
      auto model = m::load_t5_encoder(ck, o);
      report(prefix + "last_hidden_state", model->encode(ids, mask));
      report(prefix + "unmasked_last_hidden_state", model->encode(ids));
      continue;
    }
    const m::ClipFileInfo info = m::inspect_clip_text(ck, family, o.config_json);
    std::printf("%s: layout %s, prefix \"%s\", family %s%s\n", ck.description().c_str(), info.entry.format.c_str(),
                info.entry.prefix.c_str(), info.entry.family.c_str(), info.config.with_projection ? ", projection" : "");
    auto model = m::load_clip_text(ck, o);
    for (const std::string tag : {"", "masked_"}) {
      m::ClipEncodeOptions eo;
      eo.output_hidden_states = true;
      if (!tag.empty()) eo.attention_mask = mask;
      const m::ClipTextOutput out = model->encode(ids, eo);
      report(prefix + tag + "last_hidden_state", out.last_hidden_state);
      report(prefix + tag + "penultimate", out.hidden_states[out.hidden_states.size() - 2]);
      report(prefix + tag + "pooled", out.pooled);
      if (model->config().with_projection) report(prefix + tag + "text_embeds", out.text_embeds);
    }
  }
  if (t5 && ref.find("buckets")) {
    const std::vector<int64_t> want = ref.at("buckets").to_vec<int64_t>();
    const std::vector<int64_t> a = m::t5_relative_position_buckets(512, 512, 32, 128).select(0, 511).to_vec<int64_t>();
    const std::vector<int64_t> b = m::t5_relative_position_buckets(512, 512, 32, 128).select(0, 0).to_vec<int64_t>();
    int bad = 0;
    for (int i = 0; i < 512; ++i) bad += (a[i] != want[i]) + (b[i] != want[511 + i]);
    ok = ok && bad == 0;
    std::printf("  %-40s %d of 1023 differ  %s\n", "relative position buckets", bad, bad == 0 ? "ok" : "FAIL");
  }
  std::printf("%s text_parity %s %s (tolerance %.1e relative to the reference's max)\n", ok ? "PASS" : "FAIL",
              meta.at("name").c_str(), meta.at("dtype").c_str(), tol);
  return ok ? 0 : 1;
}

int time_model(const std::string& name, flame::Device device, int64_t batch, int64_t length) {
  const bool cuda = device.is_cuda();
  const bool t5 = name == "t5-xxl";
  if (batch <= 0) batch = t5 ? 16 : 64;
  if (length <= 0) length = t5 ? 512 : 77;
  flame::manual_seed(0);
  const flame::TensorOptions opts{DType::bf16, device};
  std::shared_ptr<m::T5EncoderModel> t5m;
  std::shared_ptr<m::ClipTextModel> clip;
  int64_t vocab = 0;
  if (t5) {
    t5m = std::make_shared<m::T5EncoderModel>(m::T5EncoderConfig::preset(name), opts);
    vocab = t5m->config().vocab_size;
  } else {
    clip = std::make_shared<m::ClipTextModel>(m::ClipTextConfig::preset(name), opts);
    vocab = clip->config().vocab_size;
  }
  flame::Generator gen(3);
  const Tensor ids = Tensor::randint(3, vocab - 2, {batch, length}, {DType::i64, device}, &gen);
  const Tensor mask = Tensor::ones({batch, length}, {DType::i64, device});
  flame::NoGradGuard no_grad;
  std::function<void()> fn;
  if (t5) fn = [&] { t5m->encode(ids, mask); };
  else fn = [&] { clip->encode(ids, {{}, true}); };
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
      "{\"impl\": \"flame\", \"model\": \"%s\", \"batch\": %lld, \"length\": %lld, \"dtype\": \"bf16\", \"ms\": %.3f, "
      "\"peak_gib\": %.3f, \"peak_over_weights_gib\": %.3f, \"device\": \"%s\"}\n",
      name.c_str(), static_cast<long long>(batch), static_cast<long long>(length), ms, peak / (1 << 30),
      (peak - base) / (1 << 30), cuda ? "cuda" : "cpu");
  return 0;
}

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
      FLAME_CHECK(f.rfind("--", 0) == 0, "text_parity", "unexpected argument ", f, "\n", kUsage);
      f = f.substr(2);
      if (f == "time") {
        flags[f] = "1";
      } else {
        FLAME_CHECK(f == "dir" || f == "device" || f == "tol" || f == "model" || f == "batch" || f == "length",
                    "text_parity", "unknown flag --", f, "\n", kUsage);
        FLAME_CHECK(i + 1 < argc, "text_parity", "--", f, " needs a value");
        flags[f] = argv[++i];
      }
    }
    const std::string dev = flags.count("device") ? flags["device"] : (flame::cuda_is_available() ? "cuda" : "cpu");
    FLAME_CHECK(dev == "cuda" || dev == "cpu", "text_parity", "--device must be cuda or cpu, got ", dev);
    const flame::Device device = dev == "cuda" ? flame::Device::cuda(0) : flame::Device::cpu();
    if (device.is_cuda()) {  // parity in f32 means f32: no TF32 (the script sets the same)
      flame::cuda::set_allow_conv_tf32(false);
      flame::cuda::set_allow_tf32(false);
    }
    if (flags.count("time")) {
      FLAME_CHECK(flags.count("model"), "text_parity", "--time needs --model clip-l|clip-g|t5-xxl\n", kUsage);
      const std::string model = flags["model"];
      FLAME_CHECK(model == "clip-l" || model == "clip-g" || model == "t5-xxl", "text_parity", "--model ", model,
                  " is not one of clip-l, clip-g, t5-xxl");
      return time_model(model, device, flags.count("batch") ? std::stoll(flags["batch"]) : 0,
                        flags.count("length") ? std::stoll(flags["length"]) : 0);
    }
    FLAME_CHECK(flags.count("dir"), "text_parity", "--dir is required\n", kUsage);
    return check(flags["dir"], device, flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "text_parity: %s\n", e.what());
    return 2;
  }
}
