#include "flame/state_dict.h"

#include "flame/error.h"

namespace flame {

StateDict::StateDict(std::initializer_list<Item> items) {
  for (const auto& [name, t] : items) insert(name, t);
}

void StateDict::insert(std::string name, Tensor t) {
  FLAME_CHECK(!index_.contains(name), "StateDict::insert", "duplicate name '", name, "'");
  index_.emplace(name, items_.size());
  items_.emplace_back(std::move(name), std::move(t));
}

void StateDict::set(std::string name, Tensor t) {
  auto it = index_.find(name);
  if (it != index_.end()) {
    items_[it->second].second = std::move(t);
    return;
  }
  insert(std::move(name), std::move(t));
}

bool StateDict::erase(std::string_view name) {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) return false;
  std::size_t pos = it->second;
  index_.erase(it);
  items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(pos));
  for (auto& [key, i] : index_)
    if (i > pos) --i;
  return true;
}

const Tensor* StateDict::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

const Tensor& StateDict::at(std::string_view name) const {
  const Tensor* t = find(name);
  FLAME_CHECK(t != nullptr, "StateDict::at", "no tensor named '", std::string(name), "' (", items_.size(),
              " entries)");
  return *t;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  out.reserve(items_.size());
  for (const auto& item : items_) out.push_back(item.first);
  return out;
}

std::size_t StateDict::nbytes() const {
  std::size_t n = 0;
  for (const auto& item : items_) n += item.second.nbytes();
  return n;
}

}  // namespace flame
