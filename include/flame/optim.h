#pragma once
// Umbrella header for flame::optim: the optimizer base, SGD/Adam/AdamW/Lion/Adafactor, learning
// rate schedulers and the EMA of weights. See docs/optim.md and docs/training.md.
#include "flame/optim/ema.h"
#include "flame/optim/optimizer.h"
#include "flame/optim/optimizers.h"
#include "flame/optim/scheduler.h"
