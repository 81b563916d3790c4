#include "models/vae.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace flame_diffusion::models {

namespace F = flame::nn::functional;
using flame::DType;
using flame::Shape;
using flame::Tensor;
using flame::TensorOptions;
using flame::nn::Conv2d;
using flame::nn::GroupNorm;
using flame::nn::Linear;
using flame::nn::ModuleList;

// Every norm of the diffusers VAE (resnets, attention, conv_norm_out) uses eps 1e-6.
constexpr double kNormEps = 1e-6;

// ---------------------------------------------------------------- config

VaeConfig VaeConfig::preset(const std::string& name) {
  VaeConfig c;  // defaults are SD 1.x's
  if (name == "sd") {
    c.family = "sd";
  } else if (name == "sdxl") {
    c.family = "sdxl";
    c.sample_size = 1024;
    c.scaling_factor = 0.13025;
  } else if (name == "sd3" || name == "flux") {
    c.family = name;
    c.sample_size = 1024;
    c.latent_channels = 16;
    c.use_quant_conv = c.use_post_quant_conv = false;
    c.scaling_factor = name == "sd3" ? 1.5305 : 0.3611;
    c.shift_factor = name == "sd3" ? 0.0609 : 0.1159;
  } else {
    FLAME_FAIL("VaeConfig::preset", "unknown VAE family \"", name, "\" (known: sd, sdxl, sd3, flux)");
  }
  return c;
}

std::string VaeConfig::guess_family() const {
  for (const char* name : {"sd", "sdxl", "sd3", "flux"}) {
    VaeConfig p = preset(name);
    const bool same_shift = shift_factor.has_value() == p.shift_factor.has_value() &&
                            (!shift_factor || std::abs(*shift_factor - *p.shift_factor) < 1e-6);
    if (p.block_out_channels == block_out_channels && p.layers_per_block == layers_per_block &&
        p.latent_channels == latent_channels && p.use_quant_conv == use_quant_conv &&
        std::abs(p.scaling_factor - scaling_factor) < 1e-6 && same_shift)
      return name;
  }
  return "custom";
}

std::string VaeConfig::to_string() const {
  std::ostringstream os;
  os << "family=" << family << ", block_out_channels=" << flame::shape_str(block_out_channels)
     << ", layers_per_block=" << layers_per_block << ", latent_channels=" << latent_channels
     << ", norm_num_groups=" << norm_num_groups << ", quant_conv=" << use_quant_conv
     << ", post_quant_conv=" << use_post_quant_conv << ", mid_attention=" << mid_block_add_attention
     << ", scaling_factor=" << scaling_factor << ", shift_factor=";
  if (shift_factor) os << *shift_factor; else os << "none";
  os << ", force_upcast=" << force_upcast;
  return os.str();
}

VaeConfig VaeConfig::from_json(const JsonConfig& j) {
  VaeConfig c;
  c.in_channels = j.get_int("in_channels", 3);
  c.out_channels = j.get_int("out_channels", 3);
  c.block_out_channels = j.get_ints("block_out_channels", {64});
  c.layers_per_block = j.get_int("layers_per_block", 1);
  c.latent_channels = j.get_int("latent_channels", 4);
  c.norm_num_groups = j.get_int("norm_num_groups", 32);
  // sample_size may be a pair [h, w]; diffusers tiles with its first entry.
  if (j.has("sample_size")) {
    std::vector<int64_t> s = {0};
    try {
      s = {j.get_int("sample_size")};
    } catch (const flame::Error&) {
      s = j.get_ints("sample_size");
    }
    FLAME_CHECK(!s.empty(), "VaeConfig", j.origin(), ": sample_size is an empty list");
    c.sample_size = s[0];
  } else {
    c.sample_size = 32;
  }
  c.use_quant_conv = j.get_bool("use_quant_conv", true);
  c.use_post_quant_conv = j.get_bool("use_post_quant_conv", true);
  c.mid_block_add_attention = j.get_bool("mid_block_add_attention", true);
  c.scaling_factor = j.get_double("scaling_factor", 0.18215);
  c.shift_factor = j.get_optional_double("shift_factor");
  c.force_upcast = j.get_bool("force_upcast", true);
  const std::string act = j.get_string("act_fn", "silu");
  FLAME_CHECK(act == "silu" || act == "swish", "VaeConfig", j.origin(), ": act_fn \"", act,
              "\" is not supported (AutoencoderKL here uses silu, as every SD/SDXL/SD3/FLUX VAE)");
  const auto levels = c.block_out_channels.size();
  FLAME_CHECK(levels >= 1, "VaeConfig", j.origin(), ": block_out_channels is empty");
  for (const auto& [key, want] : {std::pair<const char*, const char*>{"down_block_types", "DownEncoderBlock2D"},
                                  {"up_block_types", "UpDecoderBlock2D"}}) {
    const auto types = j.get_strings(key, std::vector<std::string>(levels, want));
    FLAME_CHECK(types.size() == levels, "VaeConfig", j.origin(), ": ", key, " has ", types.size(),
                " entries but block_out_channels has ", levels);
    for (const std::string& t : types)
      FLAME_CHECK(t == want, "VaeConfig", j.origin(), ": ", key, " entry \"", t, "\" is not supported (only ", want,
                  ")");
  }
  FLAME_CHECK(!j.has("latents_mean") && !j.has("latents_std"), "VaeConfig", j.origin(),
              ": latents_mean/latents_std (per-channel latent normalisation) are not supported; this VAE "
              "scales latents by scaling_factor/shift_factor only");
  for (int64_t ch : c.block_out_channels)
    FLAME_CHECK(ch > 0 && ch % c.norm_num_groups == 0, "VaeConfig", j.origin(), ": block_out_channels ",
                flame::shape_str(c.block_out_channels), " must be multiples of norm_num_groups ", c.norm_num_groups);
  c.family = c.guess_family();
  return c;
}

DType vae_compute_dtype(DType requested, const VaeConfig& config) {
  return (requested == DType::f16 && config.force_upcast) ? DType::f32 : requested;
}

// ---------------------------------------------------------------- distribution

Tensor LatentDistribution::std() const { return (logvar * 0.5).exp(); }

Tensor LatentDistribution::sample(flame::Generator* gen) const {
  Tensor eps = Tensor::randn(mean.sizes(), 0.0, 1.0, {mean.dtype(), mean.device()}, gen);
  return mean + std() * eps;
}

// ---------------------------------------------------------------- tiling

namespace {

// b's first `extent` rows (dim 2) or columns (dim 3) blended from a's last ones: a * (1 - t) + b * t
// with t = k / extent, computed in f32.
Tensor blend(const Tensor& a, const Tensor& b, int64_t dim, int64_t extent) {
  extent = std::min({a.size(dim), b.size(dim), extent});
  if (extent <= 0) return b;
  Shape wshape = {1, 1, 1, 1};
  wshape[dim] = extent;
  Tensor t = (Tensor::arange(extent, {DType::f32, b.device()}) / static_cast<double>(extent)).reshape(wshape);
  Tensor a_end = a.narrow(dim, a.size(dim) - extent, extent).to(DType::f32);
  Tensor b_start = b.narrow(dim, 0, extent).to(DType::f32);
  Tensor mixed = (a_end * (1.0 - t) + b_start * t).to(b.dtype());
  if (extent == b.size(dim)) return mixed;
  return flame::cat({mixed, b.narrow(dim, extent, b.size(dim) - extent)}, dim);
}

}  // namespace

Tensor tiled_apply(const Tensor& x, int64_t in_tile, int64_t out_tile, double overlap,
                   const std::function<Tensor(const Tensor&)>& fn) {
  FLAME_CHECK(x.dim() == 4, "tiled_apply", "expects [N, C, H, W], got ", x.sizes());
  FLAME_CHECK(in_tile > 0 && out_tile > 0 && overlap >= 0.0 && overlap < 1.0, "tiled_apply", "tile sizes ", in_tile,
              " -> ", out_tile, " must be positive and overlap ", overlap, " in [0, 1)");
  // Python's int() truncation, as diffusers computes these.
  const auto step = static_cast<int64_t>(static_cast<double>(in_tile) * (1.0 - overlap));
  const auto extent = static_cast<int64_t>(static_cast<double>(out_tile) * overlap);
  const int64_t limit = out_tile - extent;
  FLAME_CHECK(step > 0 && limit > 0, "tiled_apply", "tile ", in_tile, " with overlap ", overlap,
              " leaves no stride (make the tile larger)");
  const int64_t H = x.size(2), W = x.size(3);
  std::vector<std::vector<Tensor>> rows;
  for (int64_t i = 0; i < H; i += step) {
    std::vector<Tensor> row;
    for (int64_t j = 0; j < W; j += step) {
      Tensor tile = x.narrow(2, i, std::min(in_tile, H - i)).narrow(3, j, std::min(in_tile, W - j));
      row.push_back(fn(tile));
    }
    rows.push_back(std::move(row));
  }
  flame::TensorList out_rows;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    flame::TensorList out_row;
    for (std::size_t j = 0; j < rows[i].size(); ++j) {
      Tensor tile = rows[i][j];
      if (i > 0) tile = blend(rows[i - 1][j], tile, 2, extent);
      if (j > 0) tile = blend(rows[i][j - 1], tile, 3, extent);
      rows[i][j] = tile;  // later neighbours blend with the blended tile, as diffusers' in-place update
      out_row.push_back(tile.narrow(2, 0, std::min(limit, tile.size(2))).narrow(3, 0, std::min(limit, tile.size(3))));
    }
    out_rows.push_back(flame::cat(out_row, 3));
  }
  return flame::cat(out_rows, 2);
}

// ---------------------------------------------------------------- blocks

namespace {
std::shared_ptr<Conv2d> conv3(int64_t in, int64_t out, TensorOptions o, int64_t stride = 1, int64_t pad = 1) {
  return std::make_shared<Conv2d>(in, out, 3, stride, pad, 1, 1, true, o);
}
std::shared_ptr<Conv2d> conv1(int64_t in, int64_t out, TensorOptions o) {
  return std::make_shared<Conv2d>(in, out, 1, 1, 0, 1, 1, true, o);
}
std::shared_ptr<GroupNorm> gnorm(int64_t groups, int64_t ch, TensorOptions o) {
  return std::make_shared<GroupNorm>(groups, ch, kNormEps, true, o);
}

// conv(silu(norm(x))) as three statements: written as one expression, C++ keeps the norm's output
// (a temporary) alive until the convolution returns, one full-resolution activation more at the
// peak of an encode or decode (256 MiB per 128 channels at 1024² in bf16).
Tensor norm_silu_conv(GroupNorm& norm, Conv2d& conv, const Tensor& x) {
  Tensor h = norm.forward(x);
  h = h.silu();
  return conv.forward(h);
}
}  // namespace

VaeResnetBlock::VaeResnetBlock(int64_t in, int64_t out, int64_t groups, TensorOptions o) {
  norm1_ = register_module("norm1", gnorm(groups, in, o));
  conv1_ = register_module("conv1", conv3(in, out, o));
  norm2_ = register_module("norm2", gnorm(groups, out, o));
  conv2_ = register_module("conv2", conv3(out, out, o));
  if (in != out) conv_shortcut_ = register_module("conv_shortcut", conv1(in, out, o));
}

Tensor VaeResnetBlock::forward(const Tensor& x) {
  Tensor h = norm_silu_conv(*norm1_, *conv1_, x);
  h = norm_silu_conv(*norm2_, *conv2_, h);  // dropout 0 in every VAE config
  return (conv_shortcut_ ? conv_shortcut_->forward(x) : x) + h;
}

VaeAttention::VaeAttention(int64_t channels, int64_t groups, TensorOptions o) : channels_(channels) {
  group_norm_ = register_module("group_norm", gnorm(groups, channels, o));
  to_q_ = register_module("to_q", std::make_shared<Linear>(channels, channels, true, o));
  to_k_ = register_module("to_k", std::make_shared<Linear>(channels, channels, true, o));
  to_v_ = register_module("to_v", std::make_shared<Linear>(channels, channels, true, o));
  auto to_out = register_module("to_out", std::make_shared<ModuleList>());
  to_out_ = std::make_shared<Linear>(channels, channels, true, o);
  to_out->push_back(to_out_);  // to_out.1 is diffusers' dropout (no parameters)
}

Tensor VaeAttention::forward(const Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1), Hh = x.size(2), Ww = x.size(3), L = Hh * Ww;
  // [B, C, H, W] -> [B, L, C] tokens after the norm (the norm is per channel group: same on 4-d).
  Tensor h = group_norm_->forward(x).reshape({B, C, L}).transpose(1, 2);
  Tensor q = to_q_->forward(h).unsqueeze(1);  // [B, 1, L, C]: one head of all channels
  Tensor k = to_k_->forward(h).unsqueeze(1);
  Tensor v = to_v_->forward(h).unsqueeze(1);
  // Softmax rows are independent, so query chunks give the same result with a chunk x L score
  // matrix; the chunk keeps it near 2^24 elements (a 1024^2 SDXL decode has L = 16384: 16 chunks of
  // 1024 rows, each still a large matmul).
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(L, 1));
  Tensor o;
  if (chunk >= L) {
    o = F::scaled_dot_product_attention(q, k, v);
  } else {
    flame::TensorList parts;
    for (int64_t s = 0; s < L; s += chunk)
      parts.push_back(F::scaled_dot_product_attention(q.narrow(2, s, std::min(chunk, L - s)), k, v));
    o = flame::cat(parts, 2);
  }
  o = to_out_->forward(o.squeeze(1));  // [B, L, C]
  return o.transpose(1, 2).reshape({B, C, Hh, Ww}) + x;
}

VaeMidBlock::VaeMidBlock(int64_t ch, int64_t groups, bool add_attention, TensorOptions o) {
  if (add_attention) {
    attention_ = std::make_shared<VaeAttention>(ch, groups, o);
    register_module("attentions", std::make_shared<ModuleList>())->push_back(attention_);
  }
  resnet0_ = std::make_shared<VaeResnetBlock>(ch, ch, groups, o);
  resnet1_ = std::make_shared<VaeResnetBlock>(ch, ch, groups, o);
  auto resnets = register_module("resnets", std::make_shared<ModuleList>());
  resnets->push_back(resnet0_);
  resnets->push_back(resnet1_);
}

Tensor VaeMidBlock::forward(const Tensor& x) {
  Tensor h = resnet0_->forward(x);
  if (attention_) h = attention_->forward(h);
  return resnet1_->forward(h);
}

VaeSampleBlock::VaeSampleBlock(bool down, int64_t in, int64_t out, int64_t layers, int64_t groups, bool resample,
                               TensorOptions o)
    : down_(down) {
  auto resnets = register_module("resnets", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < layers; ++i) {
    resnets_.push_back(std::make_shared<VaeResnetBlock>(i == 0 ? in : out, out, groups, o));
    resnets->push_back(resnets_.back());
  }
  if (resample) {
    // Downsample2D(padding=0): stride-2 3x3 conv without padding after an explicit (0, 1, 0, 1) pad.
    resample_conv_ = down ? conv3(out, out, o, 2, 0) : conv3(out, out, o);
    auto holder = std::make_shared<flame::nn::Module>();
    holder->register_module("conv", resample_conv_);
    register_module(down ? "downsamplers" : "upsamplers", std::make_shared<ModuleList>())->push_back(holder);
  }
}

Tensor VaeSampleBlock::forward(const Tensor& x) {
  Tensor h = x;
  for (const auto& r : resnets_) h = r->forward(h);
  if (!resample_conv_) return h;
  if (down_) return resample_conv_->forward(flame::pad(h, {0, 1, 0, 1}));
  return resample_conv_->forward(F::interpolate(h, F::InterpolateOptions().with_scale(2.0)));
}

VaeEncoder::VaeEncoder(const VaeConfig& c, TensorOptions o) {
  const auto& ch = c.block_out_channels;
  const int64_t g = c.norm_num_groups;
  conv_in_ = register_module("conv_in", conv3(c.in_channels, ch[0], o));
  auto blocks = register_module("down_blocks", std::make_shared<ModuleList>());
  int64_t prev = ch[0];
  for (std::size_t i = 0; i < ch.size(); ++i) {
    down_.push_back(
        std::make_shared<VaeSampleBlock>(true, prev, ch[i], c.layers_per_block, g, i + 1 < ch.size(), o));
    blocks->push_back(down_.back());
    prev = ch[i];
  }
  mid_ = register_module("mid_block", std::make_shared<VaeMidBlock>(ch.back(), g, c.mid_block_add_attention, o));
  norm_out_ = register_module("conv_norm_out", gnorm(g, ch.back(), o));
  conv_out_ = register_module("conv_out", conv3(ch.back(), 2 * c.latent_channels, o));
}

Tensor VaeEncoder::forward(const Tensor& x) {
  Tensor h = conv_in_->forward(x);
  for (const auto& b : down_) h = b->forward(h);
  h = mid_->forward(h);
  return norm_silu_conv(*norm_out_, *conv_out_, h);
}

VaeDecoder::VaeDecoder(const VaeConfig& c, TensorOptions o) {
  const auto& ch = c.block_out_channels;
  const int64_t g = c.norm_num_groups;
  conv_in_ = register_module("conv_in", conv3(c.latent_channels, ch.back(), o));
  auto blocks = register_module("up_blocks", std::make_shared<ModuleList>());
  mid_ = register_module("mid_block", std::make_shared<VaeMidBlock>(ch.back(), g, c.mid_block_add_attention, o));
  int64_t prev = ch.back();
  for (std::size_t i = 0; i < ch.size(); ++i) {
    const int64_t out = ch[ch.size() - 1 - i];
    up_.push_back(
        std::make_shared<VaeSampleBlock>(false, prev, out, c.layers_per_block + 1, g, i + 1 < ch.size(), o));
    blocks->push_back(up_.back());
    prev = out;
  }
  norm_out_ = register_module("conv_norm_out", gnorm(g, ch[0], o));
  conv_out_ = register_module("conv_out", conv3(ch[0], c.out_channels, o));
}

Tensor VaeDecoder::forward(const Tensor& z) {
  Tensor h = conv_in_->forward(z);
  h = mid_->forward(h);
  for (const auto& b : up_) h = b->forward(h);
  return norm_silu_conv(*norm_out_, *conv_out_, h);
}

// ---------------------------------------------------------------- AutoencoderKL

AutoencoderKL::AutoencoderKL(const VaeConfig& c, TensorOptions o) : config_(c) {
  FLAME_CHECK(!c.block_out_channels.empty() && c.layers_per_block >= 1 && c.latent_channels >= 1 &&
                  c.norm_num_groups >= 1,
              "AutoencoderKL", "bad config: ", c.to_string());
  for (int64_t ch : c.block_out_channels)
    FLAME_CHECK(ch % c.norm_num_groups == 0, "AutoencoderKL", "block_out_channels ",
                flame::shape_str(c.block_out_channels), " must be multiples of norm_num_groups ", c.norm_num_groups);
  encoder_ = register_module("encoder", std::make_shared<VaeEncoder>(c, o));
  decoder_ = register_module("decoder", std::make_shared<VaeDecoder>(c, o));
  if (c.use_quant_conv)
    quant_conv_ = register_module("quant_conv", conv1(2 * c.latent_channels, 2 * c.latent_channels, o));
  if (c.use_post_quant_conv)
    post_quant_conv_ = register_module("post_quant_conv", conv1(c.latent_channels, c.latent_channels, o));
}

std::string AutoencoderKL::extra_repr() const { return config_.to_string(); }

DType AutoencoderKL::dtype() const { return parameters().front().dtype(); }
flame::Device AutoencoderKL::device() const { return parameters().front().device(); }

namespace {
void check_image(const char* op, const Tensor& x, int64_t channels, int64_t multiple) {
  FLAME_CHECK(x.dim() == 4 && x.size(1) == channels, op, "expects [N, ", channels, ", H, W], got ", x.sizes());
  FLAME_CHECK(flame::is_floating(x.dtype()), op, "expects a floating tensor, got ", x.dtype());
  FLAME_CHECK(x.size(2) % multiple == 0 && x.size(3) % multiple == 0, op, "height and width ", x.size(2), "x",
              x.size(3), " must be multiples of ", multiple, " (the VAE's downscale)");
}
}  // namespace

Tensor AutoencoderKL::encode_moments(const Tensor& x) {
  Tensor h = encoder_->forward(x);
  return quant_conv_ ? quant_conv_->forward(h) : h;
}

Tensor AutoencoderKL::decode_raw(const Tensor& z) {
  return decoder_->forward(post_quant_conv_ ? post_quant_conv_->forward(z) : z);
}

int64_t AutoencoderKL::sample_tile(const TileOptions& o) const {
  const int64_t t = o.sample_tile > 0 ? o.sample_tile : config_.sample_size;
  FLAME_CHECK(t >= config_.downscale() && t % config_.downscale() == 0, "AutoencoderKL", "a tile of ", t,
              " pixels must be a positive multiple of the downscale ", config_.downscale());
  return t;
}

namespace {
LatentDistribution split_moments(const Tensor& moments, DType out) {
  flame::TensorList mv = flame::chunk(moments, 2, 1);
  return {mv[0].to(out), mv[1].clamp(-30.0, 20.0).to(out)};
}
}  // namespace

LatentDistribution AutoencoderKL::encode(const Tensor& images) {
  check_image("AutoencoderKL::encode", images, config_.in_channels, config_.downscale());
  if (tiling_) {
    const int64_t t = sample_tile(*tiling_);
    if (images.size(2) > t || images.size(3) > t) return tiled_encode(images, *tiling_);
  }
  return split_moments(encode_moments(images.to(dtype())), images.dtype());
}

Tensor AutoencoderKL::decode(const Tensor& latents) {
  check_image("AutoencoderKL::decode", latents, config_.latent_channels, 1);
  if (tiling_) {
    const int64_t t = sample_tile(*tiling_) / config_.downscale();
    if (latents.size(2) > t || latents.size(3) > t) return tiled_decode(latents, *tiling_);
  }
  return decode_raw(latents.to(dtype())).to(latents.dtype());
}

LatentDistribution AutoencoderKL::tiled_encode(const Tensor& images, TileOptions o) {
  check_image("AutoencoderKL::tiled_encode", images, config_.in_channels, config_.downscale());
  const int64_t t = sample_tile(o);
  Tensor moments = tiled_apply(images.to(dtype()), t, t / config_.downscale(), o.overlap,
                               [this](const Tensor& tile) { return encode_moments(tile); });
  return split_moments(moments, images.dtype());
}

Tensor AutoencoderKL::tiled_decode(const Tensor& latents, TileOptions o) {
  check_image("AutoencoderKL::tiled_decode", latents, config_.latent_channels, 1);
  const int64_t t = sample_tile(o);
  return tiled_apply(latents.to(dtype()), t / config_.downscale(), t, o.overlap,
                     [this](const Tensor& tile) { return decode_raw(tile); })
      .to(latents.dtype());
}

Tensor vae_to_latent(const VaeConfig& config, const Tensor& z) {
  const Tensor s = config.shift_factor ? z - *config.shift_factor : z;
  return s * config.scaling_factor;
}

Tensor AutoencoderKL::to_latent(const Tensor& z) const { return vae_to_latent(config_, z); }

Tensor AutoencoderKL::from_latent(const Tensor& z) const {
  Tensor s = z / config_.scaling_factor;
  return config_.shift_factor ? s + *config_.shift_factor : s;
}

Tensor AutoencoderKL::encode_latent(const Tensor& images, flame::Generator* gen) {
  LatentDistribution d = encode(images);
  return to_latent(gen ? d.sample(gen) : d.mode());
}

}  // namespace flame_diffusion::models
