// Fashion-MNIST loading, and the batch loader over flame::data::DataLoader (data.h).
#include "data.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace flame_diffusion {
namespace {

constexpr const char* kDebianDir = "/usr/share/datasets/fashion-mnist";

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// <dir>/<name>.gz when present, else <dir>/<name>; "" when neither is.
std::string find_file(const std::string& dir, const std::string& name) {
  const std::string base = dir + "/" + name;
  if (file_exists(base + ".gz")) return base + ".gz";
  if (file_exists(base)) return base;
  return "";
}

bool has_files(const std::string& dir) { return !find_file(dir, "train-images-idx3-ubyte").empty(); }

Dataset filter(const Dataset& d, const std::vector<int>& classes, bool keep) {
  for (int c : classes) {
    if (c < 0 || c > 9) throw std::runtime_error("class filter: class " + std::to_string(c) + " is not in 0..9");
  }
  Dataset out;
  out.rows = d.rows;
  out.cols = d.cols;
  const int64_t sz = d.image_size();
  for (int64_t i = 0; i < d.n; ++i) {
    const bool in = std::find(classes.begin(), classes.end(), int{d.labels[i]}) != classes.end();
    if (in != keep) continue;
    out.labels.push_back(d.labels[i]);
    out.images.insert(out.images.end(), d.images.begin() + i * sz, d.images.begin() + (i + 1) * sz);
  }
  out.n = static_cast<int64_t>(out.labels.size());
  return out;
}

}  // namespace

const std::vector<std::string>& fashion_mnist_class_names() {
  static const std::vector<std::string> names = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                                 "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return names;
}

std::string find_data_dir(const std::string& flag_dir) {
  if (!flag_dir.empty()) {
    if (!has_files(flag_dir)) {
      throw std::runtime_error("--data " + flag_dir + ": no train-images-idx3-ubyte[.gz] there");
    }
    return flag_dir;
  }
  if (const char* env = std::getenv("FLAME_FASHION_MNIST"); env != nullptr && *env != '\0') {
    if (!has_files(env)) {
      throw std::runtime_error(std::string("FLAME_FASHION_MNIST=") + env + ": no train-images-idx3-ubyte[.gz] there");
    }
    return env;
  }
  std::vector<std::string> tried = {kDebianDir, ".deps/fashion_mnist"};
#ifdef FLAME_DIFFUSION_DEPS_DIR
  tried.push_back(std::string(FLAME_DIFFUSION_DEPS_DIR) + "/fashion_mnist");
#endif
  for (const std::string& dir : tried) {
    if (has_files(dir)) return dir;
  }
  std::ostringstream os;
  os << "Fashion-MNIST not found: install the Debian package dataset-fashion-mnist (scripts/setup_deps.sh), "
        "or pass --data DIR or set FLAME_FASHION_MNIST to a folder with train-images-idx3-ubyte[.gz]. Looked in:";
  for (const std::string& dir : tried) os << " " << dir;
  throw std::runtime_error(os.str());
}

Dataset Dataset::from_idx(flame::data::IdxArray images, flame::data::IdxArray labels, const std::string& source) {
  using flame::data::IdxError;
  if (images.dims.size() != 3) {
    throw IdxError(source + ": images have " + std::to_string(images.dims.size()) + " dimensions, expected 3");
  }
  if (labels.dims.size() != 1) {
    throw IdxError(source + ": labels have " + std::to_string(labels.dims.size()) + " dimensions, expected 1");
  }
  if (images.dims[0] != labels.dims[0]) {
    throw IdxError(source + ": " + std::to_string(images.dims[0]) + " images but " + std::to_string(labels.dims[0]) +
                   " labels");
  }
  for (std::size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] > 9) {
      throw IdxError(source + ": label " + std::to_string(labels.data[i]) + " at index " + std::to_string(i) +
                     " is not a class in 0..9");
    }
  }
  Dataset d;
  d.n = images.dims[0];
  d.rows = images.dims[1];
  d.cols = images.dims[2];
  d.images = std::move(images.data);
  d.labels = std::move(labels.data);
  return d;
}

Dataset Dataset::load(const std::string& dir, Split split) {
  const std::string prefix = split == Split::train ? "train" : "t10k";
  const std::string img = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string lab = find_file(dir, prefix + "-labels-idx1-ubyte");
  if (img.empty() || lab.empty()) {
    throw std::runtime_error("Fashion-MNIST in " + dir + ": missing " + prefix + "-" +
                             (img.empty() ? "images-idx3" : "labels-idx1") + "-ubyte[.gz]");
  }
  return from_idx(flame::data::read_idx(img, 3), flame::data::read_idx(lab, 1), img + " + " + lab);
}

Dataset Dataset::select_classes(const std::vector<int>& classes) const { return filter(*this, classes, true); }
Dataset Dataset::exclude_classes(const std::vector<int>& classes) const { return filter(*this, classes, false); }

std::vector<int64_t> Dataset::class_counts() const {
  std::vector<int64_t> counts(10, 0);
  for (uint8_t l : labels) ++counts[l];
  return counts;
}

// ---------------------------------------------------------------------------------------------
// Loader

namespace {

// Which samples of a batch are flipped: one draw of HostRng(info.seed) each (Note [Loader
// determinism] in flame/data/loader.h).
std::vector<uint8_t> flips_of(const flame::data::BatchInfo& info, bool random_flip) {
  std::vector<uint8_t> flipped(info.indices.size(), 0);
  if (!random_flip) return flipped;
  flame::HostRng rng(info.seed);
  for (auto& f : flipped) f = static_cast<uint8_t>(rng.next() >> 63);
  return flipped;
}

// Mirrors the flipped images of a host batch [B, 1, rows, cols] in place.
void flip_rows(flame::Tensor& images, const std::vector<uint8_t>& flipped) {
  const int64_t rows = images.size(2), cols = images.size(3);
  float* px = images.data<float>();
  for (std::size_t k = 0; k < flipped.size(); ++k) {
    if (!flipped[k]) continue;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = px + (static_cast<int64_t>(k) * rows + r) * cols;
      std::reverse(row, row + cols);
    }
  }
}

}  // namespace

FashionMnistDataset::FashionMnistDataset(std::shared_ptr<const flame_diffusion::Dataset> data) : data_(std::move(data)) {
  if (!data_) throw std::runtime_error("FashionMnistDataset: no data set");
}

flame::data::Example FashionMnistDataset::get(int64_t index) const {
  const flame_diffusion::Dataset& d = *data_;
  flame::Tensor image = flame::Tensor::empty({1, d.rows, d.cols}, flame::DType::f32);
  const uint8_t* src = d.images.data() + index * d.image_size();
  float* dst = image.data<float>();
  // [0, 255] -> [-1, 1]: x / 127.5 - 1.
  for (int64_t i = 0; i < d.image_size(); ++i) dst[i] = static_cast<float>(src[i]) / 127.5f - 1.0f;
  return {std::move(image), flame::Tensor::scalar(static_cast<int64_t>(d.labels[index]), flame::DType::i64)};
}

Loader::Loader(std::shared_ptr<const Dataset> data, const LoaderOptions& options, LoaderPosition start)
    : data_(std::move(data)), options_(options) {
  if (!data_) throw std::runtime_error("Loader: no data set");
  if (options_.batch_size <= 0) {
    throw std::runtime_error("Loader: batch size " + std::to_string(options_.batch_size) + " must be positive");
  }
  if (options_.prefetch < 0) throw std::runtime_error("Loader: prefetch " + std::to_string(options_.prefetch) + " < 0");
  if (data_->images.size() != static_cast<std::size_t>(data_->n * data_->image_size()) ||
      data_->labels.size() != static_cast<std::size_t>(data_->n)) {
    throw std::runtime_error("Loader: inconsistent data set (" + std::to_string(data_->n) + " samples)");
  }
  flame::data::DataLoaderOptions o;
  o.batch_size = options_.batch_size;
  o.shuffle = options_.shuffle;
  o.seed = options_.seed;
  o.drop_last = options_.drop_last;
  if (options_.sampler) o.sampler = std::make_shared<const flame::data::DistributedSampler>(*options_.sampler);
  o.num_workers = options_.prefetch > 0 ? 1 : 0;
  o.prefetch_factor = std::max(options_.prefetch, 1);
  o.device = options_.device;
  flame::data::DataLoader<>::Transform transform;
  if (options_.random_flip || options_.host_transform) {
    transform = [flip = options_.random_flip, user = options_.host_transform](flame::data::Example& b,
                                                                              const flame::data::BatchInfo& info) {
      if (flip) flip_rows(b.data, flips_of(info, true));
      if (user) user(b.data, b.target, LoaderPosition{info.epoch, info.batch});
    };
  }
  loader_ = std::make_unique<flame::data::DataLoader<>>(std::make_shared<const FashionMnistDataset>(data_), o,
                                                        flame::data::DataLoader<>::Collate{}, std::move(transform));
  const int64_t epoch_size = loader_->sampler().num_samples();
  if (loader_->batches_per_epoch() == 0) {
    throw std::runtime_error("Loader: a data set of " + std::to_string(epoch_size) + " samples gives no batch of " +
                             std::to_string(options_.batch_size) + (options_.drop_last ? " with drop_last" : ""));
  }
  if (start.epoch < 0 || start.batch < 0 || start.batch >= loader_->batches_per_epoch()) {
    throw std::runtime_error("Loader: start position (epoch " + std::to_string(start.epoch) + ", batch " +
                             std::to_string(start.batch) + ") is outside an epoch of " +
                             std::to_string(loader_->batches_per_epoch()) + " batches");
  }
  loader_->load_state({start.epoch, start.batch, options_.seed});
}

LoaderPosition Loader::position() const {
  const flame::data::LoaderState s = loader_->state();
  return {s.epoch, s.batch};
}

std::vector<int64_t> Loader::epoch_order(int64_t epoch) const { return loader_->sampler().indices(epoch); }

Batch Loader::next() {
  const LoaderPosition pos = position();
  flame::data::Example e = loader_->next();
  flame::data::BatchInfo info = loader_->batch_info(pos.epoch, pos.batch);
  Batch b;
  b.images = std::move(e.data);
  b.labels = std::move(e.target);
  b.position = pos;
  b.flipped = flips_of(info, options_.random_flip);
  b.indices = std::move(info.indices);
  return b;
}

}  // namespace flame_diffusion
