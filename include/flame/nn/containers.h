#pragma once
// Containers: Sequential (chains forward), ModuleList (indexed), ModuleDict (named). Children of
// Sequential and ModuleList are named "0", "1", ... as in PyTorch, so a model's state-dict keys
// read `layers.3.weight` on both sides.
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flame/nn/module.h"

namespace flame::nn {

namespace detail {
[[noreturn]] void bad_module_cast(const char* op, const std::string& key, const std::string& type);
}

class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<ModulePtr> modules);
  explicit Sequential(const std::vector<ModulePtr>& modules);
  std::string name() const override { return "Sequential"; }
  // Appends a child named by its position.
  Sequential& push_back(ModulePtr module);
  std::size_t size() const { return child_slots().size(); }
  ModulePtr operator[](std::size_t i) const;
  // The i-th child as T; error naming its actual type when it is not a T.
  template <class T>
  std::shared_ptr<T> at(std::size_t i) const {
    auto p = std::dynamic_pointer_cast<T>((*this)[i]);
    if (!p) detail::bad_module_cast("Sequential::at", std::to_string(i), (*this)[i]->name());
    return p;
  }
  // Applies the children in order (an empty Sequential is the identity).
  Tensor forward(const Tensor& x) override;
};

class ModuleList : public Module {
 public:
  ModuleList() = default;
  ModuleList(std::initializer_list<ModulePtr> modules);
  explicit ModuleList(const std::vector<ModulePtr>& modules);
  std::string name() const override { return "ModuleList"; }
  ModuleList& push_back(ModulePtr module);
  std::size_t size() const { return child_slots().size(); }
  bool empty() const { return child_slots().empty(); }
  ModulePtr operator[](std::size_t i) const;
  template <class T>
  std::shared_ptr<T> at(std::size_t i) const {
    auto p = std::dynamic_pointer_cast<T>((*this)[i]);
    if (!p) detail::bad_module_cast("ModuleList::at", std::to_string(i), (*this)[i]->name());
    return p;
  }
  // Iterates the children (shared_ptr<Module>) in order.
  class Iterator {
   public:
    using Base = std::vector<std::pair<std::string, ModulePtr>>::const_iterator;
    explicit Iterator(Base it) : it_(it) {}
    const ModulePtr& operator*() const { return it_->second; }
    Iterator& operator++() {
      ++it_;
      return *this;
    }
    bool operator==(const Iterator& o) const { return it_ == o.it_; }
    bool operator!=(const Iterator& o) const { return it_ != o.it_; }

   private:
    Base it_;
  };
  Iterator begin() const { return Iterator(child_slots().begin()); }
  Iterator end() const { return Iterator(child_slots().end()); }
};

class ModuleDict : public Module {
 public:
  ModuleDict() = default;
  ModuleDict(std::initializer_list<std::pair<std::string, ModulePtr>> items);
  std::string name() const override { return "ModuleDict"; }
  // Adds a new key (error if present); insertion order is kept.
  ModuleDict& insert(const std::string& key, ModulePtr module);
  bool contains(const std::string& key) const;
  ModulePtr operator[](const std::string& key) const;  // error naming the key when absent
  template <class T>
  std::shared_ptr<T> at(const std::string& key) const {
    auto p = std::dynamic_pointer_cast<T>((*this)[key]);
    if (!p) detail::bad_module_cast("ModuleDict::at", key, (*this)[key]->name());
    return p;
  }
  std::size_t size() const { return child_slots().size(); }
  std::vector<std::string> keys() const;
  // (key, module) pairs in insertion order.
  const std::vector<std::pair<std::string, ModulePtr>>& items() const { return child_slots(); }
  auto begin() const { return child_slots().begin(); }
  auto end() const { return child_slots().end(); }
};

}  // namespace flame::nn
