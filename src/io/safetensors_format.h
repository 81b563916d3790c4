#pragma once
// The safetensors file format, apart from tensors: the dtype table, the hardened header parser and
// the header writer. This unit depends only on the standard library, nlohmann-json and
// flame/error.h (no Tensor, no backend), so a fuzzer can compile it alone
// (tests/fuzz/fuzz_safetensors.cpp).
//
// Note [Safetensors layout]
// A file is: 8 bytes, a little-endian u64 N; N bytes of JSON (the header), padded at the end with
// spaces so that 8 + N is a multiple of 8; then the data: every tensor's bytes, little-endian and
// C-contiguous, back to back. The header is an object mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (offsets relative to the start
// of the data), plus an optional "__metadata__" object of string -> string.
//
// Note [Safetensors validation]
// parse() accepts exactly what the reference (Rust) parser accepts, and refuses the rest with a
// flame::Error naming the file and the problem: N at most 100,000,000 with checked arithmetic;
// the header valid JSON, an object, no duplicate keys at any level (nlohmann keeps the last one
// silently, so keys are checked as they are parsed) and nested at most kMaxJsonDepth deep; every
// entry an object with a known dtype string, a shape of non-negative integers whose product times
// the dtype size fits in 64 bits and equals end - begin, and data_offsets of two integers with
// begin <= end; the entries, sorted by offset, tile [0, data size) exactly (no gap, no overlap);
// the data runs exactly to the end of the file; metadata values are strings. Nothing is read
// outside [data, data + size).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flame::io::format {

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // as the reference parser
inline constexpr int kMaxJsonDepth = 64;
inline constexpr const char* kMetadataKey = "__metadata__";

// Every dtype the safetensors format names. FLAME's own dtypes are a subset (see safetensors.cpp).
enum class StDType : uint8_t {
  BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, C64
};

const char* dtype_str(StDType t);
std::size_t dtype_bytes(StDType t);
std::optional<StDType> parse_dtype(std::string_view s);

struct Entry {
  std::string name;
  StDType dtype = StDType::F32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // relative to the start of the data
  uint64_t end = 0;
};

struct Header {
  std::vector<Entry> entries;  // in the header's (JSON) order
  std::vector<std::pair<std::string, std::string>> metadata;  // in the header's order
  uint64_t header_bytes = 0;  // N
  uint64_t data_start = 0;    // 8 + N
  uint64_t data_bytes = 0;    // file size - data_start
};

// Parses and validates a whole file held in [data, data + size) (Note [Safetensors validation]).
// `source` names the file in error messages.
Header parse(const unsigned char* data, std::size_t size, std::string_view source);

// The first 8 + N bytes of a file holding `entries` (offsets already assigned) and `metadata`:
// compact JSON, "__metadata__" first when present, then the entries in the given order, padded
// with spaces to a multiple of 8. Raises on names or metadata that are not valid UTF-8.
std::string serialize_header(const std::vector<Entry>& entries,
                             const std::vector<std::pair<std::string, std::string>>& metadata,
                             std::string_view source);

}  // namespace flame::io::format
