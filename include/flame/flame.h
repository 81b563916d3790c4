#pragma once
// Umbrella header: include this to use FLAME.
#include "flame/autograd.h"
#include "flame/cpu.h"
#include "flame/cuda.h"
#include "flame/device.h"
#include "flame/dtype.h"
#include "flame/error.h"
#include "flame/ops.h"
#include "flame/random.h"
#include "flame/scalar.h"
#include "flame/state_dict.h"
#include "flame/tensor.h"
#include "flame/version.h"
