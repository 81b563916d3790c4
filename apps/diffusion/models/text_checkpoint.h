#pragma once
// The text encoders' files (Note [Checkpoint files] in checkpoint.h) and their loaders.
//
// Note [Text encoder files]
// Layouts (registered formats, kind "clip" or "t5"), each found under any of its prefixes:
//   clip-transformers  transformers' names (text_model.*, text_projection.weight): a transformers
//                      folder (text_encoder/, text_encoder_2/), ComfyUI clip_l.safetensors /
//                      clip_g.safetensors (bare), SDXL "conditioner.embedders.0.transformer." (CLIP-L),
//                      SD3 "text_encoders.clip_l.transformer." / "text_encoders.clip_g.transformer.",
//                      SD 1.x "cond_stage_model.transformer.";
//   clip-openclip      OpenCLIP's names: SDXL "conditioner.embedders.1.model." (bigG; the refiner's
//                      "conditioner.embedders.0.model."), SD 2.x "cond_stage_model.model.", bare:
//                      token_embedding.weight, positional_embedding, transformer.resblocks.N.{ln_1,
//                      attn.in_proj_weight/bias (q, k, v fused: chunks 0..2 of dim 0), attn.out_proj,
//                      ln_2, mlp.c_fc, mlp.c_proj}, ln_final, text_projection (stored [width, proj]:
//                      transposed to the Linear's [proj, width]);
//   t5-transformers    transformers' names (shared.weight, encoder.*): a transformers folder
//                      (text_encoder_3/ of SD3, text_encoder_2/ of FLUX), ComfyUI t5xxl_fp16.safetensors
//                      (bare), SD3 "text_encoders.t5xxl.transformer.". fp8 files load too: F8_E4M3 /
//                      F8_E5M2 tensors are decoded on load, and the "scaled" variant (a "scaled_fp8"
//                      marker key, a "<module>.scale_weight" beside each fp8 weight) loads
//                      weight * scale_weight (computed in f32, then converted to the model's dtype);
//                      encoder.embed_tokens.weight is the tied copy of shared.weight (loaded as it
//                      when shared.weight is absent).
// Keys some writers add and the model does not use are skipped: text_model.embeddings.position_ids,
// logit_scale, OpenCLIP's attn_mask, fp8 scale_input.
//
// Which encoder (a full SDXL checkpoint holds two, an SD3 one three): `family` picks it — "clip-l"
// is the one under a CLIP-L prefix (embedders.0.transformer., clip_l, cond_stage_model.transformer.),
// "clip-g" the one under a bigG prefix (embedders.1.model., clip_g); a bare file's family is
// guessed from its width (768 clip-l, 1280 clip-g). A file with one encoder needs no family.
//
// Configuration: config.json of a transformers folder, or `config_json`; without one, the family's
// preset with the sizes read from the shapes (vocabulary, width, positions, layers, MLP width,
// projection; T5: d_model, d_ff, layers, heads from the bias table, d_kv). What shapes cannot say
// comes from the preset: CLIP's heads (12 for width 768, 20 for 1280, else width / 64), activation
// and eos rule; T5's max_distance (128) and eps (1e-6).
#include <memory>
#include <string>
#include <vector>

#include "models/checkpoint.h"
#include "models/clip_text.h"
#include "models/t5_encoder.h"

namespace flame_diffusion::models {

struct TextEncoderLoadOptions {
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;
  // "clip-l", "clip-g", "t5-xxl" or "" (Note [Text encoder files]).
  std::string family;
  // A config.json to build the model from when the checkpoint has none.
  std::string config_json;
  // Pipeline folders: the model's subfolder; "" picks text_encoder/ for clip-l (and no family),
  // text_encoder_2/ for clip-g, text_encoder_3/ or else text_encoder_2/ (FLUX) for T5.
  std::string subfolder;
  std::string variant;          // "fp16" prefers model.fp16.safetensors
  bool allow_unplaced = false;  // tolerate stored keys under the prefix that map to no parameter
};

// One text encoder a file holds (from its headers alone).
struct TextEncoderEntry {
  std::string format;  // registered name
  std::string prefix;  // stored-key prefix
  std::string family;  // "clip-l", "clip-g", "t5-xxl" or "custom" (guessed from prefix and width)
  std::string kind;    // "clip" or "t5"
};
// Every text encoder `ck` holds, in the order of Note [Text encoder files].
std::vector<TextEncoderEntry> find_text_encoders(const Checkpoint& ck);

struct ClipFileInfo {
  std::string description;
  TextEncoderEntry entry;
  ClipTextConfig config;
};
struct T5FileInfo {
  std::string description;
  TextEncoderEntry entry;
  bool fp8_scaled = false;  // the "scaled_fp8" variant
  T5EncoderConfig config;
};
ClipFileInfo inspect_clip_text(const Checkpoint& ck, const std::string& family = "", const std::string& config_json = "");
T5FileInfo inspect_t5_encoder(const Checkpoint& ck, const std::string& config_json = "");

// Opens `path` (a transformers folder, a pipeline folder, or a .safetensors file) as the loaders do.
Checkpoint open_text_encoder_checkpoint(const std::string& path, const std::string& kind,
                                        const TextEncoderLoadOptions& options);

std::shared_ptr<ClipTextModel> load_clip_text(const std::string& path, const TextEncoderLoadOptions& options = {});
std::shared_ptr<ClipTextModel> load_clip_text(const Checkpoint& ck, const TextEncoderLoadOptions& options = {});
std::shared_ptr<T5EncoderModel> load_t5_encoder(const std::string& path, const TextEncoderLoadOptions& options = {});
std::shared_ptr<T5EncoderModel> load_t5_encoder(const Checkpoint& ck, const TextEncoderLoadOptions& options = {});

// The plans of the layouts (transformers' names <- stored keys under `prefix`).
KeyPlan clip_openclip_plan(const Checkpoint& ck, const std::string& prefix);
KeyPlan clip_transformers_plan(const Checkpoint& ck, const std::string& prefix);
// transformers 5's files of CLIPTextModel(WithProjection): no "text_model." level in the keys.
KeyPlan clip_flat_plan(const Checkpoint& ck, const std::string& prefix);
KeyPlan t5_transformers_plan(const Checkpoint& ck, const std::string& prefix);
// Makes sure the text encoder formats are registered (the loaders call it).
void register_text_formats();

}  // namespace flame_diffusion::models
