#pragma once
// A module's state dict to and from a safetensors file (flame/io/safetensors.h), with PyTorch's key
// names, so `model.load_state_dict(safetensors.torch.load_file(path))` reads what save_state_dict
// writes and the other way round.
//
//   nn::save_state_dict(*model, "model.safetensors", {{"step", "1000"}});
//   nn::LoadReport r = nn::load_state_dict(*model, "model.safetensors", /*strict=*/false);
#include <string>

#include "flame/io/safetensors.h"
#include "flame/nn/lora.h"
#include "flame/nn/module.h"

namespace flame::nn {

// Parameters and persistent buffers, each written from its device (GPU tensors one at a time).
void save_state_dict(const Module& module, const std::string& path, const io::Metadata& metadata = {});
// Loads the file onto the device of the module's first parameter (or buffer; CPU for a module with
// neither), then copies values into the existing tensors (identity kept). strict as
// Module::load_state_dict. An 8-bit weight of the module (Linear::to_float8) takes an F8-stored
// tensor as its codes.
LoadReport load_state_dict(Module& module, const std::string& path, bool strict = true);
// LoRA adapters only, with PEFT's key names (lora_state_dict in lora.h), and back.
void save_lora(Module& module, const std::string& path, const io::Metadata& metadata = {});
LoadReport load_lora(Module& module, const std::string& path, bool strict = true);

}  // namespace flame::nn
