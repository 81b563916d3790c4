#pragma once
#define FLAME_VERSION_MAJOR 0
#define FLAME_VERSION_MINOR 1
#define FLAME_VERSION_PATCH 0
namespace flame {
const char* version();
}
