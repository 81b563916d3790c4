// Module state dicts through safetensors files (include/flame/nn/serialization.h).
#include "flame/nn/serialization.h"

namespace flame::nn {
namespace {
Device module_device(const Module& m) {
  for (const auto& p : m.parameters()) return p.device();
  for (const auto& b : m.buffers()) return b.device();
  return Device::cpu();
}
}  // namespace

void save_state_dict(const Module& module, const std::string& path, const io::Metadata& metadata) {
  io::save_safetensors(path, module.state_dict(), metadata);
}

LoadReport load_state_dict(Module& module, const std::string& path, bool strict) {
  return module.load_state_dict(io::load_safetensors(path, module_device(module)), strict);
}

void save_lora(Module& module, const std::string& path, const io::Metadata& metadata) {
  io::save_safetensors(path, lora_state_dict(module), metadata);
}

LoadReport load_lora(Module& module, const std::string& path, bool strict) {
  return load_lora_state_dict(module, io::load_safetensors(path, module_device(module)), strict);
}

}  // namespace flame::nn
