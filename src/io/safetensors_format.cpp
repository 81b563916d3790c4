// The safetensors header parser and writer (Note [Safetensors layout] and
// Note [Safetensors validation] in safetensors_format.h).
#include "src/io/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "flame/error.h"

namespace flame::io::format {

namespace {

using Json = nlohmann::ordered_json;

struct DTypeRow {
  StDType dtype;
  const char* name;
  std::size_t bytes;
};

constexpr DTypeRow kDTypes[] = {
    {StDType::BOOL, "BOOL", 1},       {StDType::U8, "U8", 1},           {StDType::I8, "I8", 1},
    {StDType::F8_E5M2, "F8_E5M2", 1}, {StDType::F8_E4M3, "F8_E4M3", 1}, {StDType::F8_E8M0, "F8_E8M0", 1},
    {StDType::I16, "I16", 2},         {StDType::U16, "U16", 2},         {StDType::F16, "F16", 2},
    {StDType::BF16, "BF16", 2},       {StDType::I32, "I32", 4},         {StDType::U32, "U32", 4},
    {StDType::F32, "F32", 4},         {StDType::F64, "F64", 8},         {StDType::I64, "I64", 8},
    {StDType::U64, "U64", 8},         {StDType::C64, "C64", 8},
};

// Bytes from the file in a message: printable ASCII as is, every other byte (control bytes, bytes
// of a broken UTF-8 sequence) as \xNN, so a message never carries raw bytes to a terminal.
std::string escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto b = static_cast<unsigned char>(ch);
    if (b >= 0x20 && b < 0x7f && b != '\\') {
      out += ch;
    } else {
      constexpr char kHex[] = "0123456789ABCDEF";
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    }
  }
  return out;
}

// Names come from the file: a hostile one may be megabytes long or hold control bytes, so error
// messages show at most the first 120 bytes, escaped.
std::string shown(std::string_view s) {
  constexpr std::size_t kMax = 120;
  if (s.size() <= kMax) return escaped(s);
  return escaped(s.substr(0, kMax)) + "...(" + std::to_string(s.size()) + " bytes)";
}

// Note [Foreign files]: a file that is not safetensors at all (an image, a pickle, a zip archive
// such as torch.save's) would otherwise be refused for a nonsensical "header length" read from its
// first 8 bytes. Its first bytes are named instead, with the format they announce when it is a
// common one. A file whose 8-byte length cannot be a header length (over the cap or past the end)
// and whose byte 8 is not the header's '{', or one with a known signature and either fault, gets
// this message; anything that looks like safetensors keeps the precise header messages.
const char* foreign_format(const unsigned char* data, std::size_t size) {
  struct Magic {
    const char* bytes;
    std::size_t n;
    const char* what;
  };
  static const Magic kMagic[] = {
      {"\x89PNG\r\n\x1a\n", 8, "a PNG image"},
      {"\xff\xd8\xff", 3, "a JPEG image"},
      {"GIF8", 4, "a GIF image"},
      {"\x1f\x8b", 2, "a gzip stream"},
      {"PK\x03\x04", 4, "a zip archive (torch.save writes these)"},
      {"\x7f" "ELF", 4, "an ELF executable"},
      {"%PDF", 4, "a PDF document"},
      {"GGUF", 4, "a GGUF model file"},
      {"\x93NUMPY", 6, "a NumPy .npy array"},
      {"\x89HDF\r\n\x1a\n", 8, "an HDF5 file"},
  };
  for (const Magic& m : kMagic) {
    if (m.what != nullptr && size >= m.n && std::memcmp(data, m.bytes, m.n) == 0) return m.what;
  }
  if (size >= 2 && data[0] == 0x80 && data[1] >= 2 && data[1] <= 5) return "a Python pickle (an old torch.save file)";
  if (size >= 4 && data[0] == 0 && data[1] == 0 && data[2] == 0x08 && data[3] >= 1 && data[3] <= 4)
    return "an IDX array";
  return nullptr;
}

// "89 50 4E 47 0D 0A 1A 0A" for the first (at most 8) bytes.
std::string first_bytes(const unsigned char* data, std::size_t size) {
  constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (std::size_t i = 0; i < std::min<std::size_t>(size, 8); ++i) {
    if (i > 0) out += ' ';
    out += kHex[data[i] >> 4];
    out += kHex[data[i] & 15];
  }
  return out;
}

[[noreturn]] void fail_foreign(std::string_view source, const unsigned char* data, std::size_t size,
                               const char* what) {
  bool text = size > 0;
  for (std::size_t i = 0; i < std::min<std::size_t>(size, 64); ++i) {
    const unsigned char b = data[i];
    text = text && (b == '\n' || b == '\r' || b == '\t' || (b >= 0x20 && b < 0x7f));
  }
  const std::string kind = what != nullptr ? what : text ? "text" : "an unknown format";
  FLAME_FAIL("safetensors", "'", source, "' is not a safetensors file (starts with bytes ", first_bytes(data, size),
             size > 8 ? " ..." : "", ": ", kind, ")");
}

template <class... Args>
[[noreturn]] void fail(std::string_view source, const Args&... args) {
  FLAME_FAIL("safetensors", "'", source, "': ", args...);
}

const char* json_kind(const Json& v) { return v.type_name(); }

// Keys are checked for duplicates while the parser sees them (Note [Safetensors validation]).
class KeyChecker {
 public:
  explicit KeyChecker(std::string_view source) : source_(source) {}
  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        push(true);
        break;
      case Json::parse_event_t::array_start:
        push(false);
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!open_.empty()) open_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!open_.empty() && open_.back().has_value() && !open_.back()->insert(key).second) {
          fail(source_, "duplicate key \"", shown(key), "\" in the header");
        }
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  void push(bool object) {
    if (static_cast<int>(open_.size()) >= kMaxJsonDepth) {
      fail(source_, "header JSON is nested more than ", kMaxJsonDepth, " levels deep");
    }
    open_.emplace_back(object ? std::optional<std::unordered_set<std::string>>(std::in_place)
                              : std::nullopt);
  }
  std::string_view source_;
  std::vector<std::optional<std::unordered_set<std::string>>> open_;
};

// A non-negative JSON integer that fits in 63 bits (FLAME sizes and offsets are int64).
uint64_t as_count(const Json& v, std::string_view source, const std::string& name, const char* field) {
  if (v.is_number_unsigned()) {
    const uint64_t x = v.get<uint64_t>();
    if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(source, "\"", field, "\" of tensor \"", shown(name), "\" holds ", x, ", more than 2^63 - 1");
    }
    return x;
  }
  if (v.is_number_integer()) {
    fail(source, "\"", field, "\" of tensor \"", shown(name), "\" holds the negative value ",
         v.get<int64_t>());
  }
  fail(source, "\"", field, "\" of tensor \"", shown(name), "\" must hold non-negative integers, got ",
       json_kind(v));
}

const Json& member(const Json& obj, const char* key, std::string_view source, const std::string& name) {
  auto it = obj.find(key);
  if (it == obj.end()) fail(source, "tensor \"", shown(name), "\" has no \"", key, "\"");
  return *it;
}

Entry parse_entry(const std::string& name, const Json& v, std::string_view source) {
  if (!v.is_object()) {
    fail(source, "entry \"", shown(name), "\" must be an object, got ", json_kind(v));
  }
  Entry e;
  e.name = name;
  const Json& dt = member(v, "dtype", source, name);
  if (!dt.is_string()) fail(source, "\"dtype\" of tensor \"", shown(name), "\" must be a string, got ", json_kind(dt));
  const std::string& dts = dt.get_ref<const std::string&>();
  const std::optional<StDType> parsed = parse_dtype(dts);
  if (!parsed) fail(source, "tensor \"", shown(name), "\" has unknown dtype \"", shown(dts), "\"");
  e.dtype = *parsed;

  const Json& sh = member(v, "shape", source, name);
  if (!sh.is_array()) fail(source, "\"shape\" of tensor \"", shown(name), "\" must be an array, got ", json_kind(sh));
  uint64_t numel = 1;
  bool overflow = false;
  for (const Json& d : sh) {
    const uint64_t n = as_count(d, source, name, "shape");
    e.shape.push_back(n);
    if (n == 0) {
      numel = 0;
    } else if (!overflow && numel != 0) {
      overflow = numel > std::numeric_limits<uint64_t>::max() / n;
      numel *= n;
    }
  }
  const bool empty = std::find(e.shape.begin(), e.shape.end(), uint64_t{0}) != e.shape.end();
  const uint64_t elem = dtype_bytes(e.dtype);
  if (!empty && (overflow || numel > std::numeric_limits<uint64_t>::max() / elem ||
                 numel * elem > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
    fail(source, "shape of tensor \"", shown(name), "\" (", sh.size(), " dims) has more bytes than 2^63 - 1");
  }
  const uint64_t nbytes = empty ? 0 : numel * elem;

  const Json& off = member(v, "data_offsets", source, name);
  if (!off.is_array() || off.size() != 2) {
    fail(source, "\"data_offsets\" of tensor \"", shown(name), "\" must be an array of 2 integers, got ",
         off.is_array() ? std::to_string(off.size()) + " elements" : std::string(json_kind(off)));
  }
  e.begin = as_count(off[0], source, name, "data_offsets");
  e.end = as_count(off[1], source, name, "data_offsets");
  if (e.end < e.begin) {
    fail(source, "data_offsets [", e.begin, ", ", e.end, "] of tensor \"", shown(name),
         "\" end before they begin");
  }
  if (e.end - e.begin != nbytes) {
    fail(source, "tensor \"", shown(name), "\" spans ", e.end - e.begin, " bytes by its data_offsets, but ",
         dts, " of shape ", sh.dump(), " needs ", nbytes);
  }
  return e;
}

}  // namespace

const char* dtype_str(StDType t) {
  for (const DTypeRow& r : kDTypes) {
    if (r.dtype == t) return r.name;
  }
  return "?";
}

std::size_t dtype_bytes(StDType t) {
  for (const DTypeRow& r : kDTypes) {
    if (r.dtype == t) return r.bytes;
  }
  return 1;
}

std::optional<StDType> parse_dtype(std::string_view s) {
  for (const DTypeRow& r : kDTypes) {
    if (s == r.name) return r.dtype;
  }
  return std::nullopt;
}

Header parse(const unsigned char* data, std::size_t size, std::string_view source) {
  if (size < 8) fail(source, "file is ", size, " bytes, too short for the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | data[i];  // little-endian on any host
  // Note [Foreign files].
  {
    // A safetensors header starts with '{'; a length that cannot be one, or a header that does not
    // start so, from a file with a known signature or neither, is a foreign file.
    const bool implausible = n > kMaxHeaderBytes || n > size - 8;
    const bool brace = size > 8 && data[8] == '{';
    const char* what = foreign_format(data, size);
    if (what != nullptr && (implausible || !brace)) fail_foreign(source, data, size, what);
    if (implausible && !brace) fail_foreign(source, data, size, nullptr);
  }
  if (n > kMaxHeaderBytes) {
    fail(source, "header length ", n, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  }
  // n <= 1e8, so 8 + n cannot overflow.
  if (n > size - 8) {
    fail(source, "header length ", n, " runs past the end of the file (", size, " bytes)");
  }
  Header h;
  h.header_bytes = n;
  h.data_start = 8 + n;
  h.data_bytes = size - h.data_start;

  const char* text = reinterpret_cast<const char*>(data + 8);
  Json root;
  try {
    KeyChecker checker(source);
    root = Json::parse(text, text + n, std::ref(checker), /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    fail(source, "header is not valid JSON: ", escaped(e.what()));
  }
  if (!root.is_object()) fail(source, "header must be a JSON object, got ", json_kind(root));

  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    const Json& v = it.value();
    if (key == kMetadataKey) {
      if (!v.is_object()) {
        fail(source, "\"__metadata__\" must be an object of strings, got ", json_kind(v));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          fail(source, "\"__metadata__\" value of key \"", shown(m.key()), "\" must be a string, got ",
               json_kind(m.value()));
        }
        h.metadata.emplace_back(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    h.entries.push_back(parse_entry(key, v, source));
  }

  // Sorted by offset, the tensors must tile the data from byte 0 with no gap and no overlap.
  std::vector<std::size_t> order(h.entries.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const Entry &x = h.entries[a], &y = h.entries[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (std::size_t i : order) {
    const Entry& e = h.entries[i];
    if (e.begin > covered) {
      fail(source, "gap in the data: bytes [", covered, ", ", e.begin, ") belong to no tensor (tensor \"",
           shown(e.name), "\" starts at ", e.begin, ")");
    }
    if (e.begin < covered) {
      fail(source, "tensor \"", shown(e.name), "\" (data_offsets [", e.begin, ", ", e.end,
           "]) overlaps tensor \"", previous ? shown(previous->name) : std::string(), "\", which ends at ",
           covered);
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != h.data_bytes) {
    fail(source, "the tensors span ", covered, " bytes of data but the file holds ", h.data_bytes,
         " bytes after the header", covered > h.data_bytes ? " (file truncated?)" : " (trailing bytes)");
  }
  return h;
}

std::string serialize_header(const std::vector<Entry>& entries,
                             const std::vector<std::pair<std::string, std::string>>& metadata,
                             std::string_view source) {
  Json root = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    root[kMetadataKey] = std::move(m);
  }
  for (const Entry& e : entries) {
    if (e.name == kMetadataKey) fail(source, "a tensor may not be named \"__metadata__\"");
    if (root.contains(e.name)) fail(source, "duplicate tensor name \"", shown(e.name), "\"");
    Json entry = Json::object();
    entry["dtype"] = dtype_str(e.dtype);
    entry["shape"] = e.shape;
    entry["data_offsets"] = Json::array({e.begin, e.end});
    root[e.name] = std::move(entry);
  }
  std::string text;
  try {
    text = root.dump();  // strict: raises on a string that is not valid UTF-8
  } catch (const Json::exception& e) {
    fail(source, "a tensor name or metadata string is not valid UTF-8 (", e.what(), ")");
  }
  // Pad with spaces so that the data starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxHeaderBytes) {
    fail(source, "header would be ", text.size(), " bytes, more than the limit of ", kMaxHeaderBytes);
  }
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

}  // namespace flame::io::format
