#pragma once
// How a checkpoint's stored tensors become a model's parameters (Note [Key plans]).
//
// Note [Key plans]
// Every model in models/ names its parameters exactly as diffusers' state dict does
// ("down_blocks.0.resnets.0.conv1.weight"), so a diffusers file loads key for key. Other layouts
// (the original single-file checkpoints: "model.diffusion_model.input_blocks.1.0.in_layers.0.weight",
// "first_stage_model.encoder.down.0.block.0.conv1.weight", FLUX/SD3 "ae.safetensors") are
// converted by a *plan*: one KeyPlanEntry per diffusers key, saying which stored tensors it comes
// from and how. A plan is built from the key names and shapes alone (no tensor data), so the loader
// can check it against the file before reading anything, name every key it cannot place, and then
// stream each tensor straight to its device (memory-mapped file -> pinned staging -> GPU): no host
// copy of the checkpoint is ever made.
#include <cstdint>
#include <string>
#include <vector>

#include "flame/tensor.h"

namespace flame_diffusion::models {

struct KeyPlanEntry {
  enum class Op {
    kCopy,     // target = source[0] (its shape must equal the target's)
    kReshape,  // target = source[0] reshaped to `shape` (e.g. a 1x1 conv [C, C, 1, 1] -> Linear [C, C])
    kConcat,   // target = cat(sources, dim)
    kChunk,    // target = chunk `index` of `count` equal pieces of source[0] along dim (fused qkv)
    kTranspose,  // target = source[0] transposed (2-d; OpenCLIP's text_projection is stored [in, out])
    kScale,      // target = source[0] * source[1], both read in f32, then converted (fp8 weights with
                 // a "scale_weight" of one element or a shape that broadcasts)
    kSwapHalves,  // target = source[0] with its two halves along dim exchanged (the original MMDiT/BFL
                  // final adaLN_modulation stores shift, scale; diffusers' AdaLayerNormContinuous scale, shift)
  };
  // kChunk and kSwapHalves: a second source, when present, is a one-element scale the result is
  // multiplied by (in f32): the "scale_weight" of an fp8-scaled file's fused or swapped tensor.
  std::string target;                // the diffusers key
  std::vector<std::string> sources;  // keys in the stored file
  Op op = Op::kCopy;
  flame::Shape shape;     // kReshape: the target shape
  int64_t dim = 0;        // kConcat, kChunk
  int64_t index = 0;      // kChunk
  int64_t count = 1;      // kChunk
  // kChunk: how many consecutive pieces, from `index`, the target takes (FLUX's single-block linear1
  // stores q, k, v and the 4x-wide MLP input: the MLP is pieces 3..6 of 7).
  int64_t pieces = 1;
};

// A converter for one family's stored layout: the plan (one entry per diffusers key it produces)
// and the stored keys it consumed. Stored keys consumed by no entry are reported as unplaced.
struct KeyPlan {
  std::vector<KeyPlanEntry> entries;
  // The stored keys this plan answers for: every stored key that starts with it must be consumed by
  // some entry (else it is reported as unplaced); keys outside it belong to other models of the
  // same file (a full SDXL checkpoint holds the UNet, the VAE and the text encoders). "" = all.
  std::string source_prefix;
  // Stored keys under source_prefix that are known and deliberately not loaded (a non-persistent
  // buffer some writers save, a tied copy of another tensor, a format marker): not reported as
  // unplaced.
  std::vector<std::string> ignored;
};

// "copy", "reshape", "concat", "chunk", "transpose", "scale" (for messages).
const char* to_string(KeyPlanEntry::Op op);

}  // namespace flame_diffusion::models
