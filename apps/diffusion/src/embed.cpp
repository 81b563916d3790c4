#include "embed.h"

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "dit.h"
#include "unet.h"

namespace flame_diffusion {

namespace nn = flame::nn;
using flame::DType;

namespace {
// The frequency row on `device`, uploaded once per (half, max_period, device) and kept: an upload
// per call would wait on pinned staging and cannot be captured into a CUDA graph (--compile).
Tensor frequency_table(const std::vector<float>& freqs, int64_t half, double max_period, const flame::Device& device) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, double, int, int>, Tensor> cache;
  const auto key = std::make_tuple(half, max_period, static_cast<int>(device.type), device.index);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, Tensor::from_vec(freqs, {1, half}, device)).first;
  return it->second;
}
}  // namespace

Tensor timestep_embedding(const Tensor& t, int64_t dim, double max_period) {
  FLAME_CHECK(t.dim() == 1, "timestep_embedding", "t must be [B], got ", t.sizes());
  FLAME_CHECK(dim >= 2, "timestep_embedding", "dim must be >= 2, got ", dim);
  const int64_t half = dim / 2;
  // f32 arithmetic in the order PyTorch's reference evaluates it, so the twins' tables agree to
  // the last bit or two: exp(-(float)log(max_period) * i / half).
  std::vector<float> freqs(static_cast<std::size_t>(half));
  const float neg_log = static_cast<float>(-std::log(max_period));
  for (int64_t i = 0; i < half; ++i) {
    freqs[static_cast<std::size_t>(i)] = std::exp(neg_log * static_cast<float>(i) / static_cast<float>(half));
  }
  Tensor f = frequency_table(freqs, half, max_period, t.device());
  Tensor args = t.to(DType::f32).unsqueeze(1) * f;  // [B, half]
  Tensor emb = flame::cat({args.cos(), args.sin()}, 1);
  if (dim % 2) emb = flame::cat({emb, Tensor::zeros({t.size(0), 1}, {DType::f32, t.device()})}, 1);
  return emb;
}

Tensor sincos_2d_pos_embed(int64_t dim, int64_t grid_size) {
  FLAME_CHECK(dim % 4 == 0, "sincos_2d_pos_embed", "dim must be divisible by 4, got ", dim);
  FLAME_CHECK(grid_size > 0, "sincos_2d_pos_embed", "grid_size must be positive, got ", grid_size);
  const int64_t quarter = dim / 4;
  std::vector<double> omega(static_cast<std::size_t>(quarter));
  for (int64_t k = 0; k < quarter; ++k) {
    omega[static_cast<std::size_t>(k)] = 1.0 / std::pow(10000.0, static_cast<double>(k) / static_cast<double>(quarter));
  }
  std::vector<float> table(static_cast<std::size_t>(grid_size * grid_size * dim));
  for (int64_t r = 0; r < grid_size; ++r) {
    for (int64_t c = 0; c < grid_size; ++c) {
      float* row = table.data() + (r * grid_size + c) * dim;
      // MAE's meshgrid(w, h) puts the column coordinate in the first half.
      const double pos[2] = {static_cast<double>(c), static_cast<double>(r)};
      for (int h = 0; h < 2; ++h) {
        for (int64_t k = 0; k < quarter; ++k) {
          const double a = pos[h] * omega[static_cast<std::size_t>(k)];
          row[h * 2 * quarter + k] = static_cast<float>(std::sin(a));
          row[h * 2 * quarter + quarter + k] = static_cast<float>(std::cos(a));
        }
      }
    }
  }
  return Tensor::from_vec(table, {grid_size * grid_size, dim});
}

TimestepEmbedder::TimestepEmbedder(int64_t hidden, int64_t frequency_dim) : frequency_dim_(frequency_dim) {
  fc1 = std::make_shared<nn::Linear>(frequency_dim, hidden);
  fc2 = std::make_shared<nn::Linear>(hidden, hidden);
  mlp_ = register_module("mlp", std::make_shared<nn::Sequential>(
                                    std::initializer_list<nn::ModulePtr>{fc1, std::make_shared<nn::SiLU>(), fc2}));
}

Tensor TimestepEmbedder::forward(const Tensor& t) {
  // The table is computed in f32; a model converted to another dtype gets it in its own.
  return mlp_->forward(timestep_embedding(t, frequency_dim_).to(fc1->weight().dtype()));
}

LabelEmbedder::LabelEmbedder(int64_t num_classes, int64_t hidden) : num_classes_(num_classes) {
  embedding_table = register_module("embedding_table", std::make_shared<nn::Embedding>(num_classes + 1, hidden));
}

Tensor LabelEmbedder::forward(const Tensor& labels) { return embedding_table->forward(labels); }

Tensor drop_labels(const Tensor& labels, double p, int64_t null_class, flame::Generator* gen) {
  FLAME_CHECK(labels.dim() == 1, "drop_labels", "labels must be [B], got ", labels.sizes());
  FLAME_CHECK(p >= 0.0 && p <= 1.0, "drop_labels", "probability must be in [0, 1], got ", p);
  if (p == 0.0) return labels;
  Tensor u = Tensor::rand(labels.sizes(), {DType::f32, labels.device()}, gen);
  Tensor drop = u.lt(Tensor::scalar(p, {DType::f32, labels.device()}));
  return flame::where(drop, Tensor::full(labels.sizes(), null_class, {labels.dtype(), labels.device()}), labels);
}

void init_embedders(TimestepEmbedder& t, LabelEmbedder& y, flame::Generator* gen) {
  Tensor table = y.embedding_table->weight();
  nn::init::normal_(table, 0.0, 0.02, gen);
  for (const auto& fc : {t.fc1, t.fc2}) {
    Tensor w = fc->weight(), b = fc->bias();
    nn::init::normal_(w, 0.0, 0.02, gen);
    nn::init::zeros_(b);
  }
}

void DiffusionModel::check_inputs(const Tensor& x, const Tensor& t, const Tensor& y) const {
  const std::string who = preset();
  FLAME_CHECK(x.defined() && t.defined() && y.defined(), who.c_str(), "x, t and y must all be given");
  FLAME_CHECK(x.dim() == 4 && x.size(1) == in_channels() && x.size(2) == image_size() && x.size(3) == image_size(),
              who.c_str(), "x must be [B, ", in_channels(), ", ", image_size(), ", ", image_size(), "], got ",
              x.sizes());
  FLAME_CHECK(flame::is_floating(x.dtype()), who.c_str(), "x must be floating, got ", flame::dtype_name(x.dtype()));
  const int64_t b = x.size(0);
  FLAME_CHECK(t.dim() == 1 && t.size(0) == b, who.c_str(), "t must be [", b, "], got ", t.sizes());
  FLAME_CHECK(flame::is_floating(t.dtype()), who.c_str(), "t must be floating (in [0, 1]), got ",
              flame::dtype_name(t.dtype()));
  FLAME_CHECK(y.dim() == 1 && y.size(0) == b, who.c_str(), "y must be [", b, "], got ", y.sizes());
  FLAME_CHECK(y.dtype() == DType::i64, who.c_str(), "y must be an i64 label tensor, got ", flame::dtype_name(y.dtype()));
  // The range check reads the labels, which synchronises: only on the CPU (a GPU caller's labels
  // come from the checked loader or from sample requests validated on the host).
  if (y.device().is_cpu() && b > 0) {
    const int64_t lo = y.min().item<int64_t>(), hi = y.max().item<int64_t>();
    FLAME_CHECK(lo >= 0 && hi <= num_classes(), who.c_str(), "labels must be in [0, ", num_classes(),
                "] (", num_classes(), " = null class), got values in [", lo, ", ", hi, "]");
  }
}

std::shared_ptr<DiffusionModel> make_model(const std::string& preset, uint64_t seed) {
  if (preset.rfind("dit-", 0) == 0) return std::make_shared<DiT>(dit_config(preset), seed);
  if (preset.rfind("unet-", 0) == 0) return std::make_shared<UNet>(unet_config(preset), seed);
  FLAME_FAIL("make_model", "unknown model '", preset, "' (known: ", model_presets(), ")");
}

std::string model_presets() { return "dit-tiny, dit-s, dit-b, unet-tiny, unet-s"; }

}  // namespace flame_diffusion
