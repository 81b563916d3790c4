// Samplers (flame/data/sampler.h, Note [Sampler determinism]).
#include "flame/data/sampler.h"

#include <numeric>
#include <random>

#include "flame/dist.h"
#include "flame/error.h"
#include "flame/tensor.h"

namespace flame::data {

SequentialSampler::SequentialSampler(int64_t size) : size_(size) {
  FLAME_CHECK(size >= 0, "SequentialSampler", "data-set size must be >= 0, got ", size);
}

std::vector<int64_t> SequentialSampler::indices(int64_t) const {
  std::vector<int64_t> out(static_cast<std::size_t>(size_));
  std::iota(out.begin(), out.end(), int64_t{0});
  return out;
}

RandomSampler::RandomSampler(int64_t size, uint64_t seed, bool replacement, int64_t num_samples)
    : RandomSampler(size, Generator(seed), replacement, num_samples) {}

RandomSampler::RandomSampler(int64_t size, const Generator& generator, bool replacement, int64_t num_samples)
    : size_(size), base_(generator.get_state()), replacement_(replacement),
      num_samples_(num_samples < 0 ? size : num_samples) {
  FLAME_CHECK(size >= 0, "RandomSampler", "data-set size must be >= 0, got ", size);
  FLAME_CHECK(size > 0 || num_samples_ == 0, "RandomSampler", "cannot draw ", num_samples_,
              " samples from an empty data set");
}

std::vector<int64_t> RandomSampler::indices(int64_t epoch) const {
  FLAME_CHECK(epoch >= 0, "RandomSampler", "epoch must be >= 0, got ", epoch);
  if (num_samples_ == 0) return {};
  Generator gen;
  gen.set_state({base_.seed, base_.offset + static_cast<uint64_t>(epoch)});
  if (replacement_) return Tensor::randint(0, size_, {num_samples_}, DType::i64, &gen).to_vec<int64_t>();
  std::vector<int64_t> out = Tensor::randperm(size_, DType::i64, &gen).to_vec<int64_t>();
  if (num_samples_ > size_) {
    // Whole further permutations from a generator of this epoch's own (seeded from the epoch's state),
    // so that epochs never share draws.
    Generator more(HostRng::mix(base_.seed, base_.offset + static_cast<uint64_t>(epoch)));
    while (static_cast<int64_t>(out.size()) < num_samples_) {
      const std::vector<int64_t> p = Tensor::randperm(size_, DType::i64, &more).to_vec<int64_t>();
      out.insert(out.end(), p.begin(), p.end());
    }
  }
  out.resize(static_cast<std::size_t>(num_samples_));
  return out;
}

DistributedSampler::DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : size_(size), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  num_replicas_ = num_replicas >= 0 ? num_replicas : dist::get_world_size();
  rank_ = rank >= 0 ? rank : dist::get_rank();
  FLAME_CHECK(size >= 0, "DistributedSampler", "dataset size must be >= 0, got ", size);
  FLAME_CHECK(num_replicas_ >= 1 && rank_ < num_replicas_, "DistributedSampler", "rank ", rank_,
              " is not in [0, ", num_replicas_, ")");
  if (drop_last_ && size_ % num_replicas_ != 0) num_samples_ = size_ / num_replicas_;
  else num_samples_ = (size_ + num_replicas_ - 1) / num_replicas_;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch) const {
  std::vector<int64_t> all(static_cast<std::size_t>(size_));
  std::iota(all.begin(), all.end(), int64_t{0});
  if (shuffle_) {
    // Same permutation on every rank: a fixed generator keyed by seed + epoch (mt19937_64's
    // output is fixed by the C++ standard, and no std distribution is used).
    std::mt19937_64 rng(seed_ + static_cast<uint64_t>(epoch));
    for (std::size_t i = all.size(); i > 1; --i) {
      const std::size_t j = static_cast<std::size_t>(rng() % i);
      std::swap(all[i - 1], all[j]);
    }
  }
  const std::size_t total = static_cast<std::size_t>(total_size());
  if (total > all.size() && !all.empty()) {
    const std::size_t n = all.size();
    for (std::size_t k = 0; all.size() < total; ++k) all.push_back(all[k % n]);
  }
  all.resize(total);
  std::vector<int64_t> mine;
  mine.reserve(static_cast<std::size_t>(num_samples_));
  for (std::size_t k = static_cast<std::size_t>(rank_); k < total; k += static_cast<std::size_t>(num_replicas_))
    mine.push_back(all[k]);
  return mine;
}

}  // namespace flame::data
