#pragma once
// Fashion-MNIST in memory and a batch loader for training.
//
//   auto train = std::make_shared<const Dataset>(Dataset::load(find_data_dir(flag), Split::train));
//   LoaderOptions opt;  opt.batch_size = 256;  opt.seed = 1;  opt.random_flip = true;
//   opt.device = flame::Device::cuda(0);
//   Loader loader(train, opt, saved_position);           // {} starts at epoch 0, batch 0
//   Batch b = loader.next();   // b.images f32 [B, 1, 28, 28] in [-1, 1], b.labels i64 [B]
//   checkpoint.position = loader.position();               // where the next batch starts
//
// The loader is flame::data's DataLoader (include/flame/data/loader.h) over FashionMnistDataset:
// its Notes [Loader determinism], [Loader workers] and [Loader prefetch] hold here. With a seed, the
// epoch orders are flame::data::RandomSampler's (randperm of the generator state {seed, epoch}) and
// the flips of batch i of epoch e are drawn from HostRng(BatchInfo::seed); prefetch > 0 is one
// worker thread keeping `prefetch` batches ahead, uploaded to a CUDA device on a side stream.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/data.h>
#include <flame/dist.h>
#include <flame/flame.h>

namespace flame_diffusion {

enum class Split { train, test };

// Fashion-MNIST's classes, by label.
const std::vector<std::string>& fashion_mnist_class_names();

// Where the Fashion-MNIST files are: the first of `flag_dir` (a --data flag; empty: none), the
// environment variable FLAME_FASHION_MNIST, /usr/share/datasets/fashion-mnist (Debian's
// dataset-fashion-mnist), ./.deps/fashion_mnist and the checkout's .deps/fashion_mnist that holds
// train-images-idx3-ubyte(.gz). A flag or variable that names a folder without the files is an
// error (it is not silently skipped). Raises, listing the places tried, when none has them.
std::string find_data_dir(const std::string& flag_dir = "");

// One split in memory as uint8: images [n, rows, cols] row-major, labels [n] in 0..9.
struct Dataset {
  int64_t n = 0, rows = 0, cols = 0;
  std::vector<uint8_t> images;
  std::vector<uint8_t> labels;

  // Reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (gzip'd or plain) and checks
  // that the counts agree and every label is in 0..9.
  static Dataset load(const std::string& dir, Split split);
  // From two parsed IDX files (images 3-d, labels 1-d); `source` names them in errors.
  static Dataset from_idx(flame::data::IdxArray images, flame::data::IdxArray labels, const std::string& source);

  // The samples whose label is in `classes` (e.g. {7} for a fine-tuning subset), in their order.
  Dataset select_classes(const std::vector<int>& classes) const;
  // The samples whose label is not in `classes` (e.g. a class held out of the base run).
  Dataset exclude_classes(const std::vector<int>& classes) const;
  // How many samples each class 0..9 has.
  std::vector<int64_t> class_counts() const;

  int64_t image_size() const { return rows * cols; }
};

// Where a loader is: the next batch it produces is batch `batch` of epoch `epoch`. Plain integers,
// for a checkpoint to save and give back.
struct LoaderPosition {
  int64_t epoch = 0;
  int64_t batch = 0;
  bool operator==(const LoaderPosition& o) const { return epoch == o.epoch && batch == o.batch; }
};

struct LoaderOptions {
  int64_t batch_size = 256;
  uint64_t seed = 0;
  bool shuffle = true;       // false: data-set order every epoch
  bool drop_last = true;     // false: the last batch of an epoch may be smaller
  bool random_flip = false;  // horizontal flip of each image with probability 1/2
  int prefetch = 2;          // ready batches kept ahead by the worker thread; 0: built in next()
  flame::Device device = flame::Device::cpu();
  // Runs on each host batch (CPU tensors, before the upload; on the worker thread when
  // prefetching): extra augmentation in place. An exception it throws is re-raised by next().
  std::function<void(flame::Tensor& images, flame::Tensor& labels, LoaderPosition position)> host_transform;
  // Multi-process training: each epoch is this rank's share (DistributedSampler::indices at the
  // epoch) instead of the whole shuffled data set; shuffle and seed are then the sampler's.
  std::optional<flame::dist::DistributedSampler> sampler = std::nullopt;
};

struct Batch {
  flame::Tensor images;  // f32 [B, 1, rows, cols] in [-1, 1], on the loader's device
  flame::Tensor labels;  // i64 [B]
  LoaderPosition position;      // which batch this is
  std::vector<int64_t> indices;  // the data-set index of each sample
  std::vector<uint8_t> flipped;  // 1 where the sample was flipped
};

// A Dataset's samples as flame::data examples: data f32 [1, rows, cols] in [-1, 1] (x / 127.5 - 1),
// target i64 [] (the label).
class FashionMnistDataset : public flame::data::Dataset<> {
 public:
  // (Inside this class `Dataset` names the base, hence the qualified name.)
  explicit FashionMnistDataset(std::shared_ptr<const flame_diffusion::Dataset> data);
  int64_t size() const override { return data_->n; }
  flame::data::Example get(int64_t index) const override;

 private:
  std::shared_ptr<const flame_diffusion::Dataset> data_;
};

class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> data, const LoaderOptions& options, LoaderPosition start = {});
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The batch at position(), then advances (to the next epoch after the last batch). Re-raises an
  // error of the worker thread (a flame::data::LoaderError naming the batch, the error nested).
  Batch next();
  // The position of the batch next() returns next.
  LoaderPosition position() const;
  int64_t batches_per_epoch() const { return loader_->batches_per_epoch(); }
  const LoaderOptions& options() const { return options_; }

  // Epoch e's sample order (Note [Loader determinism] in flame/data/loader.h).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  std::shared_ptr<const Dataset> data_;
  LoaderOptions options_;
  std::unique_ptr<flame::data::DataLoader<>> loader_;
};

}  // namespace flame_diffusion
