// Fashion-MNIST loading and the batch loader (Notes [Loader determinism] and [Loader prefetch] in
// data.h).
#include "data.h"

#include <flame/offload.h>

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

// splitmix64: turns (seed, epoch, batch) into well-mixed generator seeds.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t mix(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b + 0x632be59bd9b4e019ULL)); }

// xoshiro256**: a small generator whose output is the same on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& w : s_) w = seed = splitmix64(seed);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, n), n > 0, without modulo bias (rejection of the top partial range).
  uint64_t below(uint64_t n) {
    const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % n);
    uint64_t x;
    do {
      x = next();
    } while (x >= limit);
    return x % n;
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// Where a batch's host tensors are assembled (Note [Loader prefetch]): in pinned memory when the
// batch goes to a GPU, so that its upload is one asynchronous copy on the upload stream (the
// pinned block is reused only after that copy has run).
flame::Tensor host_buffer(const flame::Shape& shape, flame::DType dtype, bool pinned) {
  return pinned ? flame::offload::empty_pinned(shape, dtype) : flame::Tensor::empty(shape, dtype);
}

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

Dataset Dataset::from_idx(IdxArray images, IdxArray labels, const std::string& source) {
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
  return from_idx(read_idx(img, 3), read_idx(lab, 1), img + " + " + lab);
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

struct Loader::Pending {
  flame::Tensor images, labels;
  LoaderPosition position;
  std::vector<int64_t> indices;
  std::vector<uint8_t> flipped;
  std::optional<flame::cuda::Event> uploaded;  // CUDA: recorded on the upload stream
};

Loader::Loader(std::shared_ptr<const Dataset> data, LoaderOptions options, LoaderPosition start)
    : data_(std::move(data)), options_(options), position_(start) {
  if (!data_) throw std::runtime_error("Loader: no data set");
  if (options_.batch_size <= 0) {
    throw std::runtime_error("Loader: batch size " + std::to_string(options_.batch_size) + " must be positive");
  }
  if (options_.prefetch < 0) throw std::runtime_error("Loader: prefetch " + std::to_string(options_.prefetch) + " < 0");
  if (data_->images.size() != static_cast<std::size_t>(data_->n * data_->image_size()) ||
      data_->labels.size() != static_cast<std::size_t>(data_->n)) {
    throw std::runtime_error("Loader: inconsistent data set (" + std::to_string(data_->n) + " samples)");
  }
  const int64_t epoch_size = options_.sampler ? options_.sampler->num_samples() : data_->n;
  batches_per_epoch_ = options_.drop_last ? epoch_size / options_.batch_size
                                          : (epoch_size + options_.batch_size - 1) / options_.batch_size;
  if (batches_per_epoch_ == 0) {
    throw std::runtime_error("Loader: a data set of " + std::to_string(data_->n) + " samples gives no batch of " +
                             std::to_string(options_.batch_size) + (options_.drop_last ? " with drop_last" : ""));
  }
  if (start.epoch < 0 || start.batch < 0 || start.batch >= batches_per_epoch_) {
    throw std::runtime_error("Loader: start position (epoch " + std::to_string(start.epoch) + ", batch " +
                             std::to_string(start.batch) + ") is outside an epoch of " +
                             std::to_string(batches_per_epoch_) + " batches");
  }
  if (options_.device.is_cuda()) {
    upload_stream_ = flame::cuda::Stream::create(options_.device.index);
  }
  if (options_.prefetch > 0) {
    worker_ = std::thread([this, start] { worker_loop(start); });
  }
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

LoaderPosition Loader::advance(LoaderPosition pos) const {
  if (++pos.batch == batches_per_epoch_) {
    pos.batch = 0;
    ++pos.epoch;
  }
  return pos;
}

std::vector<int64_t> Loader::epoch_order(int64_t epoch) const {
  if (options_.sampler) {
    flame::dist::DistributedSampler s = *options_.sampler;
    s.set_epoch(epoch);
    return s.indices();
  }
  std::vector<int64_t> order(static_cast<std::size_t>(data_->n));
  for (int64_t i = 0; i < data_->n; ++i) order[i] = i;
  if (!options_.shuffle) return order;
  Rng rng(mix(options_.seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = data_->n - 1; i > 0; --i) {
    std::swap(order[i], order[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  return order;
}

const std::vector<int64_t>& Loader::cached_order(int64_t epoch) const {
  if (cached_epoch_ != epoch) {
    cached_order_ = epoch_order(epoch);
    cached_epoch_ = epoch;
  }
  return cached_order_;
}

Loader::Pending Loader::build(LoaderPosition pos) const {
  const Dataset& d = *data_;
  const std::vector<int64_t>& order = cached_order(pos.epoch);
  const int64_t begin = pos.batch * options_.batch_size;
  const int64_t b = std::min(options_.batch_size, static_cast<int64_t>(order.size()) - begin);
  const int64_t sz = d.image_size();

  Pending p;
  p.position = pos;
  p.indices.assign(order.begin() + begin, order.begin() + begin + b);
  p.flipped.assign(static_cast<std::size_t>(b), 0);
  if (options_.random_flip) {
    Rng rng(mix(mix(options_.seed, static_cast<uint64_t>(pos.epoch)), static_cast<uint64_t>(pos.batch) + 0x5eed));
    for (auto& f : p.flipped) f = static_cast<uint8_t>(rng.next() >> 63);
  }

  const bool pinned = options_.device.is_cuda();
  flame::Tensor images = host_buffer({b, 1, d.rows, d.cols}, flame::DType::f32, pinned);
  flame::Tensor labels = host_buffer({b}, flame::DType::i64, pinned);
  float* dst = images.data<float>();
  int64_t* lab = labels.data<int64_t>();
  for (int64_t k = 0; k < b; ++k) {
    const uint8_t* src = d.images.data() + p.indices[k] * sz;
    float* out = dst + k * sz;
    // [0, 255] -> [-1, 1]: x / 127.5 - 1.
    for (int64_t r = 0; r < d.rows; ++r) {
      const uint8_t* row = src + r * d.cols;
      float* orow = out + r * d.cols;
      if (p.flipped[k]) {
        for (int64_t c = 0; c < d.cols; ++c) orow[c] = static_cast<float>(row[d.cols - 1 - c]) / 127.5f - 1.0f;
      } else {
        for (int64_t c = 0; c < d.cols; ++c) orow[c] = static_cast<float>(row[c]) / 127.5f - 1.0f;
      }
    }
    lab[k] = d.labels[p.indices[k]];
  }
  if (options_.host_transform) options_.host_transform(images, labels, pos);

  if (options_.device.is_cuda()) {
    // Note [Loader prefetch]: queued on the upload stream; the caller's stream waits in finish().
    flame::cuda::StreamGuard guard(*upload_stream_);
    p.images = images.to(options_.device, /*non_blocking=*/true);
    p.labels = labels.to(options_.device, /*non_blocking=*/true);
    p.uploaded.emplace();
    p.uploaded->record(*upload_stream_);
  } else {
    p.images = std::move(images);
    p.labels = std::move(labels);
  }
  return p;
}

Batch Loader::finish(Pending&& p) const {
  if (p.uploaded) {
    const flame::cuda::Stream compute = flame::cuda::Stream::current(options_.device.index);
    p.uploaded->wait(compute);
    flame::cuda::record_stream(p.images, compute);
    flame::cuda::record_stream(p.labels, compute);
  }
  Batch b;
  b.images = std::move(p.images);
  b.labels = std::move(p.labels);
  b.position = p.position;
  b.indices = std::move(p.indices);
  b.flipped = std::move(p.flipped);
  return b;
}

void Loader::worker_loop(LoaderPosition pos) {
  try {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || ready_.size() < static_cast<std::size_t>(options_.prefetch); });
        if (stop_) return;
      }
      auto p = std::make_unique<Pending>(build(pos));
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ready_.push_back(std::move(p));
      }
      cv_.notify_all();
      pos = advance(pos);
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
    }
    cv_.notify_all();
  }
}

Batch Loader::next() {
  std::unique_ptr<Pending> p;
  if (options_.prefetch == 0) {
    p = std::make_unique<Pending>(build(position_));
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !ready_.empty() || error_ != nullptr; });
    if (ready_.empty()) std::rethrow_exception(error_);
    p = std::move(ready_.front());
    ready_.pop_front();
    lock.unlock();
    cv_.notify_all();
  }
  if (!(p->position == position_)) {
    throw std::logic_error("Loader: batch of epoch " + std::to_string(p->position.epoch) + " batch " +
                           std::to_string(p->position.batch) + " arrived out of order");
  }
  position_ = advance(position_);
  return finish(std::move(*p));
}

}  // namespace flame_diffusion
