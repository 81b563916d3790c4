#pragma once
// flame::data: data sets, samplers, the DataLoader and the IDX reader (docs/data.md). Not part of
// flame/flame.h (it brings <thread> and friends): include it where you load data.
#include "flame/data/dataset.h"
#include "flame/data/idx.h"
#include "flame/data/loader.h"
#include "flame/data/sampler.h"
