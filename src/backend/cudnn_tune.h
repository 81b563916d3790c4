#pragma once
// The switch and counters of cuDNN plan autotuning (flame::cuda::set_cudnn_autotune; Note
// [cuDNN autotuning] in src/backend/cuda/cudnn_autotune.h), shared by the public API
// (cudnn_tune.cpp, built with or without CUDA) and the CUDA backend's conv and SDPA planners.
#include <cstdint>

#include "flame/cuda.h"

namespace flame::backend::cudnn_tune {

// 0: off, 1: on, 2: on and each choice printed to stderr. The first read takes
// FLAME_CUDNN_AUTOTUNE from the environment unless set_cudnn_autotune came first.
int level();

void count_tuned(uint64_t candidates);

}  // namespace flame::backend::cudnn_tune
