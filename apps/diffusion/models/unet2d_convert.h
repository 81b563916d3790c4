#pragma once
// The original (LDM / CompVis / SGM) single-file layout of the SD UNet, `model.diffusion_model.*`,
// mapped onto UNet2DConditionModel's diffusers names by a KeyPlan (Note [Key plans]).
//
// Note [UNet original layout]
// With L_b = layers_per_block[b] and the up blocks' L'_b = reversed(layers_per_block)[b]:
//   input_blocks.0.0                    conv_in
//   input_blocks.i.0 (i >= 1)           down_blocks.b.resnets.j      (i runs over the down blocks in
//   input_blocks.i.1                    down_blocks.b.attentions.j    order: L_b resnet slots, then
//   input_blocks.i.0.op                 down_blocks.b.downsamplers.0.conv   one downsampler slot)
//   middle_block.0 / .1 / .2            mid_block.resnets.0 / attentions.0 / resnets.1
//   output_blocks.i.0                   up_blocks.b.resnets.j        (L'_b + 1 slots per up block)
//   output_blocks.i.1                   up_blocks.b.attentions.j
//   output_blocks.i.{1|2}.conv          up_blocks.b.upsamplers.0.conv (1 without attention, 2 with)
//   time_embed.0 / .2                   time_embedding.linear_1 / linear_2
//   label_emb.0.0 / .0.2                add_embedding.linear_1 / linear_2 (text_time, SDXL)
//   out.0 / out.2                       conv_norm_out / conv_out
// Inside a resnet: in_layers.0 norm1, in_layers.2 conv1, emb_layers.1 time_emb_proj, out_layers.0
// norm2, out_layers.3 conv2, skip_connection conv_shortcut. Inside an attention the names are
// diffusers' already (norm, proj_in, transformer_blocks.k.{norm1,attn1.to_q,...,ff.net.2}, proj_out);
// proj_in/proj_out stored as a 1x1 conv [C, C, 1, 1] for a linear-projection config (or the other
// way round) are reshaped.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/checkpoint.h"
#include "models/key_plan.h"
#include "models/unet2d.h"

namespace flame_diffusion::models {

// The prefix of the UNet in an original single file.
inline constexpr const char* kUNetOriginalPrefix = "model.diffusion_model.";

// One entry per stored UNet key it can place, for the block layout of `config` (the stored keys
// are the file's: with the "model.diffusion_model." prefix, or bare when no key has it). Keys it
// cannot place (other models of a full checkpoint, EMA copies, layers this config does not have)
// appear in no entry.
KeyPlan unet_original_plan(const UNet2DConditionConfig& config,
                           const std::vector<std::pair<std::string, flame::Shape>>& stored);
// The same with the block layout read from the stored keys themselves (the downsampler and
// upsampler slots split the blocks): the plan of the registered format "unet-original".
KeyPlan unet_original_plan(const Checkpoint& ck, const std::string& prefix);

// The inverse: the original name (no prefix) of a diffusers key or module path of the UNet of
// `config` ("down_blocks.1.attentions.0.proj_in" -> "input_blocks.4.1.proj_in"), or nullopt for a
// name the original layout does not have. Kohya's SDXL LoRA files name modules this way.
std::optional<std::string> unet_original_name(const UNet2DConditionConfig& config, const std::string& diffusers_name);

// True when `keys` hold the original UNet layout (an input_blocks key under the prefix).
bool is_unet_original_layout(const std::vector<std::string>& keys);

// ---- loading ----
struct UNetLoadOptions {
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;
  // The architecture: `config` when set, else `config_json` (a path) when set, else the diffusers
  // folder's config.json, else (a single file) the preset of `family` ("sdxl", "sd15", "sd21"),
  // guessed from the keys when empty (label_emb: sdxl; cross-attention width 768: sd15, 1024: sd21).
  std::optional<UNet2DConditionConfig> config;
  std::string config_json;
  std::string family;
  std::string variant;          // diffusers folders: "fp16" prefers the .fp16 weights
  bool allow_unplaced = false;  // tolerate stored UNet keys that map to no parameter
};

struct UNetFileInfo {
  std::string description;  // Checkpoint::description()
  std::string format;       // "unet-diffusers" or "unet-original"
  std::string prefix;       // stored-key prefix ("model.diffusion_model.", "")
  std::string family;       // the preset used, or "config" when a config gave the architecture
  UNet2DConditionConfig config;
};
UNetFileInfo inspect_unet(const Checkpoint& ck, const UNetLoadOptions& options = {});
// A folder (diffusers model folder, or pipeline folder: unet/) or a .safetensors file. The model
// is built in options' dtype and device and every tensor streamed there (load_checkpoint).
std::shared_ptr<UNet2DConditionModel> load_unet(const std::string& path, const UNetLoadOptions& options = {});
std::shared_ptr<UNet2DConditionModel> load_unet(const Checkpoint& ck, const UNetLoadOptions& options = {});
// Makes sure the UNet formats are registered (load_unet calls it).
void register_unet_formats();

}  // namespace flame_diffusion::models
