#include "dit.h"

#include <cmath>
#include <optional>
#include <sstream>
#include <tuple>

#include "flame/nn/adaln.h"
#include "flame/nn/linear_gelu.h"
#include "flame/recompute.h"

namespace flame_diffusion {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;

namespace {

constexpr double kNormEps = 1e-6;  // the reference's LayerNorm(elementwise_affine=False, eps=1e-6)

// The adaLN pieces are F::layer_norm_modulate (LayerNorm without affine, eps 1e-6 as the
// reference's, then x * (1 + scale) + shift) and F::gated_residual (x + gate * branch): one fused
// kernel each on CUDA, forward and backward (flame/nn/adaln.h).

void xavier_linear(nn::Linear& l, flame::Generator* gen) {
  Tensor w = l.weight();
  nn::init::xavier_uniform_(w, 1.0, gen);
  if (l.bias().defined()) {
    Tensor b = l.bias();
    nn::init::zeros_(b);
  }
}

void zero_linear(nn::Linear& l) {
  Tensor w = l.weight(), b = l.bias();
  nn::init::zeros_(w);
  nn::init::zeros_(b);
}

}  // namespace

DiTRecompute parse_dit_recompute(const std::string& name) {
  if (name == "none") return DiTRecompute::none;
  if (name == "mlp") return DiTRecompute::mlp;
  if (name == "all") return DiTRecompute::all;
  FLAME_FAIL("DiT", "unknown recompute level '", name, "' (known: none, mlp, all)");
  return DiTRecompute::none;
}

DiTRecomputeSpec parse_dit_recompute_spec(const std::string& spec) {
  if (spec.rfind("mlp:", 0) == 0) {
    const std::string n = spec.substr(4);
    const bool digits = !n.empty() && n.size() <= 9 && n.find_first_not_of("0123456789") == std::string::npos;
    FLAME_CHECK(digits, "DiT", "recompute '", spec, "': expected mlp:N with N a block count (known: none, mlp, mlp:N, all)");
    return {DiTRecompute::mlp, std::stoll(n)};
  }
  if (spec == "none" || spec == "mlp" || spec == "all") return {parse_dit_recompute(spec), -1};
  FLAME_FAIL("DiT", "unknown recompute level '", spec, "' (known: none, mlp, mlp:N, all)");
  return {};
}

std::string dit_recompute_spec_name(const DiTRecomputeSpec& spec) {
  std::string s = dit_recompute_name(spec.level);
  if (spec.level == DiTRecompute::mlp && spec.mlp_blocks >= 0) s.append(1, ':').append(std::to_string(spec.mlp_blocks));
  return s;
}

const char* dit_recompute_name(DiTRecompute r) {
  switch (r) {
    case DiTRecompute::none: return "none";
    case DiTRecompute::mlp: return "mlp";
    case DiTRecompute::all: return "all";
  }
  return "none";
}

DiTConfig dit_config(const std::string& name) {
  DiTConfig c;
  c.name = name;
  if (name == "dit-tiny") {
    // Sized for the CPU demo: a few hundred steps of batch 32 in a few minutes on 2 cores
    // (README, Models: measured step times).
    c.hidden = 96;
    c.depth = 4;
    c.heads = 4;
  } else if (name == "dit-s") {
    c.hidden = 384;
    c.depth = 12;
    c.heads = 6;
  } else if (name == "dit-b") {
    c.hidden = 768;
    c.depth = 12;
    c.heads = 12;
  } else {
    FLAME_FAIL("dit_config", "unknown DiT preset '", name, "' (known: dit-tiny, dit-s, dit-b)");
  }
  return c;
}

PatchEmbed::PatchEmbed(int64_t in_channels, int64_t hidden, int64_t patch_size) {
  proj = register_module("proj", std::make_shared<nn::Conv2d>(in_channels, hidden, flame::Shape{patch_size, patch_size},
                                                              flame::Shape{patch_size, patch_size}));
}

// The convolution's kernel equals its stride, so each output token is one GEMM row: the patches
// gathered as [B, h*w, C*p*p] rows (channel, then kernel row, then column, as the weight is laid
// out) times the weight viewed as [hidden, C*p*p]. The tokens come out in their final layout, and
// on a GPU the GEMM replaces a convolution whose 4 input channels no tensor-core kernel takes
// (with the NCHW -> token transposes around it, about 0.5 ms of a dit-s B256 step on an H100).
Tensor PatchEmbed::forward(const Tensor& x) {
  FLAME_CHECK(x.dim() == 4, "PatchEmbed", "expected [B, C, H, W], got shape ", x.sizes());
  const Tensor& w = proj->weight();  // [hidden, C, p, p]
  const int64_t b = x.size(0), ch = x.size(1), p = w.size(2);
  FLAME_CHECK(ch == w.size(1) && x.size(2) % p == 0 && x.size(3) % p == 0, "PatchEmbed", "input shape ", x.sizes(),
              " does not fit patches of ", p, "x", p, " with ", w.size(1), " channels");
  const int64_t gh = x.size(2) / p, gw = x.size(3) / p;
  const Tensor patches =
      x.reshape({b, ch, gh, p, gw, p}).permute({0, 2, 4, 1, 3, 5}).reshape({b, gh * gw, ch * p * p});
  return F::linear(patches, w.reshape({w.size(0), ch * p * p}), proj->bias());  // [B, h*w, hidden]
}

DiTAttention::DiTAttention(int64_t hidden, int64_t heads) : heads_(heads) {
  FLAME_CHECK(hidden % heads == 0, "DiTAttention", "hidden ", hidden, " is not divisible by heads ", heads);
  qkv = register_module("qkv", std::make_shared<nn::Linear>(hidden, 3 * hidden));
  proj = register_module("proj", std::make_shared<nn::Linear>(hidden, hidden));
}

Tensor DiTAttention::forward(const Tensor& x) {
  // [B, T, 3 * hidden] laid out (3, H, hd) -> [B, T, hidden]: the reshape/permute/select + SDPA +
  // merge of heads as one op, whose backward writes dq, dk, dv into one gradient of the
  // projection's output (no zero fills, slice copies or sums; docs/nn-attention.md).
  return proj->forward(F::attention_qkv_packed(qkv->forward(x), heads_));
}

DiTMlp::DiTMlp(int64_t hidden, int64_t mlp_hidden) {
  fc1 = register_module("fc1", std::make_shared<nn::Linear>(hidden, mlp_hidden));
  fc2 = register_module("fc2", std::make_shared<nn::Linear>(mlp_hidden, hidden));
}

// The whole MLP as one fused op (F::mlp_gelu: bias and GELU in the GEMM epilogues on CUDA, gelu'
// in the backward's dh GEMM; measured 1.1x the linear_gelu + linear pair on an H100); with an
// adapter on fc2, fc1 + GELU alone fuse; a LoRA-wrapped fc1 keeps its own forward.
Tensor DiTMlp::forward(const Tensor& x) {
  if (!fc1->has_lora() && !fc2->has_lora())
    return F::mlp_gelu(x, fc1->weight(), fc1->bias(), fc2->weight(), fc2->bias(), recompute_hidden);
  const Tensor h = fc1->has_lora() ? fc1->forward(x).gelu(/*tanh=*/true)
                                   : F::linear_gelu(x, fc1->weight(), fc1->bias());
  return fc2->forward(h);
}

DiTBlock::DiTBlock(int64_t hidden, int64_t heads, double mlp_ratio) {
  attn = register_module("attn", std::make_shared<DiTAttention>(hidden, heads));
  mlp = register_module("mlp", std::make_shared<DiTMlp>(hidden, static_cast<int64_t>(hidden * mlp_ratio)));
  ada_linear = std::make_shared<nn::Linear>(hidden, 6 * hidden);
  register_module("adaLN_modulation", std::make_shared<nn::Sequential>(
                                          std::initializer_list<nn::ModulePtr>{std::make_shared<nn::SiLU>(), ada_linear}));
}

// shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp (the reference's order)
flame::TensorList DiTBlock::modulation(const Tensor& c) { return ada_linear->forward(c.silu()).chunk(6, 1); }

Tensor DiTBlock::forward(const Tensor& x, const Tensor& c) {
  flame::TensorList m = modulation(c);
  // h = x + gate_msa * attn(...) and the MLP branch's modulated norm of h in one op (one kernel on
  // CUDA: the residual stream is read once for both).
  const auto [h, n] = F::gated_residual_modulate(x, m[2], attn->forward(F::layer_norm_modulate(x, m[0], m[1], kNormEps)),
                                                 m[3], m[4], kNormEps);
  return F::gated_residual(h, m[5], mlp->forward(n));
}

DiTFinalLayer::DiTFinalLayer(int64_t hidden, int64_t patch_size, int64_t out_channels) {
  linear = register_module("linear", std::make_shared<nn::Linear>(hidden, patch_size * patch_size * out_channels));
  ada_linear = std::make_shared<nn::Linear>(hidden, 2 * hidden);
  register_module("adaLN_modulation", std::make_shared<nn::Sequential>(
                                          std::initializer_list<nn::ModulePtr>{std::make_shared<nn::SiLU>(), ada_linear}));
}

flame::TensorList DiTFinalLayer::modulation(const Tensor& c) { return ada_linear->forward(c.silu()).chunk(2, 1); }

Tensor DiTFinalLayer::forward(const Tensor& x, const Tensor& c) {
  flame::TensorList m = modulation(c);  // shift, scale
  return linear->forward(F::layer_norm_modulate(x, m[0], m[1], kNormEps));
}

DiT::DiT(const DiTConfig& config, uint64_t seed) : config_(config) {
  const DiTConfig& c = config_;
  FLAME_CHECK(c.input_size > 0 && c.patch_size > 0 && c.input_size % c.patch_size == 0, "DiT",
              "input_size ", c.input_size, " must be a positive multiple of patch_size ", c.patch_size);
  FLAME_CHECK(c.hidden % 4 == 0, "DiT", "hidden ", c.hidden, " must be divisible by 4 (2-D sin-cos table)");
  FLAME_CHECK(c.depth >= 1 && c.heads >= 1 && c.num_classes >= 1, "DiT", "depth, heads and num_classes must be >= 1");
  x_embedder = register_module("x_embedder", std::make_shared<PatchEmbed>(c.in_channels, c.hidden, c.patch_size));
  t_embedder = register_module("t_embedder", std::make_shared<TimestepEmbedder>(c.hidden, c.frequency_dim));
  y_embedder = register_module("y_embedder", std::make_shared<LabelEmbedder>(c.num_classes, c.hidden));
  pos_embed = register_parameter("pos_embed", Tensor::zeros({1, c.tokens(), c.hidden}));
  auto list = register_module("blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.depth; ++i) {
    blocks.push_back(std::make_shared<DiTBlock>(c.hidden, c.heads, c.mlp_ratio));
    list->push_back(blocks.back());
  }
  final_layer = register_module("final_layer", std::make_shared<DiTFinalLayer>(c.hidden, c.patch_size, c.in_channels));
  flame::Generator gen(seed);
  initialize_weights(&gen);
  set_recompute(c.recompute, c.recompute_mlp_blocks);
}

void DiT::set_recompute(DiTRecompute r, int64_t mlp_blocks) {
  const auto depth = static_cast<int64_t>(blocks.size());
  FLAME_CHECK(mlp_blocks <= depth && (mlp_blocks >= 0 || mlp_blocks == -1), "DiT.set_recompute",
              "mlp blocks ", mlp_blocks, " for a model of depth ", depth, " (expected -1 for all, or 0..", depth, ")");
  FLAME_CHECK(mlp_blocks == -1 || r == DiTRecompute::mlp, "DiT.set_recompute", "a block count applies to level mlp, not ",
              dit_recompute_name(r));
  config_.recompute = r;
  config_.recompute_mlp_blocks = mlp_blocks;
  const int64_t n = r == DiTRecompute::none ? 0 : mlp_blocks < 0 ? depth : mlp_blocks;
  for (int64_t i = 0; i < depth; ++i) blocks[static_cast<std::size_t>(i)]->mlp->recompute_hidden = i < n;
}

// As the reference's initialize_weights: xavier-uniform Linear weights with zero biases; the
// patch projection xavier-uniform as a [hidden, C*p*p] matrix; N(0, 0.02) label table and
// timestep MLP weights; adaLN modulations and the final linear zero (adaLN-Zero: every block
// starts as the identity and the model's output is exactly zero). pos_embed starts at the 2-D
// sin-cos table.
void DiT::initialize_weights(flame::Generator* gen) {
  flame::NoGradGuard no_grad;
  apply([gen](nn::Module& m) {
    if (auto* l = dynamic_cast<nn::Linear*>(&m)) xavier_linear(*l, gen);
  });
  {
    Tensor w = x_embedder->proj->weight(), b = x_embedder->proj->bias();
    const double fan_in = static_cast<double>(w.size(1) * w.size(2) * w.size(3));
    const double fan_out = static_cast<double>(w.size(0));
    const double bound = std::sqrt(6.0 / (fan_in + fan_out));
    nn::init::uniform_(w, -bound, bound, gen);
    nn::init::zeros_(b);
  }
  pos_embed.copy_(sincos_2d_pos_embed(config_.hidden, config_.grid()).unsqueeze(0));
  init_embedders(*t_embedder, *y_embedder, gen);
  for (auto& blk : blocks) zero_linear(*blk->ada_linear);
  zero_linear(*final_layer->ada_linear);
  zero_linear(*final_layer->linear);
}

std::string DiT::extra_repr() const {
  std::ostringstream os;
  os << "preset=" << config_.name << ", hidden=" << config_.hidden << ", depth=" << config_.depth
     << ", heads=" << config_.heads << ", patch=" << config_.patch_size;
  if (config_.recompute != DiTRecompute::none) os << ", recompute=" << dit_recompute_spec_name(recompute_spec());
  return os.str();
}

Tensor DiT::unpatchify(const Tensor& tokens) const {
  const int64_t b = tokens.size(0), p = config_.patch_size, g = config_.grid(), ch = config_.in_channels;
  return tokens.reshape({b, g, g, p, p, ch}).permute({0, 5, 1, 3, 2, 4}).reshape({b, ch, g * p, g * p});
}

Tensor DiT::forward(const Tensor& x, const Tensor& t, const Tensor& y) {
  check_inputs(x, t, y);
  // DiTRecompute::all: the adaLN outputs are kept as recipes by the layers that save them. Only
  // turned on here: an outer guard of the caller stays in force either way.
  std::optional<flame::autograd::RecomputeCheap> recompute_cheap;
  if (config_.recompute == DiTRecompute::all) recompute_cheap.emplace();
  Tensor h = x_embedder->forward(x) + pos_embed;
  Tensor c = t_embedder->forward(t.to(DType::f32) * config_.time_scale) + y_embedder->forward(y);
  // The blocks' and the final layer's forwards, with every residual update fused with the norm
  // that reads it (F::gated_residual_modulate: one kernel on CUDA): the same ops and values as
  // blk->forward(h, c) in turn, then final_layer->forward(h, c).
  flame::TensorList m = blocks.front()->modulation(c);
  Tensor n = F::layer_norm_modulate(h, m[0], m[1], kNormEps);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    DiTBlock& blk = *blocks[i];
    const auto [h1, n2] = F::gated_residual_modulate(h, m[2], blk.attn->forward(n), m[3], m[4], kNormEps);
    const Tensor branch = blk.mlp->forward(n2);
    flame::TensorList next = i + 1 < blocks.size() ? blocks[i + 1]->modulation(c) : final_layer->modulation(c);
    std::tie(h, n) = F::gated_residual_modulate(h1, m[5], branch, next[0], next[1], kNormEps);
    m = std::move(next);
  }
  return unpatchify(final_layer->linear->forward(n));
}

}  // namespace flame_diffusion
