#pragma once
// Samplers: which data-set indices an epoch visits, in which order (docs/data.md).
//
// Note [Sampler determinism]
// A sampler's epoch is a pure function of its construction arguments and the epoch number:
// indices(e) returns the same list whenever it is called, on any thread, in any process. This is
// what makes a DataLoader's position (epoch, batch) enough to resume exactly (Note [Loader
// determinism] in flame/data/loader.h), and what lets every rank of a distributed job agree on
// one shuffled order without communicating. Shuffles are drawn on the host with HostRng
// (flame/random.h), whose output does not depend on the platform or the standard library.
#include <cstdint>
#include <vector>

#include "flame/random.h"

namespace flame::data {

class Sampler {
 public:
  virtual ~Sampler() = default;
  // How many indices one epoch has.
  virtual int64_t num_samples() const = 0;
  // Epoch `epoch`'s indices in visiting order (Note [Sampler determinism]).
  virtual std::vector<int64_t> indices(int64_t epoch) const = 0;
};

// 0, 1, ..., size - 1 every epoch (torch.utils.data.SequentialSampler).
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t size);
  int64_t num_samples() const override { return size_; }
  std::vector<int64_t> indices(int64_t epoch) const override;

 private:
  int64_t size_;
};

// A random order each epoch (torch.utils.data.RandomSampler). Epoch e draws from a generator in
// the state {seed, offset + e}, where (seed, offset) is the generator's state at construction:
// without replacement, randperm(size) of that state (more permutations, concatenated, when
// num_samples exceeds size; a prefix when it is smaller); with replacement, randint(0, size) of
// it. So each epoch is another order, and every epoch is reproducible from (seed, epoch).
class RandomSampler : public Sampler {
 public:
  // num_samples < 0: the data-set size.
  explicit RandomSampler(int64_t size, uint64_t seed = 0, bool replacement = false, int64_t num_samples = -1);
  RandomSampler(int64_t size, const Generator& generator, bool replacement = false, int64_t num_samples = -1);
  int64_t num_samples() const override { return num_samples_; }
  std::vector<int64_t> indices(int64_t epoch) const override;
  bool replacement() const { return replacement_; }

 private:
  int64_t size_;
  Generator::State base_;
  bool replacement_;
  int64_t num_samples_;
};

// Each rank's share of a data set of `size` items for one epoch, as torch's DistributedSampler:
// the (shuffled, seed + epoch) index list is padded by repeating its head to a multiple of the
// world size (or cut, with drop_last), and rank r takes every world-th index from r. All ranks get
// the same count. (Also spelled flame::dist::DistributedSampler.)
class DistributedSampler : public Sampler {
 public:
  // num_replicas/rank < 0: the default process group's (1 and 0 without one).
  explicit DistributedSampler(int64_t size, int num_replicas = -1, int rank = -1, bool shuffle = true,
                              uint64_t seed = 0, bool drop_last = false);
  // torch's spelling: the epoch indices() without an argument uses. A DataLoader passes its own
  // epoch to indices(epoch) and needs no set_epoch.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  std::vector<int64_t> indices() const { return indices(epoch_); }
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t num_samples() const override { return num_samples_; }  // per rank
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  int num_replicas() const { return num_replicas_; }
  int rank() const { return rank_; }

 private:
  int64_t size_ = 0;
  int num_replicas_ = 1;
  int rank_ = 0;
  bool shuffle_ = true;
  uint64_t seed_ = 0;
  bool drop_last_ = false;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
};

}  // namespace flame::data
