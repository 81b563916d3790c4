#pragma once
// Umbrella header for flame::nn: modules, containers, layers, init, LoRA. See docs/nn.md.
#include "flame/nn/activation.h"
#include "flame/nn/containers.h"
#include "flame/nn/dropout.h"
#include "flame/nn/embedding.h"
#include "flame/nn/flatten.h"
#include "flame/nn/init.h"
#include "flame/nn/linear.h"
#include "flame/nn/lora.h"
#include "flame/nn/module.h"
