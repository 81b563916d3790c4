#pragma once
// Internals shared by checkpoint.cpp and checkpoint_files.cpp.
#include <cstddef>
#include <cstdint>
#include <string>

#include "flame/io/safetensors.h"
#include "flame/state_dict.h"

namespace flame::checkpoint_detail {

// Writes `host` (CPU tensors) and `meta` to `path` atomically and durably (Note [Atomic
// checkpoints] in checkpoint_files.cpp).
void atomic_save(const std::string& path, const StateDict& host, const io::Metadata& meta);

// Note [Checkpoint checksums] in checkpoint.cpp.
uint64_t content_hash(const void* data, std::size_t n);

}  // namespace flame::checkpoint_detail
