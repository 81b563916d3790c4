// TensorDataset, the default collate, for_each_tensor and the IDX tensor conversions
// (flame/data/dataset.h, flame/data/idx.h).
#include "flame/data/dataset.h"

#include "flame/data/idx.h"
#include "flame/error.h"
#include "flame/offload.h"
#include "flame/ops.h"

namespace flame::data {

TensorDataset::TensorDataset(Tensor data, Tensor target) : data_(std::move(data)), target_(std::move(target)) {
  FLAME_CHECK(data_.defined(), "TensorDataset", "the data tensor is undefined");
  FLAME_CHECK(data_.dim() >= 1, "TensorDataset", "the data tensor must have a dim 0 to index, got a 0-d tensor");
  size_ = data_.size(0);
  if (target_.defined()) {
    FLAME_CHECK(target_.dim() >= 1 && target_.size(0) == size_, "TensorDataset",
                "data and target must share dim 0: data ", data_.sizes(), ", target ", target_.sizes());
  }
}

Example TensorDataset::get(int64_t index) const {
  FLAME_CHECK(index >= 0 && index < size_, "TensorDataset", "index ", index, " is out of range for ", size_,
              " examples");
  return {data_.select(0, index), target_.defined() ? target_.select(0, index) : Tensor{}};
}

Tensor collate_tensors(const std::vector<Tensor>& tensors, bool pinned, const char* field) {
  FLAME_CHECK(!tensors.empty(), "collate", "no ", field, "s to stack (an empty batch)");
  const Tensor& first = tensors[0];
  FLAME_CHECK(first.defined(), "collate", field, " 0 of the batch is undefined");
  for (std::size_t k = 1; k < tensors.size(); ++k) {
    const Tensor& t = tensors[k];
    FLAME_CHECK(t.defined(), "collate", field, " ", k, " of the batch is undefined (", field, " 0 is not)");
    FLAME_CHECK(t.sizes() == first.sizes() && t.dtype() == first.dtype() && t.device() == first.device(), "collate",
                field, " ", k, " of the batch is ", t.sizes(), " ", dtype_name(t.dtype()), " on ", t.device().str(),
                ", ", field, " 0 is ", first.sizes(), " ", dtype_name(first.dtype()), " on ", first.device().str(),
                ": examples of one batch must match to be stacked (or pass a collate function)");
  }
  if (!(pinned && first.device().is_cpu())) return stack(tensors, 0);
  // Stacked straight into a pinned buffer (Note [Loader prefetch]): one copy, no pinning pass.
  Shape shape = first.sizes();
  shape.insert(shape.begin(), static_cast<int64_t>(tensors.size()));
  Tensor out = offload::empty_pinned(shape, first.dtype());
  for (std::size_t k = 0; k < tensors.size(); ++k) out.select(0, static_cast<int64_t>(k)).copy_(tensors[k]);
  return out;
}

Example default_collate(std::vector<Example> examples, bool pinned) {
  FLAME_CHECK(!examples.empty(), "collate", "no examples to stack (an empty batch)");
  std::vector<Tensor> data, target;
  data.reserve(examples.size());
  const bool has_target = examples[0].target.defined();
  for (std::size_t k = 0; k < examples.size(); ++k) {
    data.push_back(std::move(examples[k].data));
    FLAME_CHECK(examples[k].target.defined() == has_target, "collate", "example ", k, " of the batch ",
                has_target ? "has no target, example 0 has one" : "has a target, example 0 has none");
    if (has_target) target.push_back(std::move(examples[k].target));
  }
  Example out;
  out.data = collate_tensors(data, pinned, "data");
  if (has_target) out.target = collate_tensors(target, pinned, "target");
  return out;
}

Tensor default_collate(std::vector<Tensor> examples, bool pinned) { return collate_tensors(examples, pinned); }

std::vector<Tensor> default_collate(std::vector<std::vector<Tensor>> examples, bool pinned) {
  FLAME_CHECK(!examples.empty(), "collate", "no examples to stack (an empty batch)");
  const std::size_t fields = examples[0].size();
  std::vector<Tensor> out;
  for (std::size_t f = 0; f < fields; ++f) {
    std::vector<Tensor> column;
    column.reserve(examples.size());
    for (std::size_t k = 0; k < examples.size(); ++k) {
      FLAME_CHECK(examples[k].size() == fields, "collate", "example ", k, " of the batch has ", examples[k].size(),
                  " tensors, example 0 has ", fields);
      column.push_back(std::move(examples[k][f]));
    }
    out.push_back(collate_tensors(column, pinned, "field"));
  }
  return out;
}

std::map<std::string, Tensor> default_collate(std::vector<std::map<std::string, Tensor>> examples, bool pinned) {
  FLAME_CHECK(!examples.empty(), "collate", "no examples to stack (an empty batch)");
  std::map<std::string, Tensor> out;
  for (const auto& [key, unused] : examples[0]) {
    std::vector<Tensor> column;
    column.reserve(examples.size());
    for (std::size_t k = 0; k < examples.size(); ++k) {
      auto it = examples[k].find(key);
      FLAME_CHECK(it != examples[k].end() && examples[k].size() == examples[0].size(), "collate", "example ", k,
                  " of the batch does not have the keys of example 0 (\"", key, "\" and ", examples[0].size(),
                  " keys in all)");
      column.push_back(std::move(it->second));
    }
    out[key] = collate_tensors(column, pinned, key.c_str());
  }
  return out;
}

void for_each_tensor(Example& batch, const std::function<void(Tensor&)>& fn) {
  if (batch.data.defined()) fn(batch.data);
  if (batch.target.defined()) fn(batch.target);
}
void for_each_tensor(Tensor& batch, const std::function<void(Tensor&)>& fn) {
  if (batch.defined()) fn(batch);
}
void for_each_tensor(std::vector<Tensor>& batch, const std::function<void(Tensor&)>& fn) {
  for (Tensor& t : batch)
    if (t.defined()) fn(t);
}
void for_each_tensor(std::map<std::string, Tensor>& batch, const std::function<void(Tensor&)>& fn) {
  for (auto& [key, t] : batch)
    if (t.defined()) fn(t);
}

Tensor idx_to_tensor(const IdxArray& array) {
  return Tensor::from_blob_copy(array.data.data(), DType::u8, array.data.size(), array.dims);
}

Tensor load_idx(const std::string& path, int expected_ndim) { return idx_to_tensor(read_idx(path, expected_ndim)); }

}  // namespace flame::data
