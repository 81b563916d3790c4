#pragma once
// StateDict: named tensors in insertion order, as PyTorch's OrderedDict state dicts. Modules
// produce and consume it (flame/nn), safetensors files read into and write from it (flame/io).
// Names are unique; lookups by name are O(1); iteration follows insertion order.
#include <cstddef>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flame/tensor.h"

namespace flame {

class StateDict {
 public:
  using Item = std::pair<std::string, Tensor>;

  StateDict() = default;
  StateDict(std::initializer_list<Item> items);

  // Adds a new name; raises if the name is already present.
  void insert(std::string name, Tensor t);
  // Adds or replaces (a replaced entry keeps its position).
  void set(std::string name, Tensor t);
  // Removes a name; returns whether it was present.
  bool erase(std::string_view name);

  bool contains(std::string_view name) const { return find(name) != nullptr; }
  // nullptr when absent.
  const Tensor* find(std::string_view name) const;
  // Raises flame::Error naming the key when absent.
  const Tensor& at(std::string_view name) const;

  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::vector<std::string> keys() const;
  // Total bytes of the tensors' elements.
  std::size_t nbytes() const;

  auto begin() const { return items_.cbegin(); }
  auto end() const { return items_.cend(); }
  const std::vector<Item>& items() const { return items_; }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, std::size_t> index_;
};

}  // namespace flame
