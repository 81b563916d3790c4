#include "models/clip_text.h"

#include <sstream>
#include <utility>

namespace flame_diffusion::models {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;
using flame::Tensor;

// ---------------------------------------------------------------- config

ClipTextConfig ClipTextConfig::preset(const std::string& name) {
  ClipTextConfig c;
  if (name == "clip-l") return c;
  if (name == "clip-g") {
    c.hidden_size = 1280;
    c.intermediate_size = 5120;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 20;
    c.hidden_act = "gelu";
    c.projection_dim = 1280;
    c.family = "clip-g";
    return c;
  }
  FLAME_FAIL("ClipTextConfig", "unknown preset \"", name, "\" (known: clip-l, clip-g)");
}

ClipTextConfig ClipTextConfig::from_json(const JsonConfig& j) {
  ClipTextConfig c;
  c.vocab_size = j.get_int("vocab_size", c.vocab_size);
  c.hidden_size = j.get_int("hidden_size", c.hidden_size);
  c.intermediate_size = j.get_int("intermediate_size", c.intermediate_size);
  c.num_hidden_layers = j.get_int("num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = j.get_int("num_attention_heads", c.num_attention_heads);
  c.max_position_embeddings = j.get_int("max_position_embeddings", c.max_position_embeddings);
  c.hidden_act = j.get_string("hidden_act", c.hidden_act);
  c.layer_norm_eps = j.get_double("layer_norm_eps", c.layer_norm_eps);
  c.projection_dim = j.get_int("projection_dim", c.projection_dim);
  c.eos_token_id = j.get_int("eos_token_id", c.eos_token_id);
  const std::vector<std::string> arch = j.get_strings("architectures", {});
  c.with_projection = !arch.empty() && arch[0] == "CLIPTextModelWithProjection";
  FLAME_CHECK(c.hidden_act == "quick_gelu" || c.hidden_act == "gelu", "config", j.origin(), ": hidden_act \"",
              c.hidden_act, "\" is not one of quick_gelu, gelu (the CLIP text encoders FLAME runs)");
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                                {"intermediate_size", c.intermediate_size},
                                {"max_position_embeddings", c.max_position_embeddings},
                                {"projection_dim", c.projection_dim}}) {
    FLAME_CHECK(v >= 1, "config", j.origin(), ": ", key, " is ", v, "; it must be at least 1");
  }
  FLAME_CHECK(c.num_hidden_layers >= 0, "config", j.origin(), ": num_hidden_layers is ", c.num_hidden_layers,
              "; it must not be negative");
  FLAME_CHECK(c.hidden_size > 0 && c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0, "config",
              j.origin(), ": hidden_size ", c.hidden_size, " is not a multiple of num_attention_heads ",
              c.num_attention_heads);
  c.family = c.hidden_size == 768 && c.num_hidden_layers == 12 ? "clip-l"
             : c.hidden_size == 1280 && c.num_hidden_layers == 32 ? "clip-g"
                                                                  : "custom";
  return c;
}

std::string ClipTextConfig::to_string() const {
  std::ostringstream os;
  os << family << ": vocab " << vocab_size << ", hidden " << hidden_size << ", intermediate " << intermediate_size
     << ", layers " << num_hidden_layers << ", heads " << num_attention_heads << ", positions "
     << max_position_embeddings << ", " << hidden_act << ", eps " << layer_norm_eps << ", eos " << eos_token_id;
  if (with_projection) os << ", projection " << projection_dim;
  return os.str();
}

// ---------------------------------------------------------------- modules

ClipAttention::ClipAttention(const ClipTextConfig& c, flame::TensorOptions opts)
    : heads_(c.num_attention_heads), head_dim_(c.head_dim()) {
  const int64_t d = c.hidden_size;
  q_proj_ = register_module("q_proj", std::make_shared<nn::Linear>(d, d, true, opts));
  k_proj_ = register_module("k_proj", std::make_shared<nn::Linear>(d, d, true, opts));
  v_proj_ = register_module("v_proj", std::make_shared<nn::Linear>(d, d, true, opts));
  out_proj_ = register_module("out_proj", std::make_shared<nn::Linear>(d, d, true, opts));
}

Tensor ClipAttention::attend(const Tensor& x, const Tensor& mask) {
  const int64_t b = x.size(0), l = x.size(1);
  auto heads = [&](const Tensor& t) { return t.view({b, l, heads_, head_dim_}).transpose(1, 2); };
  const Tensor q = heads(q_proj_->forward(x)), k = heads(k_proj_->forward(x)), v = heads(v_proj_->forward(x));
  Tensor o = mask.defined() ? F::scaled_dot_product_attention(q, k, v, mask)
                            : F::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  o = o.transpose(1, 2).reshape({b, l, heads_ * head_dim_});
  return out_proj_->forward(o);
}

ClipMlp::ClipMlp(const ClipTextConfig& c, flame::TensorOptions opts) : quick_gelu_(c.hidden_act == "quick_gelu") {
  fc1_ = register_module("fc1", std::make_shared<nn::Linear>(c.hidden_size, c.intermediate_size, true, opts));
  fc2_ = register_module("fc2", std::make_shared<nn::Linear>(c.intermediate_size, c.hidden_size, true, opts));
}

Tensor ClipMlp::forward(const Tensor& x) {
  Tensor h = fc1_->forward(x);
  h = quick_gelu_ ? h * (h * 1.702).sigmoid() : h.gelu();
  return fc2_->forward(h);
}

ClipEncoderLayer::ClipEncoderLayer(const ClipTextConfig& c, flame::TensorOptions opts) {
  self_attn_ = register_module("self_attn", std::make_shared<ClipAttention>(c, opts));
  layer_norm1_ = register_module("layer_norm1",
                                 std::make_shared<nn::LayerNorm>(c.hidden_size, c.layer_norm_eps, true, true, opts));
  mlp_ = register_module("mlp", std::make_shared<ClipMlp>(c, opts));
  layer_norm2_ = register_module("layer_norm2",
                                 std::make_shared<nn::LayerNorm>(c.hidden_size, c.layer_norm_eps, true, true, opts));
}

Tensor ClipEncoderLayer::run(const Tensor& x, const Tensor& mask) {
  Tensor h = x + self_attn_->attend(layer_norm1_->forward(x), mask);
  return h + mlp_->forward(layer_norm2_->forward(h));
}

namespace {

// text_model.embeddings: token_embedding and position_embedding (transformers' position_ids buffer
// is not persistent and not kept: positions are 0..L-1).
class ClipTextEmbeddings : public nn::Module {
 public:
  ClipTextEmbeddings(const ClipTextConfig& c, flame::TensorOptions opts) {
    token = register_module("token_embedding",
                            std::make_shared<nn::Embedding>(c.vocab_size, c.hidden_size, std::nullopt, opts));
    position = register_module(
        "position_embedding",
        std::make_shared<nn::Embedding>(c.max_position_embeddings, c.hidden_size, std::nullopt, opts));
  }
  std::string name() const override { return "CLIPTextEmbeddings"; }
  std::shared_ptr<nn::Embedding> token, position;
};

}  // namespace

ClipTextTransformer::ClipTextTransformer(const ClipTextConfig& c, flame::TensorOptions opts) : config_(c) {
  auto emb = std::make_shared<ClipTextEmbeddings>(c, opts);
  token_embedding_ = emb->token;
  position_embedding_ = emb->position;
  embeddings_ = register_module("embeddings", emb);
  auto encoder = register_module("encoder", std::make_shared<nn::Module>());
  auto layers = encoder->register_module("layers", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers_.push_back(std::make_shared<ClipEncoderLayer>(c, opts));
    layers->push_back(layers_.back());
  }
  final_layer_norm_ = register_module(
      "final_layer_norm", std::make_shared<nn::LayerNorm>(c.hidden_size, c.layer_norm_eps, true, true, opts));
}

Tensor clip_eos_positions(const Tensor& input_ids, int64_t eos_token_id) {
  FLAME_CHECK(input_ids.dim() == 2, "clip_eos_positions", "ids must be [B, L], got ", input_ids.sizes());
  const Tensor ids = input_ids.to(DType::i32);
  if (eos_token_id == 2) return ids.argmax(-1).to(DType::i64);
  return ids.eq(Tensor::scalar(static_cast<int64_t>(eos_token_id), {DType::i32, ids.device()}))
      .to(DType::i32)
      .argmax(-1)
      .to(DType::i64);
}

ClipTextOutput ClipTextTransformer::run(const Tensor& input_ids, const ClipEncodeOptions& options) {
  const ClipTextConfig& c = config_;
  FLAME_CHECK(input_ids.dim() == 2 && !flame::is_floating(input_ids.dtype()), "ClipTextModel",
              "input_ids must be an integer tensor [B, L], got ", input_ids.dtype(), " ", input_ids.sizes());
  const int64_t b = input_ids.size(0), l = input_ids.size(1);
  FLAME_CHECK(l >= 1 && l <= c.max_position_embeddings, "ClipTextModel", "sequence length ", l,
              " is outside 1..", c.max_position_embeddings, " (max_position_embeddings): tokenize to at most ",
              c.max_position_embeddings, " tokens");
  const flame::Device dev = token_embedding_->weight().device();
  const Tensor ids = input_ids.to(DType::i64, dev);
  Tensor mask;
  if (options.attention_mask.defined()) {
    FLAME_CHECK(options.attention_mask.sizes() == input_ids.sizes(), "ClipTextModel", "attention_mask ",
                options.attention_mask.sizes(), " must have the ids' shape ", input_ids.sizes());
    const Tensor keys = options.attention_mask.to(dev).ne(Tensor::scalar(0, {options.attention_mask.dtype(), dev}));
    const Tensor pos = Tensor::arange(l, {DType::i64, dev});
    const Tensor causal = pos.view({l, 1}).ge(pos.view({1, l}));  // key j <= query i
    mask = flame::logical_and(causal.view({1, 1, l, l}), keys.view({b, 1, 1, l}));
  }
  const Tensor positions = Tensor::arange(l, {DType::i64, dev});
  Tensor h = token_embedding_->forward(ids) + position_embedding_->forward(positions).unsqueeze(0);
  ClipTextOutput out;
  if (options.output_hidden_states) out.hidden_states.push_back(h);
  for (const auto& layer : layers_) {
    h = layer->run(h, mask);
    if (options.output_hidden_states) out.hidden_states.push_back(h);
  }
  out.last_hidden_state = final_layer_norm_->forward(h);
  const Tensor eos = clip_eos_positions(ids, c.eos_token_id);
  const Tensor rows = Tensor::arange(b, {DType::i64, dev}) * l + eos;
  out.pooled = out.last_hidden_state.reshape({b * l, c.hidden_size}).index_select(0, rows);
  return out;
}

ClipTextModel::ClipTextModel(const ClipTextConfig& config, flame::TensorOptions opts) : config_(config) {
  FLAME_CHECK(config.hidden_size > 0 && config.num_attention_heads > 0 &&
                  config.hidden_size % config.num_attention_heads == 0,
              "ClipTextModel", "hidden_size ", config.hidden_size, " is not a multiple of num_attention_heads ",
              config.num_attention_heads);
  FLAME_CHECK(config.hidden_act == "quick_gelu" || config.hidden_act == "gelu", "ClipTextModel", "hidden_act \"",
              config.hidden_act, "\" is not one of quick_gelu, gelu");
  text_model_ = register_module("text_model", std::make_shared<ClipTextTransformer>(config, opts));
  if (config.with_projection)
    text_projection_ = register_module(
        "text_projection", std::make_shared<nn::Linear>(config.hidden_size, config.projection_dim, false, opts));
}

DType ClipTextModel::dtype() const { return text_projection_ ? text_projection_->weight().dtype() : parameters()[0].dtype(); }
flame::Device ClipTextModel::device() const { return parameters()[0].device(); }

ClipTextOutput ClipTextModel::encode(const Tensor& input_ids, const ClipEncodeOptions& options) {
  ClipTextOutput out = text_model_->run(input_ids, options);
  if (text_projection_) out.text_embeds = text_projection_->forward(out.pooled);
  return out;
}

Tensor ClipTextModel::forward(const Tensor& input_ids) { return encode(input_ids).last_hidden_state; }

}  // namespace flame_diffusion::models
