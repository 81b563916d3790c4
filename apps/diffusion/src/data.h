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
// Note [Loader determinism]
// The batch at (epoch e, batch i) is a pure function of (seed, e, i) and the data set: epoch e's
// order is a Fisher-Yates permutation drawn from a generator seeded with mix(seed, e) (a different
// permutation each epoch), and the flips of batch i from a generator seeded with mix(seed, e, i).
// So a loader started at a saved LoaderPosition produces exactly the batches an uninterrupted one
// does from there, whatever the prefetch depth or the thread timing. The generators are our own
// (splitmix64, xoshiro256**), not <random>'s distributions, whose output differs between standard
// libraries.
//
// Note [Loader prefetch]
// With prefetch > 0 a worker thread builds the batches ahead, in order, into a queue of at most
// `prefetch` ready batches. For a CUDA device the worker also uploads each batch on a side stream
// of its own and records an event; next() makes the caller's current stream wait for that event
// (the GPU waits, the host does not) and calls record_stream for the compute stream, so the
// upload overlaps compute and the memory is not reused while the compute stream may still read
// it. The host batch is assembled in one buffer per tensor (stage_host in data.cpp: the one place
// where pinned memory is switched on once Tensor::pin_memory() exists). The destructor stops and
// joins the worker; an exception in the worker is re-raised by the next call to next().
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <flame/flame.h>
#include <flame/dist.h>

#include "idx.h"

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
  static Dataset from_idx(IdxArray images, IdxArray labels, const std::string& source);

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

class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> data, LoaderOptions options, LoaderPosition start = {});
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The batch at position(), then advances (to the next epoch after the last batch). Re-raises an
  // error of the worker thread.
  Batch next();
  // The position of the batch next() returns next.
  LoaderPosition position() const { return position_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  const LoaderOptions& options() const { return options_; }

  // Epoch e's sample order (Note [Loader determinism]).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  const std::vector<int64_t>& cached_order(int64_t epoch) const;  // builder thread only
  struct Pending;  // a built batch and, on CUDA, the event of its upload
  Pending build(LoaderPosition pos) const;
  Batch finish(Pending&& p) const;
  LoaderPosition advance(LoaderPosition pos) const;
  void worker_loop(LoaderPosition pos);

  std::shared_ptr<const Dataset> data_;
  LoaderOptions options_;
  int64_t batches_per_epoch_ = 0;
  LoaderPosition position_;
  std::optional<flame::cuda::Stream> upload_stream_;  // CUDA devices only
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;

  // Prefetch state (Note [Loader prefetch]); all guarded by mutex_.
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Pending>> ready_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace flame_diffusion
