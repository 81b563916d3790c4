#pragma once
// Umbrella header: include this to use FLAME. flame/nn.h (layers), flame/checkpoint.h,
// flame/offload.h, flame/io/safetensors.h and flame/data.h (datasets, DataLoader) are included
// separately. <iostream> comes with it, so
// a first program can print (std::cout << x, x.sizes(), x.dtype(), x.device()).
#include <iostream>

#include "flame/amp.h"
#include "flame/anomaly.h"
#include "flame/autograd.h"
#include "flame/cpu.h"
#include "flame/cuda.h"
#include "flame/device.h"
#include "flame/dtype.h"
#include "flame/error.h"
#include "flame/float8.h"
#include "flame/ops.h"
#include "flame/optim.h"
#include "flame/profiler.h"
#include "flame/random.h"
#include "flame/recompute.h"
#include "flame/scalar.h"
#include "flame/state_dict.h"
#include "flame/stateful.h"
#include "flame/tensor.h"
#include "flame/version.h"
