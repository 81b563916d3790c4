#pragma once
// Map-style data sets and how examples become batches (docs/data.md).
//
//   struct Squares : data::Dataset<> {            // Dataset<Example>: {data, target}
//     int64_t size() const override { return 100; }
//     data::Example get(int64_t i) const override {
//       return {Tensor::full({3}, double(i)), Tensor::scalar(i * i)};
//     }
//   };
//   auto ds = std::make_shared<data::TensorDataset>(images, labels);   // tensors sharing dim 0
//
// A data set's get() is called from the loader's worker threads at the same time (num_workers > 0):
// it must be safe to call concurrently (a const read of data in memory is).
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flame/tensor.h"

namespace flame::data {

// The default example (and batch) type: an input and its target. `target` may be left undefined
// (unlabelled data); a batch then has an undefined target too.
struct Example {
  Tensor data;
  Tensor target;
};

// A map-style data set (torch.utils.data.Dataset): `size()` examples, `get(i)` the i-th. ExampleT is
// any movable type: Example, a Tensor, std::vector<Tensor>, or a struct of your own (give the
// DataLoader a collate function for it, Note [Batch tensors] in loader.h).
template <class ExampleT = Example>
class Dataset {
 public:
  using ExampleType = ExampleT;
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual ExampleT get(int64_t index) const = 0;
};

// Examples that are rows of tensors sharing dimension 0 (torch.utils.data.TensorDataset): get(i) is
// {data[i], target[i]}, views of the tensors (the loader's collate copies them into the batch).
class TensorDataset : public Dataset<Example> {
 public:
  // target may be undefined (then examples and batches have no target).
  explicit TensorDataset(Tensor data, Tensor target = {});
  int64_t size() const override { return size_; }
  Example get(int64_t index) const override;
  const Tensor& data() const { return data_; }
  const Tensor& target() const { return target_; }

 private:
  Tensor data_, target_;
  int64_t size_ = 0;
};

// ---- collation: a list of examples -> one batch (the DataLoader's default collate) ----

// The tensors stacked along a new dim 0 (torch.stack), in pinned host memory when `pinned` (CPU
// tensors only; Note [Loader prefetch]). All must have one shape, dtype and device; an error names
// the first that differs, by position in the batch.
Tensor collate_tensors(const std::vector<Tensor>& tensors, bool pinned = false, const char* field = "tensor");

// torch's default_collate for the example types it knows: each field stacked.
Example default_collate(std::vector<Example> examples, bool pinned = false);
Tensor default_collate(std::vector<Tensor> examples, bool pinned = false);
std::vector<Tensor> default_collate(std::vector<std::vector<Tensor>> examples, bool pinned = false);
std::map<std::string, Tensor> default_collate(std::vector<std::map<std::string, Tensor>> examples, bool pinned = false);

// Note [Batch tensors]
// for_each_tensor(batch, fn) calls fn(Tensor&) on every tensor of a batch: the loader uses it to
// pin a batch and move it to the device. It is defined for Example, Tensor, std::vector<Tensor> and
// std::map<std::string, Tensor>; for a batch type of your own, define
//   void for_each_tensor(MyBatch& b, const std::function<void(Tensor&)>& fn)
// in MyBatch's namespace (found by argument-dependent lookup). A batch type without it can still be
// loaded, but not with pin_memory or a device.
void for_each_tensor(Example& batch, const std::function<void(Tensor&)>& fn);
void for_each_tensor(Tensor& batch, const std::function<void(Tensor&)>& fn);
void for_each_tensor(std::vector<Tensor>& batch, const std::function<void(Tensor&)>& fn);
void for_each_tensor(std::map<std::string, Tensor>& batch, const std::function<void(Tensor&)>& fn);

namespace detail {
template <class B>
concept HasForEachTensor = requires(B& b, const std::function<void(Tensor&)>& fn) { for_each_tensor(b, fn); };
template <class E>
concept HasDefaultCollate = requires(std::vector<E> v) { default_collate(std::move(v), false); };
}  // namespace detail

}  // namespace flame::data
