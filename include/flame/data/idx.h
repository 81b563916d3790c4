#pragma once
// IDX files (the MNIST family's format), plain or gzip'd: a 4-byte magic (0, 0, type code,
// dimension count), one big-endian uint32 per dimension, then the elements in row-major order.
// Only unsigned bytes (type code 0x08) are accepted: that is what Fashion-MNIST stores.
//
// Note [IDX validation]
// Every field is checked before it is used, and a file is taken only when it is exactly what its
// header says: the magic's two zero bytes, type 0x08, 1 to 4 dimensions (the caller may ask for an
// exact count), every dimension > 0 and < 2^31, the element count computed with overflow checks and
// capped (kMaxIdxElements), the data neither truncated nor followed by extra bytes. A gzip stream
// must be complete, inflate to at most the cap, and end the file. Errors are IdxError (a
// flame::Error) whose message names the file and what is wrong. The parser is fuzzed
// (apps/diffusion/tests/fuzz/fuzz_idx.cpp, Note [IDX fuzz contract]).
//
//   Tensor images = data::load_idx("train-images-idx3-ubyte.gz");   // u8 [60000, 28, 28]
//   data::IdxArray labels = data::read_idx("train-labels-idx1-ubyte.gz", /*expected_ndim=*/1);
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "flame/error.h"
#include "flame/tensor.h"

namespace flame::data {

class IdxError : public Error {
 public:
  explicit IdxError(const std::string& what) : Error(what) {}
};

// The most elements one IDX array may hold (1 GiB of bytes): Fashion-MNIST's largest file has 47M.
inline constexpr uint64_t kMaxIdxElements = uint64_t{1} << 30;

struct IdxArray {
  std::vector<int64_t> dims;  // e.g. [60000, 28, 28] or [60000]
  std::vector<uint8_t> data;  // product(dims) bytes, row-major

  int64_t numel() const;
};

// Parses the bytes of an (uncompressed) IDX file. `source` names the file in errors.
// expected_ndim: the dimension count required (-1: any of 1..4).
IdxArray parse_idx(const uint8_t* bytes, std::size_t size, const std::string& source, int expected_ndim = -1);

// Inflates a complete gzip stream that must end the input; at most `max_output` bytes.
std::vector<uint8_t> gunzip(const uint8_t* bytes, std::size_t size, const std::string& source,
                            std::size_t max_output = static_cast<std::size_t>(kMaxIdxElements) + 64);
bool is_gzip(const uint8_t* bytes, std::size_t size);

// The bytes of an IDX file, gunzipped when they start with the gzip magic: parse_idx's input.
std::vector<uint8_t> decode_idx_container(const std::vector<uint8_t>& raw, const std::string& source);

// Reads `path` (plain or .gz by content, not by name) and parses it.
IdxArray read_idx(const std::string& path, int expected_ndim = -1);

// read_idx as a u8 tensor of the file's dimensions, on the CPU.
Tensor load_idx(const std::string& path, int expected_ndim = -1);
// An IdxArray's bytes as a u8 tensor of its dimensions (a copy), on the CPU.
Tensor idx_to_tensor(const IdxArray& array);

// The file bytes of an IDX array (type 0x08): for tests, fuzz corpora and tools.
std::vector<uint8_t> encode_idx(const std::vector<int64_t>& dims, const std::vector<uint8_t>& data);
// A gzip stream of `bytes` (zlib's deflate with a gzip wrapper).
std::vector<uint8_t> gzip(const std::vector<uint8_t>& bytes);

}  // namespace flame::data
