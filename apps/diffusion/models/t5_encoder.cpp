#include "models/t5_encoder.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

namespace flame_diffusion::models {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;
using flame::Tensor;

// ---------------------------------------------------------------- config

T5EncoderConfig T5EncoderConfig::preset(const std::string& name) {
  FLAME_CHECK(name == "t5-xxl", "T5EncoderConfig", "unknown preset \"", name, "\" (known: t5-xxl)");
  return T5EncoderConfig{};
}

T5EncoderConfig T5EncoderConfig::from_json(const JsonConfig& j) {
  T5EncoderConfig c;
  c.vocab_size = j.get_int("vocab_size", c.vocab_size);
  c.d_model = j.get_int("d_model", c.d_model);
  c.d_kv = j.get_int("d_kv", c.d_kv);
  c.d_ff = j.get_int("d_ff", c.d_ff);
  c.num_layers = j.get_int("num_layers", c.num_layers);
  c.num_heads = j.get_int("num_heads", c.num_heads);
  c.relative_attention_num_buckets = j.get_int("relative_attention_num_buckets", c.relative_attention_num_buckets);
  c.relative_attention_max_distance = j.get_int("relative_attention_max_distance", c.relative_attention_max_distance);
  c.feed_forward_proj = j.get_string("feed_forward_proj", c.feed_forward_proj);
  c.layer_norm_epsilon = j.get_double("layer_norm_epsilon", c.layer_norm_epsilon);
  FLAME_CHECK(c.feed_forward_proj == "gated-gelu", "config", j.origin(), ": feed_forward_proj \"", c.feed_forward_proj,
              "\" is not gated-gelu (FLAME runs the T5 v1.1 encoder; T5 v1.0's relu feed-forward is not implemented)");
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                                {"d_model", c.d_model},
                                {"d_kv", c.d_kv},
                                {"d_ff", c.d_ff},
                                {"num_layers", c.num_layers},
                                {"num_heads", c.num_heads}}) {
    FLAME_CHECK(v >= 1, "config", j.origin(), ": ", key, " is ", v, "; it must be at least 1");
  }
  FLAME_CHECK(c.relative_attention_num_buckets >= 4 && c.relative_attention_max_distance > c.relative_attention_num_buckets / 4,
              "config", j.origin(), ": relative_attention_num_buckets ", c.relative_attention_num_buckets,
              " / relative_attention_max_distance ", c.relative_attention_max_distance, " do not define buckets");
  const T5EncoderConfig xxl;
  c.family = (c.d_model == xxl.d_model && c.num_layers == xxl.num_layers && c.d_ff == xxl.d_ff) ? "t5-xxl" : "custom";
  return c;
}

std::string T5EncoderConfig::to_string() const {
  std::ostringstream os;
  os << family << ": vocab " << vocab_size << ", d_model " << d_model << ", d_kv " << d_kv << ", d_ff " << d_ff
     << ", layers " << num_layers << ", heads " << num_heads << ", buckets " << relative_attention_num_buckets
     << ", max distance " << relative_attention_max_distance << ", " << feed_forward_proj << ", eps "
     << layer_norm_epsilon;
  return os.str();
}

// ---------------------------------------------------------------- functions

Tensor t5_relative_position_buckets(int64_t query_length, int64_t key_length, int64_t num_buckets,
                                    int64_t max_distance, flame::Device device) {
  const int64_t half = num_buckets / 2, max_exact = half / 2;
  // transformers computes the large-distance bucket in f32: log(d / max_exact) / log(max_distance /
  // max_exact) * (half - max_exact), truncated.
  const float log_ratio = static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
  std::vector<int64_t> out(static_cast<std::size_t>(query_length * key_length));
  for (int64_t i = 0; i < query_length; ++i) {
    for (int64_t j = 0; j < key_length; ++j) {
      const int64_t rel = j - i;  // memory position - query position
      int64_t bucket = rel > 0 ? half : 0;
      const int64_t d = rel < 0 ? -rel : rel;
      if (d < max_exact) {
        bucket += d;
      } else {
        const float f = std::log(static_cast<float>(d) / static_cast<float>(max_exact)) / log_ratio *
                        static_cast<float>(half - max_exact);
        bucket += std::min<int64_t>(max_exact + static_cast<int64_t>(f), half - 1);
      }
      out[static_cast<std::size_t>(i * key_length + j)] = bucket;
    }
  }
  return Tensor::from_vec(out, {query_length, key_length}, device);
}

Tensor t5_layer_norm(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor variance = x.to(DType::f32).pow(2).mean({-1}, true);
  Tensor h = x * (variance + eps).rsqrt();
  if (weight.dtype() == DType::f16 || weight.dtype() == DType::bf16) h = h.to(weight.dtype());
  return weight * h;
}

namespace {

// transformers' fp16 clamp: +-(max - 1000) when the states hold an inf, else +-max.
Tensor clamp_f16(const Tensor& h) {
  if (h.dtype() != DType::f16) return h;
  const double big = 65504.0;
  const double v = h.isinf().any().item<bool>() ? big - 1000.0 : big;
  return h.clamp(-v, v);
}

// A holder of one T5LayerNorm weight ("layer_norm.weight", "final_layer_norm.weight").
class T5LayerNormModule : public nn::Module {
 public:
  T5LayerNormModule(int64_t d, flame::TensorOptions opts) {
    weight = register_parameter("weight", Tensor::ones({d}, opts));
  }
  std::string name() const override { return "T5LayerNorm"; }
  Tensor weight;
};

}  // namespace

// ---------------------------------------------------------------- modules

T5Attention::T5Attention(const T5EncoderConfig& c, bool has_relative_attention_bias, flame::TensorOptions opts)
    : heads_(c.num_heads),
      d_kv_(c.d_kv),
      buckets_(c.relative_attention_num_buckets),
      max_distance_(c.relative_attention_max_distance) {
  const int64_t inner = c.num_heads * c.d_kv;
  q_ = register_module("q", std::make_shared<nn::Linear>(c.d_model, inner, false, opts));
  k_ = register_module("k", std::make_shared<nn::Linear>(c.d_model, inner, false, opts));
  v_ = register_module("v", std::make_shared<nn::Linear>(c.d_model, inner, false, opts));
  o_ = register_module("o", std::make_shared<nn::Linear>(inner, c.d_model, false, opts));
  if (has_relative_attention_bias)
    relative_attention_bias_ = register_module(
        "relative_attention_bias", std::make_shared<nn::Embedding>(buckets_, heads_, std::nullopt, opts));
}

Tensor T5Attention::position_bias(int64_t length) const {
  FLAME_CHECK(relative_attention_bias_ != nullptr, "T5Attention", "only block 0 holds the relative attention bias");
  const Tensor& table = relative_attention_bias_->weight();
  if (!buckets_cache_.defined() || buckets_cache_.size(0) != length || buckets_cache_.device() != table.device())
    buckets_cache_ = t5_relative_position_buckets(length, length, buckets_, max_distance_, table.device());
  return F::embedding(buckets_cache_, table).permute({2, 0, 1}).unsqueeze(0).contiguous();  // [1, H, L, L]
}

Tensor T5Attention::attend(const Tensor& x, const Tensor& mask) {
  const int64_t b = x.size(0), l = x.size(1);
  auto heads = [&](const Tensor& t) { return t.view({b, l, heads_, d_kv_}).transpose(1, 2); };
  const Tensor q = heads(q_->forward(x)), k = heads(k_->forward(x)), v = heads(v_->forward(x));
  Tensor o = F::scaled_dot_product_attention(q, k, v, mask.to(q.dtype()), 0.0, false, /*scale=*/1.0);
  return o_->forward(o.transpose(1, 2).reshape({b, l, heads_ * d_kv_}));
}

T5Block::T5Block(const T5EncoderConfig& c, bool has_relative_attention_bias, flame::TensorOptions opts)
    : eps_(c.layer_norm_epsilon) {
  auto layer = register_module("layer", std::make_shared<nn::ModuleList>());
  auto self_attention = std::make_shared<nn::Module>();
  attention_ = self_attention->register_module("SelfAttention",
                                               std::make_shared<T5Attention>(c, has_relative_attention_bias, opts));
  attn_norm_ = self_attention->register_module("layer_norm", std::make_shared<T5LayerNormModule>(c.d_model, opts))->weight;
  auto ff = std::make_shared<nn::Module>();
  auto dense = ff->register_module("DenseReluDense", std::make_shared<nn::Module>());
  wi_0_ = dense->register_module("wi_0", std::make_shared<nn::Linear>(c.d_model, c.d_ff, false, opts));
  wi_1_ = dense->register_module("wi_1", std::make_shared<nn::Linear>(c.d_model, c.d_ff, false, opts));
  // Note [T5 encoder]: an f16 model keeps wo in f32, as transformers' _keep_in_fp32_modules.
  flame::TensorOptions wo_opts = opts;
  if (opts.dtype == DType::f16) wo_opts.dtype = DType::f32;
  wo_ = dense->register_module("wo", std::make_shared<nn::Linear>(c.d_ff, c.d_model, false, wo_opts));
  ff_norm_ = ff->register_module("layer_norm", std::make_shared<T5LayerNormModule>(c.d_model, opts))->weight;
  layer->push_back(self_attention);
  layer->push_back(ff);
}

Tensor T5Block::run(const Tensor& h_in, const Tensor& mask) {
  Tensor h = clamp_f16(h_in + attention_->attend(t5_layer_norm(h_in, attn_norm_, eps_), mask));
  const Tensor n = t5_layer_norm(h, ff_norm_, eps_);
  Tensor g = wi_0_->forward(n).gelu(/*tanh_approximation=*/true) * wi_1_->forward(n);
  if (g.dtype() != wo_->weight().dtype()) g = g.to(wo_->weight().dtype());
  return clamp_f16(h + wo_->forward(g));
}

T5EncoderModel::T5EncoderModel(const T5EncoderConfig& config, flame::TensorOptions opts) : config_(config) {
  FLAME_CHECK(config.feed_forward_proj == "gated-gelu", "T5EncoderModel", "feed_forward_proj \"",
              config.feed_forward_proj, "\" is not gated-gelu");
  FLAME_CHECK(config.num_layers >= 1 && config.num_heads >= 1 && config.d_kv >= 1, "T5EncoderModel",
              "num_layers, num_heads and d_kv must be positive (", config.to_string(), ")");
  // Note [T5 encoder]: the logarithmic buckets divide by num_buckets / 4.
  FLAME_CHECK(config.relative_attention_num_buckets >= 4 &&
                  config.relative_attention_max_distance > config.relative_attention_num_buckets / 4,
              "T5EncoderModel", "relative_attention_num_buckets must be >= 4 and relative_attention_max_distance above "
              "a quarter of it (", config.to_string(), ")");
  shared_ = register_module("shared", std::make_shared<nn::Embedding>(config.vocab_size, config.d_model, std::nullopt, opts));
  auto encoder = register_module("encoder", std::make_shared<nn::Module>());
  auto block = encoder->register_module("block", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < config.num_layers; ++i) {
    blocks_.push_back(std::make_shared<T5Block>(config, i == 0, opts));
    block->push_back(blocks_.back());
  }
  final_norm_ =
      encoder->register_module("final_layer_norm", std::make_shared<T5LayerNormModule>(config.d_model, opts))->weight;
}

DType T5EncoderModel::dtype() const { return shared_->weight().dtype(); }
flame::Device T5EncoderModel::device() const { return shared_->weight().device(); }

Tensor T5EncoderModel::encode(const Tensor& input_ids, const Tensor& attention_mask) {
  FLAME_CHECK(input_ids.dim() == 2 && !flame::is_floating(input_ids.dtype()), "T5EncoderModel",
              "input_ids must be an integer tensor [B, L], got ", input_ids.dtype(), " ", input_ids.sizes());
  const int64_t b = input_ids.size(0), l = input_ids.size(1);
  FLAME_CHECK(l >= 1, "T5EncoderModel", "input_ids are empty: ", input_ids.sizes());
  const flame::Device dev = device();
  const Tensor ids = input_ids.to(DType::i64, dev);
  Tensor mask = blocks_[0]->attention()->position_bias(l);  // [1, H, L, L] in the table's dtype
  if (attention_mask.defined()) {
    FLAME_CHECK(attention_mask.sizes() == input_ids.sizes(), "T5EncoderModel", "attention_mask ",
                attention_mask.sizes(), " must have the ids' shape ", input_ids.sizes());
    // Padded keys get the dtype's lowest value (transformers' extended mask), added in the bias's
    // dtype as transformers adds them to the scores ([B, H, L, L]: 0.5 GiB in bf16 at 16 x 512).
    const double lowest = mask.dtype() == DType::bf16  ? -3.3895313892515355e38
                          : mask.dtype() == DType::f16 ? -65504.0
                                                       : static_cast<double>(std::numeric_limits<float>::lowest());
    const Tensor keep = attention_mask.to(dev).ne(Tensor::scalar(0, {attention_mask.dtype(), dev}));
    const Tensor pad =
        Tensor::zeros({b, 1, 1, l}, {mask.dtype(), dev}).masked_fill(keep.view({b, 1, 1, l}).logical_not(), lowest);
    mask = mask + pad;
  }
  Tensor h = shared_->forward(ids);
  for (const auto& block : blocks_) h = block->run(h, mask);
  return t5_layer_norm(h, final_norm_, config_.layer_norm_epsilon);
}

}  // namespace flame_diffusion::models
