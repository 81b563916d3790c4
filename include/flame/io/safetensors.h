#pragma once
// Safetensors files (the format of Hugging Face's `safetensors`), read and written from a
// StateDict. Files FLAME writes load in Python's safetensors + PyTorch bit for bit, and files they
// write load here. See docs/safetensors.md.
//
//   io::save_safetensors("model.safetensors", sd, {{"format", "pt"}});
//   StateDict sd = io::load_safetensors("model.safetensors", Device::cuda());
//   io::SafetensorsFile f("model.safetensors");        // mmap + header only
//   Tensor w = f.load("blocks.0.attn.qkv.weight", Device::cuda(), DType::bf16);
//
// Dtypes: F64 F32 F16 BF16 I64 I32 U8 BOOL map to FLAME's f64 f32 f16 bf16 i64 i32 u8 boolean.
// F8_E4M3 and F8_E5M2 (fp8-stored checkpoints; OCP formats, PyTorch's float8_e4m3fn and
// float8_e5m2; FLAME's f8_e4m3fn and f8_e5m2, Note [Float8 dtypes] in flame/dtype.h) load decoded
// to f32 by default, or to the dtype asked for: their own 8-bit dtype keeps the stored codes
// (Note [Float8 on load] in src/io/safetensors.cpp: E4M3 has no infinities and NaN only at
// S.1111.111); f8 tensors save as F8_E4M3 / F8_E5M2. A file may hold the format's other dtypes
// (I8, I16, U16, U32, U64, F8_E8M0, C64): it opens and lists them (TensorInfo::flame_dtype is
// nullopt), and loading such a tensor raises an error naming its dtype. Every problem with a
// file raises flame::Error naming the file and what is wrong with it.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flame/device.h"
#include "flame/dtype.h"
#include "flame/state_dict.h"
#include "flame/tensor.h"

namespace flame::io {

using Metadata = std::map<std::string, std::string>;

// FLAME dtype -> safetensors spelling ("F32", "BF16", "BOOL", ...).
const char* safetensors_dtype(DType t);
// Safetensors spelling -> FLAME dtype; nullopt for a dtype of the format FLAME does not have
// ("I8", "F8_E4M3", ...). Raises flame::Error for a string the format does not define.
std::optional<DType> dtype_from_safetensors(std::string_view name);

// Writes `dict` (tensors of any device and layout; each is made contiguous and, if on a GPU,
// brought to the host one tensor at a time) and `metadata` (the "__metadata__" map) to `path`.
// The file is written beside `path` first and renamed over it at the end, so a failed save never
// leaves a partial file at `path`. Tensor data is laid out by decreasing element size (stable),
// so every tensor starts at a multiple of its element size; the header keeps the dict's order.
void save_safetensors(const std::string& path, const StateDict& dict, const Metadata& metadata = {});

// Reads every tensor of `path` onto `device`, in the header's order (for files FLAME wrote: the
// order of the saved dict). With `dtype`, floating-point tensors are converted to it (integer and
// bool tensors keep theirs, as Module::to(dtype) in PyTorch). GPU loads copy from the memory-mapped
// file through pinned staging buffers in chunks; no host copy of the file is made.
StateDict load_safetensors(const std::string& path, Device device = Device::cpu(),
                           std::optional<DType> dtype = std::nullopt);
// The "__metadata__" map of `path` (reads the header only).
Metadata load_safetensors_metadata(const std::string& path);

// What the header says of one tensor.
struct TensorInfo {
  std::string dtype;                 // safetensors spelling
  std::optional<DType> flame_dtype;  // nullopt when FLAME has no such dtype
  Shape shape;
  uint64_t offset = 0;  // absolute byte offset of the data in the file
  uint64_t nbytes = 0;
};

// An open safetensors file: opening maps the file read-only and validates the whole header;
// tensors are read on request. Copies share the mapping, which lives as long as the last copy.
// Tensors returned by load() own their memory: they stay valid after the file is closed.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const;
  uint64_t file_size() const;
  // Tensor names in the header's order.
  const std::vector<std::string>& names() const;
  bool contains(std::string_view name) const;
  // Raises flame::Error naming the tensor and the file when absent.
  const TensorInfo& info(std::string_view name) const;
  const Metadata& metadata() const;

  // One tensor on `device`; with `dtype`, converted to it (any dtype, unlike load_all).
  Tensor load(std::string_view name, Device device = Device::cpu(),
              std::optional<DType> dtype = std::nullopt) const;
  // Every tensor, as load_safetensors.
  StateDict load_all(Device device = Device::cpu(), std::optional<DType> dtype = std::nullopt) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace flame::io
