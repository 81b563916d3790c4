#pragma once
// DataLoader: batches of a Dataset, in a reproducible order, built by worker threads, optionally
// pinned and uploaded to the GPU ahead of use; its position is checkpointable (docs/data.md).
//
//   auto ds = std::make_shared<data::TensorDataset>(images, labels);
//   data::DataLoader loader(ds, {.batch_size = 64, .shuffle = true, .seed = 1, .num_workers = 2,
//                                .device = Device::cuda()});
//   for (auto& batch : loader) { ... batch.data, batch.target ... }   // one epoch
//   data::Example b = loader.next();            // or batch by batch, across epochs
//   ckpt.add("loader", loader);                 // Stateful: epoch, batch, seed
//
// Note [Loader determinism]
// The batch at (epoch e, batch i) is a pure function of (data set, sampler, seed, e, i): its
// indices are entries [i * batch_size, (i + 1) * batch_size) of the sampler's epoch-e list (Note
// [Sampler determinism]), and BatchInfo::seed, which seeds any random augmentation a batch
// transform does, is HostRng::mix(HostRng::mix(seed, e), i + 0x5eed). So a loader whose state is
// loaded from a saved LoaderState produces exactly the batches an uninterrupted one does from
// there, whatever num_workers, prefetch_factor or the thread timing. next() moves on to the next
// epoch after an epoch's last batch; the shuffled samplers draw a new order for each epoch.
//
// Note [Loader workers]
// With num_workers > 0, that many threads build batches (get each index, collate, transform, pin,
// upload) ahead of next(), each taking the next unbuilt position; at most num_workers *
// prefetch_factor batches are built or being built ahead of the consumer. next() hands them out in
// order. An exception while building batch (e, i) is re-raised by the next() that reaches that
// batch, as a LoaderError naming the batch (and the data-set index when get() failed) with the
// original exception nested (std::rethrow_if_nested recovers it); the loader then stays failed
// (next() raises it again) until load_state(). With num_workers = 0 batches are built inside next().
// The destructor and load_state() stop and join the workers.
//
// Note [Loader prefetch]
// A batch for a CUDA device is assembled in pinned host memory (the default collate stacks straight
// into pinned buffers; other tensors are pinned after the collate), then the worker copies it to the
// device on the loader's own side stream and records an event. next() makes the caller's current
// stream wait for that event (the GPU waits, the host does not) and calls record_stream for it, so
// the upload overlaps compute and the memory is not reused while the compute stream may read it.
// pin_memory with a CPU device pins the batches (for uploads of your own); without a CUDA device
// pin_memory is ignored, as in PyTorch.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "flame/cuda.h"
#include "flame/data/dataset.h"
#include "flame/data/sampler.h"
#include "flame/device.h"
#include "flame/error.h"
#include "flame/stateful.h"

namespace flame::data {

// Where a loader is: next() returns batch `batch` of epoch `epoch`; `seed` is the loader's seed.
struct LoaderState {
  int64_t epoch = 0;
  int64_t batch = 0;
  uint64_t seed = 0;
  bool operator==(const LoaderState&) const = default;
};

// What a batch transform is told about the batch it works on.
struct BatchInfo {
  int64_t epoch = 0;
  int64_t batch = 0;
  std::vector<int64_t> indices;  // the data-set index of each example, in batch order
  uint64_t seed = 0;             // for this batch's random augmentation (Note [Loader determinism])
};

struct DataLoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;  // a RandomSampler(seed) when no sampler is given, else a SequentialSampler
  uint64_t seed = 0;     // the RandomSampler's seed and the root of BatchInfo::seed
  bool drop_last = false;  // drop an epoch's last batch when it is smaller than batch_size
  std::shared_ptr<const Sampler> sampler = nullptr;  // overrides shuffle (e.g. a DistributedSampler)
  int num_workers = 0;      // worker threads (Note [Loader workers]); 0: built inside next()
  int prefetch_factor = 2;  // batches ahead per worker
  bool pin_memory = false;  // batches in pinned host memory (Note [Loader prefetch])
  Device device = Device::cpu();  // where the batches are delivered
};

// A batch that could not be built: names the epoch, batch and (for a failed get) the index; the
// original exception is nested.
class LoaderError : public Error {
 public:
  explicit LoaderError(const std::string& what) : Error(what) {}
};

namespace detail {

// The part of DataLoader that does not depend on the example type: the schedule of batches, the
// workers and their ordered queue, errors, state and the device hand-over.
class LoaderCore {
 public:
  // Builds the batch described by the info; the result is the typed loader's batch, type-erased.
  using Build = std::function<std::shared_ptr<void>(const BatchInfo&)>;

  LoaderCore(int64_t dataset_size, DataLoaderOptions options);
  ~LoaderCore();
  LoaderCore(const LoaderCore&) = delete;
  LoaderCore& operator=(const LoaderCore&) = delete;

  void set_build(Build build) { build_ = std::move(build); }
  // The next batch in order (Note [Loader workers]).
  std::shared_ptr<void> next();
  LoaderState state() const;
  void load_state(const LoaderState& state);
  BatchInfo batch_info(int64_t epoch, int64_t batch) const;
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  const DataLoaderOptions& options() const { return options_; }
  const Sampler& sampler() const { return *sampler_; }

  // Whether host batches are assembled in pinned memory (Note [Loader prefetch]).
  bool pinned_staging() const { return pinned_staging_; }
  // Worker side: pins the CPU tensors (when staging is pinned) and, for a CUDA device, copies them
  // to it on the upload stream and records `uploaded`.
  void stage(const std::vector<Tensor*>& tensors, std::optional<cuda::Event>& uploaded) const;
  // Consumer side: the current stream waits for `uploaded`; record_stream of each tensor.
  void hand_over(const std::vector<Tensor*>& tensors, const cuda::Event& uploaded) const;
  // A LoaderError for a failed get(index) of a batch, the current exception nested; call it
  // inside a catch block.
  [[noreturn]] static void raise_get_failure(const BatchInfo& info, int64_t index);

 private:
  struct Result {
    std::shared_ptr<void> batch;
    std::exception_ptr error;
  };
  std::shared_ptr<const std::vector<int64_t>> epoch_order(int64_t epoch) const;
  BatchInfo info_at(int64_t sequence) const;  // the batch `sequence` places after start_
  Result build_one(int64_t sequence) const;
  void worker_loop();
  void stop_workers();

  DataLoaderOptions options_;
  int64_t dataset_size_ = 0;
  std::shared_ptr<const Sampler> sampler_;
  bool own_sampler_ = false;  // built from shuffle/seed (reseeded by load_state)
  int64_t batches_per_epoch_ = 0;
  bool pinned_staging_ = false;
  std::optional<cuda::Stream> upload_stream_;
  Build build_;

  LoaderState start_;      // the position of sequence number 0
  int64_t delivered_ = 0;  // batches next() returned since start_
  std::exception_ptr failed_;

  mutable std::mutex order_mutex_;
  mutable std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> orders_;

  std::mutex mutex_;  // guards what follows
  std::condition_variable cv_;
  int64_t scheduled_ = 0;
  std::map<int64_t, Result> ready_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

StateDict state_to_dict(const LoaderState& state);
LoaderState state_from_dict(const StateDict& dict);

}  // namespace detail

// ExampleT: what the data set's get() returns; BatchT: what collate makes of a list of them (by
// default the same type, with the fields stacked: Example, Tensor, std::vector<Tensor>,
// std::map<std::string, Tensor>). Other types need a collate function; pin_memory and a device
// need for_each_tensor for BatchT (Note [Batch tensors]).
template <class ExampleT = Example, class BatchT = ExampleT>
class DataLoader : public Stateful {
 public:
  using Collate = std::function<BatchT(std::vector<ExampleT>)>;
  // Runs on each host batch after the collate (on a worker thread when num_workers > 0), before
  // pinning and upload: batch-level augmentation, deterministic when it draws from info.seed.
  using Transform = std::function<void(BatchT&, const BatchInfo&)>;

  explicit DataLoader(std::shared_ptr<const Dataset<ExampleT>> dataset, DataLoaderOptions options = {},
                      Collate collate = {}, Transform transform = {});
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  DataLoader(DataLoader&&) = default;
  DataLoader& operator=(DataLoader&&) = default;

  // The batch at state(), then advances (into the next epoch after the last batch of one).
  BatchT next();

  // One epoch: from the current position to the end of its epoch (a whole epoch when the loader is
  // at an epoch's start), e.g. `for (auto& batch : loader)`; the next loop runs the next epoch.
  class iterator {
   public:
    using value_type = BatchT;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    BatchT& operator*() { return *current_; }
    BatchT* operator->() { return &*current_; }
    iterator& operator++() {
      fetch();
      return *this;
    }
    void operator++(int) { fetch(); }
    bool operator==(std::default_sentinel_t) const { return !current_.has_value(); }

   private:
    friend class DataLoader;
    iterator(DataLoader* loader, int64_t epoch) : loader_(loader), epoch_(epoch) { fetch(); }
    void fetch() {
      current_.reset();
      if (loader_->batches_per_epoch() > 0 && loader_->state().epoch == epoch_) current_.emplace(loader_->next());
    }
    DataLoader* loader_ = nullptr;
    int64_t epoch_ = 0;
    std::optional<BatchT> current_;
  };
  iterator begin() { return iterator(this, state().epoch); }
  std::default_sentinel_t end() const { return {}; }

  // Batches per epoch (len(loader) in PyTorch).
  int64_t size() const { return core_->batches_per_epoch(); }
  int64_t batches_per_epoch() const { return core_->batches_per_epoch(); }
  LoaderState state() const { return core_->state(); }
  // Moves to a saved position (and seed); the next batch is the one an uninterrupted loader gave
  // there (Note [Loader determinism]). Batches built ahead are discarded; a failed loader recovers.
  void load_state(const LoaderState& state) { core_->load_state(state); }
  // Which indices batch `batch` of epoch `epoch` holds, and its seed.
  BatchInfo batch_info(int64_t epoch, int64_t batch) const { return core_->batch_info(epoch, batch); }
  const DataLoaderOptions& options() const { return core_->options(); }
  const Dataset<ExampleT>& dataset() const { return *dataset_; }
  const Sampler& sampler() const { return core_->sampler(); }

  // Stateful: "epoch", "batch", "seed" as i64 scalars (checkpoint.h: ckpt.add("loader", loader)).
  StateDict state_dict() const override { return detail::state_to_dict(state()); }
  void load_state_dict(const StateDict& dict) override { load_state(detail::state_from_dict(dict)); }

 private:
  struct Ready {
    BatchT batch;
    std::optional<cuda::Event> uploaded;
  };
  static std::vector<Tensor*> tensors_of(BatchT& batch) {
    std::vector<Tensor*> out;
    if constexpr (detail::HasForEachTensor<BatchT>) {
      for_each_tensor(batch, [&](Tensor& t) { out.push_back(&t); });
    }
    return out;
  }

  std::shared_ptr<const Dataset<ExampleT>> dataset_;
  std::unique_ptr<detail::LoaderCore> core_;
};

template <class D>
DataLoader(std::shared_ptr<D>, DataLoaderOptions = {}) -> DataLoader<typename D::ExampleType>;

// ---- implementation ----

template <class ExampleT, class BatchT>
DataLoader<ExampleT, BatchT>::DataLoader(std::shared_ptr<const Dataset<ExampleT>> dataset, DataLoaderOptions options,
                                         Collate collate, Transform transform)
    : dataset_(std::move(dataset)) {
  FLAME_CHECK(dataset_ != nullptr, "DataLoader", "no data set (a null pointer)");
  const bool moves_tensors = options.pin_memory || options.device.is_cuda();
  FLAME_CHECK(detail::HasForEachTensor<BatchT> || !moves_tensors, "DataLoader",
              "pin_memory or a CUDA device needs the batch's tensors: define for_each_tensor(YourBatch&, "
              "const std::function<void(Tensor&)>&) beside your batch type (flame/data/dataset.h)");
  core_ = std::make_unique<detail::LoaderCore>(dataset_->size(), std::move(options));
  detail::LoaderCore* core = core_.get();
  if (!collate) {
    if constexpr (detail::HasDefaultCollate<ExampleT>) {
      using Default = decltype(default_collate(std::declval<std::vector<ExampleT>>(), false));
      if constexpr (std::is_same_v<Default, BatchT>) {
        collate = [core](std::vector<ExampleT> examples) {
          return default_collate(std::move(examples), core->pinned_staging());
        };
      }
    }
    FLAME_CHECK(static_cast<bool>(collate), "DataLoader",
                "no default collate turns this example type into this batch type: pass a collate function");
  }
  core_->set_build([dataset = dataset_, collate = std::move(collate), transform = std::move(transform),
                    core](const BatchInfo& info) -> std::shared_ptr<void> {
    std::vector<ExampleT> examples;
    examples.reserve(info.indices.size());
    for (int64_t index : info.indices) {
      try {
        examples.push_back(dataset->get(index));
      } catch (...) {
        detail::LoaderCore::raise_get_failure(info, index);
      }
    }
    auto ready = std::make_shared<Ready>(Ready{collate(std::move(examples)), std::nullopt});
    if (transform) transform(ready->batch, info);
    core->stage(tensors_of(ready->batch), ready->uploaded);
    return ready;
  });
}

template <class ExampleT, class BatchT>
BatchT DataLoader<ExampleT, BatchT>::next() {
  std::shared_ptr<Ready> ready = std::static_pointer_cast<Ready>(core_->next());
  if (ready->uploaded) core_->hand_over(tensors_of(ready->batch), *ready->uploaded);
  return std::move(ready->batch);
}

}  // namespace flame::data
