#include "unet.h"

#include <cmath>
#include <sstream>

namespace flame_diffusion {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::Shape;

namespace {

// PyTorch's reset_parameters for Linear/Conv2d, drawn from `gen` so a seed fixes the model.
void default_init(Tensor w, Tensor b, flame::Generator* gen) {
  nn::init::kaiming_uniform_(w, std::sqrt(5.0), nn::init::FanMode::fan_in, nn::init::Nonlinearity::leaky_relu, gen);
  if (b.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(nn::init::calculate_fan_in_and_fan_out(w).first));
    nn::init::uniform_(b, -bound, bound, gen);
  }
}

std::shared_ptr<nn::Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride = 1) {
  return std::make_shared<nn::Conv2d>(in, out, Shape{3, 3}, Shape{stride, stride}, Shape{1, 1});
}

void check_groups(int64_t channels, int64_t groups) {
  FLAME_CHECK(groups >= 1 && channels % groups == 0, "UNet", "GroupNorm groups ", groups,
              " must divide the channel count ", channels);
}

}  // namespace

UNetConfig unet_config(const std::string& name) {
  UNetConfig c;
  c.name = name;
  if (name == "unet-tiny") {
    c.base_channels = 32;
    c.channel_mult = {1, 2, 2};
    c.groups = 8;
    c.heads = 2;
    c.emb_dim = 128;
  } else if (name == "unet-s") {
    c.base_channels = 64;
    c.channel_mult = {1, 2, 4};
    c.groups = 32;
    c.heads = 4;
    c.emb_dim = 256;
  } else {
    FLAME_FAIL("unet_config", "unknown UNet preset '", name, "' (known: unet-tiny, unet-s)");
  }
  return c;
}

ResBlock::ResBlock(int64_t in_ch, int64_t out_ch, int64_t emb_dim, int64_t groups) {
  check_groups(in_ch, groups);
  check_groups(out_ch, groups);
  norm1 = register_module("norm1", std::make_shared<nn::GroupNorm>(groups, in_ch));
  conv1 = register_module("conv1", conv3x3(in_ch, out_ch));
  emb_proj = register_module("emb_proj", std::make_shared<nn::Linear>(emb_dim, out_ch));
  norm2 = register_module("norm2", std::make_shared<nn::GroupNorm>(groups, out_ch));
  conv2 = register_module("conv2", conv3x3(out_ch, out_ch));
  if (in_ch != out_ch) skip = register_module("skip", std::make_shared<nn::Conv2d>(in_ch, out_ch, Shape{1, 1}));
}

Tensor ResBlock::forward(const Tensor& x, const Tensor& c) {
  Tensor h = conv1->forward(norm1->forward(x).silu());
  h = h + emb_proj->forward(c.silu()).unsqueeze(2).unsqueeze(3);
  h = conv2->forward(norm2->forward(h).silu());
  return (skip ? skip->forward(x) : x) + h;
}

AttnBlock::AttnBlock(int64_t channels, int64_t groups, int64_t heads) : heads_(heads) {
  check_groups(channels, groups);
  FLAME_CHECK(heads >= 1 && channels % heads == 0, "AttnBlock", "channels ", channels,
              " must be divisible by heads ", heads);
  norm = register_module("norm", std::make_shared<nn::GroupNorm>(groups, channels));
  qkv = register_module("qkv", std::make_shared<nn::Linear>(channels, 3 * channels));
  proj = register_module("proj", std::make_shared<nn::Linear>(channels, channels));
}

Tensor AttnBlock::forward(const Tensor& x) {
  const int64_t b = x.size(0), ch = x.size(1), hh = x.size(2), ww = x.size(3);
  Tensor tokens = norm->forward(x).flatten(2).transpose(1, 2);  // [B, HW, C]
  // qkv [B, HW, 3C] laid out (3, heads, C / heads), as the DiT's: the packed attention op.
  Tensor out = proj->forward(F::attention_qkv_packed(qkv->forward(tokens), heads_));  // [B, HW, C]
  return x + out.transpose(1, 2).reshape({b, ch, hh, ww});
}

UNet::UNet(const UNetConfig& config, uint64_t seed) : config_(config) {
  const UNetConfig& c = config_;
  const int64_t levels = static_cast<int64_t>(c.channel_mult.size());
  FLAME_CHECK(levels >= 1, "UNet", "channel_mult must not be empty");
  FLAME_CHECK(c.image_size > 0 && c.image_size % (int64_t{1} << (levels - 1)) == 0, "UNet", "image_size ",
              c.image_size, " must be divisible by 2^", levels - 1, " for ", levels, " levels");
  t_embedder = register_module("t_embedder", std::make_shared<TimestepEmbedder>(c.emb_dim, c.frequency_dim));
  y_embedder = register_module("y_embedder", std::make_shared<LabelEmbedder>(c.num_classes, c.emb_dim));
  std::vector<int64_t> ch(static_cast<std::size_t>(levels));
  for (int64_t i = 0; i < levels; ++i) ch[static_cast<std::size_t>(i)] = c.base_channels * c.channel_mult[static_cast<std::size_t>(i)];
  conv_in = register_module("conv_in", conv3x3(c.in_channels, c.base_channels));

  auto down_list = register_module("down_blocks", std::make_shared<nn::ModuleList>());
  auto down_s = register_module("downsamplers", std::make_shared<nn::ModuleList>());
  int64_t cur = c.base_channels;
  for (int64_t i = 0; i < levels; ++i) {
    const int64_t out = ch[static_cast<std::size_t>(i)];
    down_blocks.push_back(std::make_shared<ResBlock>(cur, out, c.emb_dim, c.groups));
    down_list->push_back(down_blocks.back());
    cur = out;
    if (i + 1 < levels) {
      downsamplers.push_back(conv3x3(cur, cur, 2));
      down_s->push_back(downsamplers.back());
    }
  }
  mid_block1 = register_module("mid_block1", std::make_shared<ResBlock>(cur, cur, c.emb_dim, c.groups));
  mid_attn = register_module("mid_attn", std::make_shared<AttnBlock>(cur, c.groups, c.heads));
  mid_block2 = register_module("mid_block2", std::make_shared<ResBlock>(cur, cur, c.emb_dim, c.groups));

  auto up_list = register_module("up_blocks", std::make_shared<nn::ModuleList>());
  auto up_s = register_module("upsamplers", std::make_shared<nn::ModuleList>());
  for (int64_t j = 0; j < levels; ++j) {
    const int64_t out = ch[static_cast<std::size_t>(levels - 1 - j)];
    up_blocks.push_back(std::make_shared<ResBlock>(cur + out, out, c.emb_dim, c.groups));
    up_list->push_back(up_blocks.back());
    cur = out;
    if (j + 1 < levels) {
      upsamplers.push_back(conv3x3(cur, cur));
      up_s->push_back(upsamplers.back());
    }
  }
  norm_out = register_module("norm_out", std::make_shared<nn::GroupNorm>(c.groups, cur));
  conv_out = register_module("conv_out", conv3x3(cur, c.in_channels));

  flame::Generator gen(seed);
  flame::NoGradGuard no_grad;
  apply([&gen](nn::Module& m) {
    if (auto* l = dynamic_cast<nn::Linear*>(&m)) default_init(l->weight(), l->bias(), &gen);
    if (auto* cv = dynamic_cast<nn::Conv2d*>(&m)) default_init(cv->weight(), cv->bias(), &gen);
  });
  init_embedders(*t_embedder, *y_embedder, &gen);
  Tensor w = conv_out->weight(), b = conv_out->bias();
  nn::init::zeros_(w);
  nn::init::zeros_(b);
}

std::string UNet::extra_repr() const {
  std::ostringstream os;
  os << "preset=" << config_.name << ", base_channels=" << config_.base_channels << ", levels="
     << config_.channel_mult.size() << ", groups=" << config_.groups;
  return os.str();
}

Tensor UNet::forward(const Tensor& x, const Tensor& t, const Tensor& y) {
  check_inputs(x, t, y);
  Tensor c = t_embedder->forward(t.to(flame::DType::f32) * config_.time_scale) + y_embedder->forward(y);
  Tensor h = conv_in->forward(x);
  std::vector<Tensor> skips;
  const std::size_t levels = down_blocks.size();
  for (std::size_t i = 0; i < levels; ++i) {
    h = down_blocks[i]->forward(h, c);
    skips.push_back(h);
    if (i + 1 < levels) h = downsamplers[i]->forward(h);
  }
  h = mid_block2->forward(mid_attn->forward(mid_block1->forward(h, c)), c);
  for (std::size_t j = 0; j < levels; ++j) {
    h = up_blocks[j]->forward(flame::cat({h, skips[levels - 1 - j]}, 1), c);
    if (j + 1 < levels) {
      h = F::interpolate(h, F::InterpolateOptions().with_scale(2.0).with_mode("nearest"));
      h = upsamplers[j]->forward(h);
    }
  }
  return conv_out->forward(norm_out->forward(h).silu());
}

}  // namespace flame_diffusion
