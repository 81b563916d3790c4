// The fused kernels' registry entries (Note [Fused kernels]); their implementations register
// themselves from the backends' files.
#include "src/backend/fused/adaln.h"
#include "src/backend/fused/adamw8bit.h"
#include "src/backend/fused/float8.h"
#include "src/backend/fused/linear_epilogue.h"
#include "src/backend/fused/matmul_add.h"
#include "src/backend/fused/multi_tensor.h"
#include "src/backend/fused/rms_norm_rotary.h"
#include "src/backend/fused/rotary.h"

namespace flame::backend::fused {

constinit decltype(linear_bias_act) linear_bias_act{"linear_bias_act"};
constinit decltype(linear_wgrad_bgrad) linear_wgrad_bgrad{"linear_wgrad_bgrad"};
constinit decltype(linear_dgelu_bgrad) linear_dgelu_bgrad{"linear_dgelu_bgrad"};
constinit decltype(gelu_tanh_backward) gelu_tanh_backward{"gelu_tanh_backward"};
constinit decltype(matmul_add) matmul_add{"matmul_add"};
constinit decltype(adaln_forward) adaln_forward{"adaln_forward"};
constinit decltype(adaln_backward) adaln_backward{"adaln_backward"};
constinit decltype(adaln_residual_forward) adaln_residual_forward{"adaln_residual_forward"};
constinit decltype(gated_residual_forward) gated_residual_forward{"gated_residual_forward"};
constinit decltype(gated_residual_backward) gated_residual_backward{"gated_residual_backward"};
constinit decltype(optim_step) optim_step{"optim_step"};
constinit decltype(ema_update) ema_update{"ema_update"};
constinit decltype(adamw8bit_step) adamw8bit_step{"adamw8bit_step"};
constinit decltype(ema_update_device) ema_update_device{"ema_update_device"};
constinit decltype(foreach_norm_accumulate) foreach_norm_accumulate{"foreach_norm_accumulate"};
constinit decltype(foreach_clip_scale) foreach_clip_scale{"foreach_clip_scale"};
constinit decltype(amp_unscale) amp_unscale{"amp_unscale"};
constinit decltype(rotary_embedding) rotary_embedding{"rotary_embedding"};
constinit decltype(rms_norm_rotary_forward) rms_norm_rotary_forward{"rms_norm_rotary_forward"};
constinit decltype(rms_norm_rotary_backward) rms_norm_rotary_backward{"rms_norm_rotary_backward"};
constinit decltype(float8_quantize_rows) float8_quantize_rows{"float8_quantize_rows"};
constinit decltype(float8_dequantize_rows) float8_dequantize_rows{"float8_dequantize_rows"};
constinit decltype(float8_gemm) float8_gemm{"float8_gemm"};
constinit decltype(float8_gemm_path) float8_gemm_path{"float8_gemm_path"};

}  // namespace flame::backend::fused
