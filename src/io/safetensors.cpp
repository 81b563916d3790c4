// Safetensors load and save over StateDict (include/flame/io/safetensors.h). The format itself
// (parser, writer) is in safetensors_format.cpp.
//
// Note [Safetensors loading]
// A file is memory-mapped read-only and its header validated once (Note [Safetensors
// validation]); after that every read lies inside the mapping. A tensor is materialised with
// Tensor::from_blob_copy straight from the mapping: on the CPU one memcpy out of the page cache;
// on a GPU the CUDA backend's upload path (Note [Host staging] in copy_host.cu) copies 16 MiB
// chunks into a pinned ring and queues each chunk's DMA while the next chunk is copied, so the
// file is never copied whole to host memory and the call returns once the last chunk is queued.
// The mapping may be unmapped as soon as the call returns: the device reads only the pinned ring.
// BOOL bytes are checked to be 0 or 1 before they become C++ bools. A file changed or truncated
// by another process while it is mapped is outside the contract (reading it may raise SIGBUS).
//
// Note [Safetensors saving]
// Tensors are written one at a time (contiguous copy only when the tensor is not, GPU tensors
// brought to the host one at a time), so no second copy of the whole dict is made. Data is
// ordered by decreasing element size (stable), which puts every tensor at a multiple of its
// element size since the data starts 8-byte aligned; the header lists names in the dict's order,
// which is the order load_safetensors returns them in.
#include "flame/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "flame/float8.h"
#include "src/io/safetensors_format.h"

namespace flame::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping");

namespace {

using format::StDType;

struct DTypePair {
  DType flame;
  StDType st;
};
constexpr DTypePair kPairs[] = {
    {DType::f64, StDType::F64}, {DType::f32, StDType::F32}, {DType::f16, StDType::F16},
    {DType::bf16, StDType::BF16}, {DType::i64, StDType::I64}, {DType::i32, StDType::I32},
    {DType::u8, StDType::U8},   {DType::boolean, StDType::BOOL}, {DType::f8_e4m3fn, StDType::F8_E4M3},
    {DType::f8_e5m2, StDType::F8_E5M2},
};

StDType to_st(DType t) {
  for (const DTypePair& p : kPairs) {
    if (p.flame == t) return p.st;
  }
  FLAME_FAIL("save_safetensors", "dtype ", dtype_name(t), " has no safetensors spelling");
}

std::optional<DType> to_flame(StDType t) {
  for (const DTypePair& p : kPairs) {
    if (p.st == t) return p.flame;
  }
  return std::nullopt;
}

std::string errno_text() { return std::strerror(errno); }

// Note [Float8 on load]
// A F8_E4M3 or F8_E5M2 tensor (fp8-stored checkpoints) asked for as its own dtype (f8_e4m3fn,
// f8_e5m2) keeps its codes. Otherwise (and by default, which the model loaders rely on) it is
// decoded on the host to f32 through a 256-entry table and then converted to the dtype asked for
// (f32 without one). The formats are the OCP 8-bit floating point ones that PyTorch calls
// float8_e4m3fn and float8_e5m2 (Note [Float8 formats] in flame/float8.h, whose decoders fill the
// table).
std::vector<float> make_f8_table(bool e4m3) {
  std::vector<float> t(256);
  for (int i = 0; i < 256; ++i) {
    const auto b = static_cast<uint8_t>(i);
    t[i] = e4m3 ? static_cast<float>(float8_e4m3fn::from_bits(b)) : static_cast<float>(float8_e5m2::from_bits(b));
  }
  return t;
}

const std::vector<float>& f8_table(bool e4m3) {
  static const std::vector<float> e4m3_table = make_f8_table(true), e5m2_table = make_f8_table(false);
  return e4m3 ? e4m3_table : e5m2_table;
}

}  // namespace

const char* safetensors_dtype(DType t) { return format::dtype_str(to_st(t)); }

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  const std::optional<StDType> st = format::parse_dtype(name);
  FLAME_CHECK(st.has_value(), "safetensors", "unknown dtype \"", name, "\"");
  return to_flame(*st);
}

// ---- SafetensorsFile ----

struct SafetensorsFile::Impl {
  std::string path;
  const unsigned char* data = nullptr;
  std::size_t size = 0;
  std::vector<std::string> names;
  std::vector<TensorInfo> infos;
  std::unordered_map<std::string, std::size_t> index;
  Metadata metadata;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (data != nullptr) munmap(const_cast<unsigned char*>(data), size);
  }
};

SafetensorsFile::SafetensorsFile(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FLAME_CHECK(fd >= 0, "safetensors", "cannot open '", path, "': ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string why = S_ISDIR(st.st_mode) ? "it is a directory" : "not a regular file";
    ::close(fd);
    FLAME_FAIL("safetensors", "cannot read '", path, "': ", why);
  }
  impl->size = static_cast<std::size_t>(st.st_size);
  if (impl->size > 0) {
    void* p = ::mmap(nullptr, impl->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const std::string why = errno_text();
      ::close(fd);
      FLAME_FAIL("safetensors", "cannot map '", path, "' (", impl->size, " bytes): ", why);
    }
    impl->data = static_cast<const unsigned char*>(p);
    // Loads read front to back; ask the kernel to read ahead.
    (void)::madvise(p, impl->size, MADV_SEQUENTIAL);
  }
  ::close(fd);  // the mapping keeps the file

  const format::Header h = format::parse(impl->data, impl->size, path);
  for (const auto& [k, v] : h.metadata) impl->metadata.emplace(k, v);
  impl->names.reserve(h.entries.size());
  impl->infos.reserve(h.entries.size());
  for (const format::Entry& e : h.entries) {
    TensorInfo info;
    info.dtype = format::dtype_str(e.dtype);
    info.flame_dtype = to_flame(e.dtype);
    info.shape.assign(e.shape.begin(), e.shape.end());  // each <= 2^63 - 1 (parser)
    info.offset = h.data_start + e.begin;
    info.nbytes = e.end - e.begin;
    impl->index.emplace(e.name, impl->names.size());
    impl->names.push_back(e.name);
    impl->infos.push_back(std::move(info));
  }
  impl_ = std::move(impl);
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
uint64_t SafetensorsFile::file_size() const { return impl_->size; }
const std::vector<std::string>& SafetensorsFile::names() const { return impl_->names; }
const Metadata& SafetensorsFile::metadata() const { return impl_->metadata; }

bool SafetensorsFile::contains(std::string_view name) const {
  return impl_->index.count(std::string(name)) > 0;
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  auto it = impl_->index.find(std::string(name));
  FLAME_CHECK(it != impl_->index.end(), "safetensors", "'", impl_->path, "' has no tensor \"", name,
              "\" (", impl_->names.size(), " tensors)");
  return impl_->infos[it->second];
}

Tensor SafetensorsFile::load(std::string_view name, Device device, std::optional<DType> dtype) const {
  const TensorInfo& inf = info(name);
  const bool own_f8 = dtype && inf.flame_dtype && *dtype == *inf.flame_dtype;
  if ((inf.dtype == "F8_E4M3" || inf.dtype == "F8_E5M2") && !own_f8) {  // Note [Float8 on load]
    FLAME_CHECK(!dtype || is_floating(*dtype) || is_float8(*dtype), "safetensors", "'", impl_->path, "': tensor \"",
                name, "\" is ", inf.dtype, " and loads as a floating dtype (f32, f64, bf16, f16, f8_e4m3fn, f8_e5m2), not ",
                *dtype);
    const std::vector<float>& table = f8_table(inf.dtype == "F8_E4M3");
    const unsigned char* bytes = impl_->data + inf.offset;
    std::vector<float> values(inf.nbytes);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = table[bytes[i]];
    Tensor t = Tensor::from_blob_copy(values.data(), DType::f32, values.size(), inf.shape, device);
    if (dtype && *dtype != DType::f32) t = t.to(*dtype);
    return t;
  }
  FLAME_CHECK(inf.flame_dtype.has_value(), "safetensors", "'", impl_->path, "': tensor \"", name,
              "\" has dtype ", inf.dtype,
              ", which FLAME does not have (FLAME reads F64 F32 F16 BF16 I64 I32 U8 BOOL F8_E4M3 F8_E5M2)");
  const DType dt = *inf.flame_dtype;
  const std::size_t count = inf.nbytes / dtype_size(dt);
  const unsigned char* bytes = impl_->data + inf.offset;  // inside the mapping (parser)
  if (dt == DType::boolean) {
    for (std::size_t i = 0; i < count; ++i) {
      FLAME_CHECK(bytes[i] <= 1, "safetensors", "'", impl_->path, "': BOOL tensor \"", name,
                  "\" holds the byte ", static_cast<int>(bytes[i]), " at element ", i,
                  " (a bool is 0 or 1)");
    }
  }
  Tensor t = Tensor::from_blob_copy(bytes, dt, count, inf.shape, device);
  if (dtype && *dtype != dt) t = t.to(*dtype);
  return t;
}

StateDict SafetensorsFile::load_all(Device device, std::optional<DType> dtype) const {
  StateDict out;
  for (const std::string& name : impl_->names) {
    const TensorInfo& inf = impl_->infos[impl_->index.at(name)];
    const bool f8 = inf.dtype == "F8_E4M3" || inf.dtype == "F8_E5M2";
    const bool convert = dtype && ((inf.flame_dtype && is_floating(*inf.flame_dtype)) || (f8 && (is_floating(*dtype) || is_float8(*dtype))));
    out.insert(name, load(name, device, convert ? dtype : std::nullopt));
  }
  return out;
}

StateDict load_safetensors(const std::string& path, Device device, std::optional<DType> dtype) {
  return SafetensorsFile(path).load_all(device, dtype);
}

Metadata load_safetensors_metadata(const std::string& path) { return SafetensorsFile(path).metadata(); }

// ---- saving ----

void save_safetensors(const std::string& path, const StateDict& dict, const Metadata& metadata) {
  std::vector<format::Entry> entries;
  std::vector<Tensor> tensors;
  entries.reserve(dict.size());
  tensors.reserve(dict.size());
  for (const auto& [name, t] : dict) {
    FLAME_CHECK(t.defined(), "save_safetensors", "tensor \"", name, "\" is undefined (saving '", path, "')");
    format::Entry e;
    e.name = name;
    e.dtype = to_st(t.dtype());
    e.shape.assign(t.sizes().begin(), t.sizes().end());
    e.end = t.nbytes();  // size for now; offsets below
    entries.push_back(std::move(e));
    tensors.push_back(t.detach());
  }
  // Note [Safetensors saving]: data by decreasing element size, stable.
  std::vector<std::size_t> order(entries.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return tensors[a].element_size() > tensors[b].element_size();
  });
  uint64_t offset = 0;
  for (std::size_t i : order) {
    const uint64_t n = entries[i].end;
    entries[i].begin = offset;
    entries[i].end = offset + n;
    offset += n;
  }
  const std::vector<std::pair<std::string, std::string>> meta(metadata.begin(), metadata.end());
  const std::string header = format::serialize_header(entries, meta, path);

  // Written beside the target and renamed over it, so a failed save leaves no partial file.
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  FLAME_CHECK(f != nullptr, "save_safetensors", "cannot open '", tmp, "' for writing: ", errno_text());
  auto write = [&](const void* p, std::size_t n) {
    if (n > 0 && std::fwrite(p, 1, n, f) != n) {
      FLAME_FAIL("save_safetensors", "writing '", tmp, "' failed: ", errno_text());
    }
  };
  try {
    write(header.data(), header.size());
    for (std::size_t i : order) {
      const Tensor& t = tensors[i];
      if (t.numel() == 0) continue;
      const Tensor host = t.device().is_cpu() ? t.contiguous() : t.contiguous().to(Device::cpu());
      write(host.data_ptr(), host.nbytes());
    }
    const int closed = std::fclose(f);
    f = nullptr;
    FLAME_CHECK(closed == 0, "save_safetensors", "closing '", tmp, "' failed: ", errno_text());
    FLAME_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "save_safetensors", "cannot rename '", tmp,
                "' to '", path, "': ", errno_text());
  } catch (...) {
    if (f != nullptr) std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
}

}  // namespace flame::io
