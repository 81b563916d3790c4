#pragma once
// Umbrella header of flame::io (reading and writing tensors to files).
#include "flame/io/safetensors.h"
