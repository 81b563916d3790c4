// IDX reading and writing (Note [IDX validation] in flame/data/idx.h). This unit depends on zlib
// and FLAME's headers only, not on the FLAME library, so the fuzzer can build it alone (the tensor
// conversions are in dataset.cpp).
#include "flame/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

namespace flame::data {
namespace {

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw IdxError("IDX file " + source + ": " + what);
}

uint32_t read_be32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | uint32_t{p[3]};
}

const char* type_name(uint8_t code) {
  switch (code) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "unknown";
  }
}

std::string hex(unsigned v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02X", v & 0xffu);
  return buf;
}

}  // namespace

int64_t IdxArray::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

IdxArray parse_idx(const uint8_t* bytes, std::size_t size, const std::string& source, int expected_ndim) {
  if (size < 4) fail(source, "too short for the 4-byte magic (" + std::to_string(size) + " bytes)");
  if (bytes[0] != 0 || bytes[1] != 0) {
    fail(source, "bad magic " + hex(bytes[0]) + " " + hex(bytes[1]) + " " + hex(bytes[2]) + " " + hex(bytes[3]) +
                     ": an IDX file starts with two zero bytes (is it still gzip'd, or not an IDX file?)");
  }
  const uint8_t type = bytes[2];
  if (type != 0x08) {
    fail(source, "element type code " + hex(type) + " (" + type_name(type) +
                     ") is not supported: expected 0x08 (unsigned byte)");
  }
  const int ndim = bytes[3];
  if (ndim < 1 || ndim > 4) {
    fail(source, "dimension count " + std::to_string(ndim) + " in the magic: expected 1 to 4");
  }
  if (expected_ndim >= 0 && ndim != expected_ndim) {
    fail(source, "has " + std::to_string(ndim) + " dimensions, expected " + std::to_string(expected_ndim) +
                     (expected_ndim == 3 ? " (images: count, rows, columns)" : expected_ndim == 1 ? " (labels)" : ""));
  }
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(ndim);
  if (size < header) {
    fail(source, "truncated header: " + std::to_string(ndim) + " dimensions need " + std::to_string(header) +
                     " bytes, the file has " + std::to_string(size));
  }
  IdxArray out;
  uint64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    const uint32_t n = read_be32(bytes + 4 + 4 * d);
    if (n == 0 || n > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
      fail(source, "dimension " + std::to_string(d) + " is " + std::to_string(n) + ": expected 1 to 2^31-1");
    }
    // numel <= kMaxIdxElements (2^30) and n < 2^31, so the product cannot overflow 64 bits.
    numel *= n;
    if (numel > kMaxIdxElements) {
      fail(source, "the dimensions hold more than " + std::to_string(kMaxIdxElements) +
                       " elements (dimension " + std::to_string(d) + " is " + std::to_string(n) + ")");
    }
    out.dims.push_back(static_cast<int64_t>(n));
  }
  const uint64_t have = size - header;
  if (have < numel) {
    std::ostringstream os;
    os << "truncated data: the header promises " << numel << " bytes (dimensions";
    for (int64_t d : out.dims) os << " " << d;
    os << "), the file has " << have << " after the header";
    fail(source, os.str());
  }
  if (have > numel) {
    fail(source, std::to_string(have - numel) + " extra bytes after the " + std::to_string(numel) +
                     " bytes of data the header describes (trailing garbage, or wrong dimensions)");
  }
  out.data.assign(bytes + header, bytes + header + numel);
  return out;
}

bool is_gzip(const uint8_t* bytes, std::size_t size) { return size >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b; }

std::vector<uint8_t> gunzip(const uint8_t* bytes, std::size_t size, const std::string& source, std::size_t max_output) {
  z_stream zs;
  std::memset(&zs, 0, sizeof zs);
  // 16 + MAX_WBITS: a gzip wrapper only (a zlib or raw stream is refused).
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) fail(source, "zlib inflateInit2 failed");
  std::vector<uint8_t> out;
  std::size_t consumed = 0;
  int rc = Z_OK;
  uint8_t chunk[1 << 16];
  while (true) {
    // avail_in is 32-bit: feed at most 1 GiB at a time.
    if (zs.avail_in == 0 && consumed < size) {
      const std::size_t n = std::min<std::size_t>(size - consumed, std::size_t{1} << 30);
      zs.next_in = const_cast<Bytef*>(bytes + consumed);
      zs.avail_in = static_cast<uInt>(n);
      consumed += n;
    }
    zs.next_out = chunk;
    zs.avail_out = sizeof chunk;
    rc = inflate(&zs, Z_NO_FLUSH);
    const std::size_t produced = sizeof chunk - zs.avail_out;
    if (out.size() + produced > max_output) {
      inflateEnd(&zs);
      fail(source, "gzip stream inflates to more than " + std::to_string(max_output) + " bytes");
    }
    out.insert(out.end(), chunk, chunk + produced);
    if (rc == Z_STREAM_END) break;
    if (rc == Z_BUF_ERROR) {
      if (zs.avail_in == 0 && consumed < size) continue;  // the next piece of a > 1 GiB input
      inflateEnd(&zs);
      fail(source, "truncated gzip stream (" + std::to_string(size) + " bytes end before the stream does)");
    }
    if (rc != Z_OK) {
      const std::string msg = zs.msg ? zs.msg : "error " + std::to_string(rc);
      inflateEnd(&zs);
      fail(source, "corrupt gzip stream: " + msg);
    }
  }
  const std::size_t trailing = zs.avail_in + (size - consumed);
  inflateEnd(&zs);
  if (trailing != 0) {
    fail(source, std::to_string(trailing) + " bytes after the end of the gzip stream");
  }
  return out;
}

std::vector<uint8_t> decode_idx_container(const std::vector<uint8_t>& raw, const std::string& source) {
  if (is_gzip(raw.data(), raw.size())) return gunzip(raw.data(), raw.size(), source);
  return raw;
}

IdxArray read_idx(const std::string& path, int expected_ndim) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IdxError("IDX file " + path + ": cannot open (" + std::strerror(errno) + ")");
  std::vector<uint8_t> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw IdxError("IDX file " + path + ": read error");
  const std::vector<uint8_t> bytes = decode_idx_container(raw, path);
  return parse_idx(bytes.data(), bytes.size(), path, expected_ndim);
}

std::vector<uint8_t> encode_idx(const std::vector<int64_t>& dims, const std::vector<uint8_t>& data) {
  if (dims.empty() || dims.size() > 255) throw IdxError("encode_idx: 1 to 255 dimensions, got " + std::to_string(dims.size()));
  std::vector<uint8_t> out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  uint64_t numel = 1;
  for (int64_t d : dims) {
    if (d < 0 || d > std::numeric_limits<uint32_t>::max()) throw IdxError("encode_idx: dimension " + std::to_string(d) + " out of range");
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>((static_cast<uint64_t>(d) >> s) & 0xff));
    numel *= static_cast<uint64_t>(d);
  }
  if (numel != data.size()) {
    throw IdxError("encode_idx: dimensions hold " + std::to_string(numel) + " elements, data has " + std::to_string(data.size()));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> gzip(const std::vector<uint8_t>& bytes) {
  z_stream zs;
  std::memset(&zs, 0, sizeof zs);
  if (deflateInit2(&zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw IdxError("gzip: zlib deflateInit2 failed");
  }
  std::vector<uint8_t> out(deflateBound(&zs, static_cast<uLong>(bytes.size())) + 32);
  zs.next_in = const_cast<Bytef*>(bytes.data());
  zs.avail_in = static_cast<uInt>(bytes.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&zs, Z_FINISH);
  const std::size_t n = zs.total_out;
  deflateEnd(&zs);
  if (rc != Z_STREAM_END) throw IdxError("gzip: deflate failed (" + std::to_string(rc) + ")");
  out.resize(n);
  return out;
}

}  // namespace flame::data
