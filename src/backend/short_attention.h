#pragma once
// The switch and counters of FLAME's short-sequence attention kernels
// (flame::cuda::set_short_attention; Note [Short-sequence attention] in
// src/backend/cuda/attention/sdpa_short.cu), shared by the public API (short_attention.cpp, built
// with or without CUDA) and the CUDA backend's SDPA entry points.
#include "flame/cuda.h"

namespace flame::backend::short_attention {

// The first read takes FLAME_SHORT_ATTENTION from the environment unless set_short_attention
// came first.
bool enabled();
void count(bool forward);

}  // namespace flame::backend::short_attention
