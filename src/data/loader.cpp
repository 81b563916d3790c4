// The DataLoader's type-independent core (flame/data/loader.h: Notes [Loader determinism],
// [Loader workers] and [Loader prefetch]).
#include "flame/data/loader.h"

#include <algorithm>
#include <sstream>

#include "flame/random.h"
#include "flame/state_dict.h"

namespace flame::data::detail {
namespace {

std::string position_str(const BatchInfo& info) {
  std::ostringstream os;
  os << "batch " << info.batch << " of epoch " << info.epoch << " (indices ";
  const std::size_t shown = std::min<std::size_t>(info.indices.size(), 8);
  for (std::size_t k = 0; k < shown; ++k) os << (k ? ", " : "") << info.indices[k];
  if (shown < info.indices.size()) os << ", ... " << info.indices.size() << " in all";
  os << ")";
  return os.str();
}

std::string what_of_current() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

LoaderCore::LoaderCore(int64_t dataset_size, DataLoaderOptions options)
    : options_(std::move(options)), dataset_size_(dataset_size) {
  FLAME_CHECK(dataset_size_ >= 0, "DataLoader", "the data set's size() is negative: ", dataset_size_);
  FLAME_CHECK(options_.batch_size > 0, "DataLoader", "batch_size must be positive, got ", options_.batch_size);
  FLAME_CHECK(options_.num_workers >= 0, "DataLoader", "num_workers must be >= 0, got ", options_.num_workers);
  FLAME_CHECK(options_.prefetch_factor >= 1, "DataLoader", "prefetch_factor must be >= 1, got ",
              options_.prefetch_factor);
  FLAME_CHECK(!options_.device.is_cuda() || cuda_is_available(), "DataLoader", "device ", options_.device.str(),
              " requested but no CUDA device is available (a CPU-only build or machine): use Device::cpu()");
  if (options_.sampler) {
    sampler_ = options_.sampler;
  } else if (options_.shuffle) {
    sampler_ = std::make_shared<RandomSampler>(dataset_size_, options_.seed);
    own_sampler_ = true;
  } else {
    sampler_ = std::make_shared<SequentialSampler>(dataset_size_);
  }
  const int64_t n = sampler_->num_samples();
  FLAME_CHECK(n >= 0, "DataLoader", "the sampler's num_samples() is negative: ", n);
  batches_per_epoch_ = options_.drop_last ? n / options_.batch_size : (n + options_.batch_size - 1) / options_.batch_size;
  pinned_staging_ = options_.device.is_cuda() || (options_.pin_memory && cuda_is_available());
  if (options_.device.is_cuda()) upload_stream_ = cuda::Stream::create(options_.device.index);
  start_.seed = options_.seed;
}

LoaderCore::~LoaderCore() { stop_workers(); }

void LoaderCore::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  stop_ = false;
  ready_.clear();
  scheduled_ = delivered_;
}

std::shared_ptr<const std::vector<int64_t>> LoaderCore::epoch_order(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(order_mutex_);
  auto it = orders_.find(epoch);
  if (it != orders_.end()) return it->second;
  auto order = std::make_shared<const std::vector<int64_t>>(sampler_->indices(epoch));
  FLAME_CHECK(static_cast<int64_t>(order->size()) == sampler_->num_samples(), "DataLoader", "the sampler gave ",
              order->size(), " indices for epoch ", epoch, " but num_samples() is ", sampler_->num_samples());
  for (int64_t i : *order) {
    FLAME_CHECK(i >= 0 && i < dataset_size_, "DataLoader", "the sampler gave index ", i, " in epoch ", epoch,
                ", outside the data set of ", dataset_size_, " examples");
  }
  orders_[epoch] = order;
  while (orders_.size() > 3) orders_.erase(orders_.begin());  // the workers straddle at most two epochs
  return order;
}

BatchInfo LoaderCore::batch_info(int64_t epoch, int64_t batch) const {
  FLAME_CHECK(epoch >= 0 && batch >= 0 && batch < batches_per_epoch_, "DataLoader", "batch ", batch, " of epoch ",
              epoch, " does not exist: an epoch has ", batches_per_epoch_, " batches");
  const std::shared_ptr<const std::vector<int64_t>> order = epoch_order(epoch);
  const int64_t begin = batch * options_.batch_size;
  const int64_t count = std::min(options_.batch_size, static_cast<int64_t>(order->size()) - begin);
  BatchInfo info;
  info.epoch = epoch;
  info.batch = batch;
  info.indices.assign(order->begin() + begin, order->begin() + begin + count);
  info.seed = HostRng::mix(HostRng::mix(options_.seed, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(batch) + 0x5eed);
  return info;
}

BatchInfo LoaderCore::info_at(int64_t sequence) const {
  const int64_t p = start_.batch + sequence;
  return batch_info(start_.epoch + p / batches_per_epoch_, p % batches_per_epoch_);
}

LoaderState LoaderCore::state() const {
  LoaderState s = start_;
  if (batches_per_epoch_ > 0) {
    const int64_t p = start_.batch + delivered_;
    s.epoch = start_.epoch + p / batches_per_epoch_;
    s.batch = p % batches_per_epoch_;
  }
  return s;
}

void LoaderCore::load_state(const LoaderState& state) {
  FLAME_CHECK(state.epoch >= 0 && state.batch >= 0 && (state.batch < batches_per_epoch_ || state.batch == 0),
              "DataLoader", "load_state: position (epoch ", state.epoch, ", batch ", state.batch,
              ") is outside an epoch of ", batches_per_epoch_, " batches (was the state saved by a loader with "
              "another data set, sampler, batch_size or drop_last?)");
  stop_workers();
  if (state.seed != options_.seed) {
    options_.seed = state.seed;
    if (own_sampler_) sampler_ = std::make_shared<RandomSampler>(dataset_size_, options_.seed);
    std::lock_guard<std::mutex> lock(order_mutex_);
    orders_.clear();
  }
  start_ = state;
  delivered_ = 0;
  scheduled_ = 0;
  failed_ = nullptr;
}

LoaderCore::Result LoaderCore::build_one(int64_t sequence) const {
  Result r;
  BatchInfo info;
  try {
    info = info_at(sequence);
    r.batch = build_(info);
  } catch (const LoaderError&) {
    r.error = std::current_exception();
  } catch (...) {
    const std::string msg = "DataLoader: building " + position_str(info) + " failed: " + what_of_current();
    try {
      std::throw_with_nested(LoaderError(msg));
    } catch (...) {
      r.error = std::current_exception();
    }
  }
  return r;
}

void LoaderCore::raise_get_failure(const BatchInfo& info, int64_t index) {
  std::throw_with_nested(LoaderError("DataLoader: dataset get(" + std::to_string(index) + ") for " +
                                     position_str(info) + " failed: " + what_of_current()));
}

void LoaderCore::worker_loop() {
  const int64_t ahead = static_cast<int64_t>(options_.num_workers) * options_.prefetch_factor;
  while (true) {
    int64_t sequence = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || scheduled_ - delivered_ < ahead; });
      if (stop_) return;
      sequence = scheduled_++;
    }
    Result r = build_one(sequence);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ready_[sequence] = std::move(r);
    }
    cv_.notify_all();
  }
}

std::shared_ptr<void> LoaderCore::next() {
  FLAME_CHECK(batches_per_epoch_ > 0, "DataLoader", "an epoch has no batch: ", sampler_->num_samples(),
              " samples per epoch, batch_size ", options_.batch_size, options_.drop_last ? " with drop_last" : "");
  if (failed_) std::rethrow_exception(failed_);
  Result r;
  if (options_.num_workers == 0) {
    r = build_one(delivered_);
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    if (workers_.empty()) {
      scheduled_ = delivered_;
      for (int w = 0; w < options_.num_workers; ++w) workers_.emplace_back([this] { worker_loop(); });
    }
    cv_.wait(lock, [&] { return ready_.count(delivered_) > 0; });
    auto it = ready_.find(delivered_);
    r = std::move(it->second);
    ready_.erase(it);
  }
  if (r.error) {
    failed_ = r.error;
    std::rethrow_exception(failed_);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++delivered_;
  }
  cv_.notify_all();
  return r.batch;
}

void LoaderCore::stage(const std::vector<Tensor*>& tensors, std::optional<cuda::Event>& uploaded) const {
  if (pinned_staging_) {
    for (Tensor* t : tensors) {
      if (t->device().is_cpu() && !t->is_pinned()) *t = t->pin_memory();
    }
  }
  if (!options_.device.is_cuda()) {
    for (Tensor* t : tensors) *t = t->to(options_.device);
    return;
  }
  // Note [Loader prefetch]: queued on the upload stream; the consumer's stream waits in hand_over.
  cuda::StreamGuard guard(*upload_stream_);
  for (Tensor* t : tensors) *t = t->to(options_.device, /*non_blocking=*/true);
  uploaded.emplace();
  uploaded->record(*upload_stream_);
}

void LoaderCore::hand_over(const std::vector<Tensor*>& tensors, const cuda::Event& uploaded) const {
  const cuda::Stream compute = cuda::Stream::current(options_.device.index);
  uploaded.wait(compute);
  for (Tensor* t : tensors) {
    if (t->device().is_cuda()) cuda::record_stream(*t, compute);
  }
}

StateDict state_to_dict(const LoaderState& state) {
  StateDict d;
  d.insert("epoch", Tensor::scalar(state.epoch, DType::i64));
  d.insert("batch", Tensor::scalar(state.batch, DType::i64));
  d.insert("seed", Tensor::scalar(static_cast<int64_t>(state.seed), DType::i64));
  return d;
}

LoaderState state_from_dict(const StateDict& dict) {
  LoaderState s;
  int64_t* fields[] = {&s.epoch, &s.batch, nullptr};
  const char* names[] = {"epoch", "batch", "seed"};
  int64_t seed = 0;
  fields[2] = &seed;
  for (int k = 0; k < 3; ++k) {
    const Tensor* t = dict.find(names[k]);
    FLAME_CHECK(t != nullptr, "DataLoader", "load_state_dict: key \"", names[k],
                "\" is missing (a loader's state has epoch, batch and seed)");
    FLAME_CHECK(t->dtype() == DType::i64 && t->numel() == 1, "DataLoader", "load_state_dict: key \"", names[k],
                "\" must be one i64, got ", dtype_name(t->dtype()), " ", t->sizes());
    *fields[k] = t->item<int64_t>();
  }
  s.seed = static_cast<uint64_t>(seed);
  return s;
}

}  // namespace flame::data::detail
