#pragma once
// LoRA files in the layouts other tools load (Note [LoRA file layouts]).
//
//   flux->add_lora({.rank = 16, .alpha = 16});  ...train...
//   save_lora("style.safetensors", *flux, LoraFamily::kFlux, LoraFileFormat::kKohya, {{"ss_network_dim", "16"}});
//   auto fresh = load_flux("FLUX.1-dev", ...);
//   LoraLoadReport r = load_lora("style.safetensors", *fresh, LoraFamily::kFlux);   // any layout
//
// Note [LoRA file layouts]
// FLAME's adapters live inside Linear layers named as diffusers names them (nn/lora.h). A file
// holds them as one of:
//   peft       base_model.model.<module>.lora_A.weight / .lora_B.weight (+ .lora_magnitude_vector):
//              what PEFT's save_pretrained writes (nn::lora_state_dict).
//   diffusers  transformer.<module>.lora_A.weight (FLUX, SD3), unet.<module>... (SDXL), with the
//              adapter configuration (r, lora_alpha, rank_pattern, alpha_pattern, target_modules,
//              use_dora) as JSON in the "lora_adapter_metadata" entry, each key prefixed
//              "transformer." / "unet.": what the pipelines' save_lora_weights writes.
//   kohya      <stem>.lora_down.weight [r, in], <stem>.lora_up.weight [out, r], <stem>.alpha (f32
//              scalar; the scaling is alpha / r), DoRA <stem>.dora_scale [out]: what kohya's
//              sd-scripts write and ComfyUI / Forge load. The stems:
//                FLUX   lora_unet_ + the BFL module path, '.' -> '_': double_blocks_{i}_img_attn_qkv
//                       (to_q, to_k, to_v fused by rows), _img_attn_proj (to_out.0), _txt_attn_qkv
//                       (add_q_proj, add_k_proj, add_v_proj), _txt_attn_proj (to_add_out),
//                       _img_mlp_0/_2, _txt_mlp_0/_2, _img_mod_lin, _txt_mod_lin;
//                       single_blocks_{i}_linear1 (to_q, to_k, to_v, proj_mlp fused by rows),
//                       _linear2 (proj_out), _modulation_lin; img_in, txt_in, time_in_*, vector_in_*,
//                       guidance_in_*, final_layer_linear, final_layer_adaLN_modulation_1 (its
//                       halves swapped: BFL stores shift, scale).
//                SD3    lora_transformer_ + the diffusers module path (SimpleTuner / ComfyUI).
//                SDXL   lora_unet_ + the original SGM module path
//                       (lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q).
//              Read also: FLUX lora_transformer_ + diffusers path, SDXL lora_unet_ + diffusers path.
// Fusing (writing): the separate adapters (A_m [r_m, in], B_m, scaling s_m) of the modules of one
// fused layer become one adapter of rank R = sum r_m: lora_down = cat(A_m) [R, in], lora_up
// block-diagonal [out_fused, R] (B_m * s_m / s in module m's rows and columns, zeros elsewhere:
// rows of a part without an adapter, as linear1's MLP rows), alpha = s * R with s the first
// module's scaling, so up @ down * alpha / R is the sum of the modules' updates.
// Unfusing (reading) is exact: module m takes the rows of up that are its own. A file trained on
// the fused layer (dense up) gives every module rank R with the shared A = down; a block-diagonal
// up (as written above) gives each module the columns its rows use. Into a model that already has
// adapters: rank R or, when the existing ranks of the layer's modules sum to R and up is zero off
// their diagonal blocks, each module its own block; otherwise an error naming the key and shapes.
//
// Note [LoKr files]
// LoKr adapters (nn::apply_lokr) are written in the kohya layout only, as LyCORIS' kohya wrapper
// writes them and ComfyUI / Forge load them: <stem>.lokr_w1 [a, b] or .lokr_w1_a [a, r] and
// .lokr_w1_b [r, b]; .lokr_w2 [c, d] or .lokr_w2_a [c, r] and .lokr_w2_b [r, d]; .alpha = scale * r
// (r when both factors are whole; the scale is then 1), the stems those of the LoRA layout above.
// A fused kohya FLUX layer (qkv, linear1) or the reordered final_layer_adaLN_modulation_1 cannot
// hold a LoKr of its separate modules, so those modules are written per module under their
// lora_transformer_<diffusers path> stems (ComfyUI maps them onto the rows of the fused weight);
// the file's ss_network_module is then lycoris.kohya. peft / diffusers files with LoKr adapters
// are refused (nn::lora_state_dict keeps them as lokr_* keys for checkpoints).
// Reading creates LoKr adapters with the file's factor shapes and scale (alpha / r, 1 without
// .alpha or with whole factors, as ComfyUI). A LoKr of a fused FLUX layer (a file trained on BFL's
// modules) is split exactly when each module's rows are whole blocks of w2's c rows (module m takes
// its rows of w1 or w1_a and the shared w2); otherwise an error names the stem and shapes. LoHa,
// Tucker LoKr (lokr_t2) and LoKr with weight decomposition (dora_scale) are refused.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

namespace flame_diffusion::models {

enum class LoraFamily { kFlux, kSD3, kSDXL };
enum class LoraFileFormat { kPeft, kDiffusers, kKohya };

// "flux", "sd3", "sdxl" / "peft", "diffusers", "kohya" (file metadata, messages); parse raises
// naming the string and the accepted names.
const char* to_string(LoraFamily family);
const char* to_string(LoraFileFormat format);
LoraFamily lora_family_from_string(const std::string& name);
LoraFileFormat lora_format_from_string(const std::string& name);

// Writes the adapters of `model` (a FluxTransformer2DModel, SD3Transformer2DModel or
// UNet2DConditionModel with adapters) to `path` in `format`. The file's metadata: format "pt",
// lora_format, lora_family, lora_rank and lora_alpha (the most common of the file), for kohya
// ss_network_dim, ss_network_alpha, ss_network_module and ss_base_model_version; then `metadata`
// (the caller's: base model, resolution, steps, dataset size ...), which wins on equal keys. A peft
// file named adapter_model.safetensors gets PEFT's adapter_config.json beside it. Raises
// naming the module when an adapted module has no name in the layout (kohya FLUX: a Linear BFL's
// layout does not have), when the model has no adapter, or when the model is not of `family`.
// LoKr adapters: kohya only (Note [LoKr files]).
void save_lora(const std::string& path, flame::nn::Module& model, LoraFamily family, LoraFileFormat format,
               const std::map<std::string, std::string>& metadata = {});

struct LoraLoadReport {
  LoraFileFormat format = LoraFileFormat::kPeft;
  std::vector<std::string> loaded;   // modules whose existing adapter got the file's values
  std::vector<std::string> created;  // modules given a new adapter (rank and alpha from the file)
  std::vector<std::string> skipped;  // file keys deliberately not loaded (text encoders)
  std::vector<std::string> untouched;  // adapted modules of the model that the file does not cover
  std::map<std::string, std::string> metadata;  // the file's
};

// Reads a LoRA file of any layout of Note [LoRA file layouts] or LoKr keys (Note [LoKr files]),
// detected from its keys, into `model`: modules without an adapter get one (rank from the file; alpha from the file's .alpha,
// its adapter metadata or lora_alpha / ss_network_alpha, else alpha = rank), modules with one get
// the file's values with the update rescaled to their scaling (rank mismatch: error naming the key
// and both shapes). Creating an adapter freezes the model's other parameters (as apply_lora).
// Text-encoder keys (lora_te*, text_encoder*) are skipped and listed. Errors (flame::Error) name the
// file and the first keys it could not place; a file of another family says so ("looks like an SDXL
// LoRA; the model is FLUX"); LoHa keys are refused as unsupported. Modules with a LoKr adapter take
// a LoKr of the same layout (else an error). Nothing is changed in the model unless the whole file places.
LoraLoadReport load_lora(const std::string& path, flame::nn::Module& model, LoraFamily family);

// A base checkpoint with the LoRA merged in: folds the adapters of `model` into its weights
// (nn::merge_lora, DoRA included) and writes every parameter and persistent buffer except the
// adapters' under the model's diffusers names (the "*-diffusers" single-file layout load_flux,
// load_sd3 and load_unet read), floating tensors converted to `dtype` when given, with `metadata`.
// The model is unmerged again afterwards (its adapters keep training). Raises if no adapter.
void save_merged_checkpoint(const std::string& path, flame::nn::Module& model,
                            std::optional<flame::DType> dtype = std::nullopt,
                            const std::map<std::string, std::string>& metadata = {});

// The family a set of LoRA keys belongs to by their module names, or "" when they do not say.
std::string guess_lora_family(const std::vector<std::string>& keys);

}  // namespace flame_diffusion::models
