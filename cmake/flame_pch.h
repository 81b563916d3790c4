#pragma once
// The library's precompiled header (Note [Build time] in CMakeLists.txt): what most of its C++
// sources include. Each source still includes what it uses; this only saves parsing it again, and
// a build with -DFLAME_PCH=OFF checks that every source compiles on its own includes.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flame/autograd.h"
#include "flame/error.h"
#include "flame/ops.h"
#include "flame/tensor.h"
#include "src/core/tensor_impl.h"
