#pragma once
// The switches and counters of the epilogue GEMM autotuning (flame::cuda::set_epilogue_autotune,
// docs/epi.md), shared by the public API (epi_tune.cpp, built with or without CUDA) and the
// CUDA backend's planner (src/backend/cuda/epi/linear_epilogue.cu).
#include <cstdint>

#include "flame/cuda.h"

namespace flame::backend::epi_tune {

// 0: off, 1: on, 2: on and each choice printed to stderr. The first read takes
// FLAME_EPI_AUTOTUNE from the environment unless set_epilogue_autotune came first.
int level();

void count_plan(bool tuned, bool column_sum);
void count_timed(uint64_t candidates);

}  // namespace flame::backend::epi_tune
