#pragma once
// Frozen base weights in 8-bit floats (docs/float8.md): a Linear whose weight is stored as
// f8_e4m3fn (or f8_e5m2) with one f32 scale per output channel, used either dequantised into the
// ordinary GEMM (memory saving) or through FP8 GEMMs (memory and speed, CUDA on compute
// capability 8.9 and later).
//
//   nn::quantize_float8(*model, {.compute = nn::Float8Compute::fp8});   // every frozen Linear
//   model->forward(...)                                                // adapters stay bf16/f32
//
// Note [Float8 Linear]
// The weight W [out, in] is stored as q = to_float8(W, f8, s) with s = float8_scale(W, f8, 0)
// (per output row: amax / float8_max), so W ~ q * s. The layer computes y = x W^T + b in one of
// two ways:
//   dequantize  W is rebuilt as q * s in x's compute dtype (autocast's low dtype, else x's) just
//               before the GEMM and dropped after it; the backward rebuilds it again. Only the
//               8-bit weight stays resident: half of bf16's bytes, a quarter of f32's.
//   fp8         x is quantised per row (each row's amax onto float8_max(e4m3fn), its f32 scale
//               kept) and one FP8 GEMM gives y = diag(sx) (xq q^T) diag(s) + b. The backward casts
//               dy * s (the weight scale folded in per column) per row to the gradient's 8-bit
//               dtype and runs a second FP8 GEMM against q (transposed for the GEMM's layout).
//               Where the device has no FP8 GEMM (the CPU, an older GPU, a K that is not a multiple
//               of 16) the same quantised values are multiplied by ordinary ops in f32: the CPU
//               reference of the same math.
// In both modes the node keeps q and s (the parameters themselves) and no activation: the weight
// is frozen, so x is never needed for a weight gradient. x and the bias get gradients; q and s
// never do.
#include <cstdint>
#include <functional>
#include <string>

#include "flame/dtype.h"
#include "flame/nn/linear_float8.h"
#include "flame/tensor.h"

namespace flame::nn {

class Module;
class Linear;

struct Float8Options {
  DType dtype = DType::f8_e4m3fn;  // the stored weight: f8_e4m3fn (more precision) or f8_e5m2
  Float8Compute compute = Float8Compute::dequantize;
  // fp8 only: the backward's gradient cast, f8_e4m3fn (per-row scales keep its range) or f8_e5m2.
  DType grad_dtype = DType::f8_e4m3fn;
};

struct Float8Report {
  int64_t layers = 0;         // Linears converted
  int64_t bytes_before = 0;   // their weights' bytes before
  int64_t bytes_after = 0;    // their 8-bit weights' and scales' bytes
};

// Converts every Linear under root (root included) whose weight does not require a gradient, and
// that `filter` accepts (given the module's dotted name; empty: all), to an 8-bit weight
// (Linear::to_float8). Layers already in 8 bits are skipped. Call it after loading the weights
// and after attaching adapters (apply_lora freezes the base): a weight that requires a gradient
// stays as it is.
Float8Report quantize_float8(Module& root, const Float8Options& options = {},
                             const std::function<bool(const std::string&, const Linear&)>& filter = {});

}  // namespace flame::nn
