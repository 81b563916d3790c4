// Sequential, ModuleList, ModuleDict (include/flame/nn/containers.h).
#include "flame/nn/containers.h"

namespace flame::nn {

void detail::bad_module_cast(const char* op, const std::string& key, const std::string& type) {
  FLAME_FAIL(op, "child '", key, "' is a ", type, ", not the requested module type");
}

namespace {
ModulePtr child_at(const std::vector<std::pair<std::string, ModulePtr>>& slots, std::size_t i, const char* op) {
  FLAME_CHECK(i < slots.size(), op, "index ", i, " is out of range for ", slots.size(), " modules");
  return slots[i].second;
}
}  // namespace

Sequential::Sequential(std::initializer_list<ModulePtr> modules) {
  for (const auto& m : modules) push_back(m);
}
Sequential::Sequential(const std::vector<ModulePtr>& modules) {
  for (const auto& m : modules) push_back(m);
}
Sequential& Sequential::push_back(ModulePtr module) {
  register_module(std::to_string(size()), std::move(module));
  return *this;
}
ModulePtr Sequential::operator[](std::size_t i) const { return child_at(child_slots(), i, "Sequential"); }
Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& [n, m] : child_slots()) y = (*m)(y);  // through operator(): the module path
  return y;
}

ModuleList::ModuleList(std::initializer_list<ModulePtr> modules) {
  for (const auto& m : modules) push_back(m);
}
ModuleList::ModuleList(const std::vector<ModulePtr>& modules) {
  for (const auto& m : modules) push_back(m);
}
ModuleList& ModuleList::push_back(ModulePtr module) {
  register_module(std::to_string(size()), std::move(module));
  return *this;
}
ModulePtr ModuleList::operator[](std::size_t i) const { return child_at(child_slots(), i, "ModuleList"); }

ModuleDict::ModuleDict(std::initializer_list<std::pair<std::string, ModulePtr>> items) {
  for (const auto& [k, m] : items) insert(k, m);
}
ModuleDict& ModuleDict::insert(const std::string& key, ModulePtr module) {
  register_module(key, std::move(module));
  return *this;
}
bool ModuleDict::contains(const std::string& key) const {
  for (const auto& [k, m] : child_slots()) {
    if (k == key) return true;
  }
  return false;
}
ModulePtr ModuleDict::operator[](const std::string& key) const {
  for (const auto& [k, m] : child_slots()) {
    if (k == key) return m;
  }
  FLAME_FAIL("ModuleDict", "no module under key '", key, "' (", size(), " keys)");
}
std::vector<std::string> ModuleDict::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, m] : child_slots()) out.push_back(k);
  return out;
}

}  // namespace flame::nn
