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
  const Device device = module_device(module);
  const StateDict own = module.state_dict();
  bool eight_bit = false;  // an 8-bit Linear (flame/nn/float8.h): its F8 weights load as they are
  for (const auto& [k, t] : own) eight_bit = eight_bit || is_float8(t.dtype());
  if (!eight_bit) return module.load_state_dict(io::load_safetensors(path, device), strict);
  const io::SafetensorsFile file(path);
  StateDict dict;
  for (const std::string& k : file.names()) {
    const Tensor* mine = own.find(k);
    const auto& stored = file.info(k).flame_dtype;
    const bool keep = mine && is_float8(mine->dtype()) && stored && is_float8(*stored);
    dict.insert(k, file.load(k, device, keep ? stored : std::nullopt));
  }
  return module.load_state_dict(dict, strict);
}

void save_lora(Module& module, const std::string& path, const io::Metadata& metadata) {
  io::save_safetensors(path, lora_state_dict(module), metadata);
}

LoadReport load_lora(Module& module, const std::string& path, bool strict) {
  return load_lora_state_dict(module, io::load_safetensors(path, module_device(module)), strict);
}

}  // namespace flame::nn
