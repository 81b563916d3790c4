// Run-time compiled kernels (include/flame/cuda/kernels.h): NVRTC compile, memory and disk cache,
// loading through the CUDA runtime's library API, launch on FLAME's stream.
//
// Note [Kernel cache]
// A binary is identified by its key: a format tag, the NVRTC version, a hash of the prelude, the
// device architecture, the NVRTC target, the name expression, the options and the source, in one
// string. In memory, entries are found by the whole key, so two kernels never collide. On disk an
// entry is one file <name>-<fnv64(key)>.flamek that repeats the whole key, the lowered name, the
// binary, its parameter count and a checksum; a reader takes it only when all of them match, so
// a truncated, corrupt, foreign or colliding file is a miss (disk_rejects) that is compiled again
// and overwritten.
// Writers write a temporary file in the same directory and rename it over the entry: a reader in
// any process sees the old file or the new one, never half of one. Disk I/O failures never fail a
// kernel; they skip caching (disk_errors). Headers a kernel includes from disk are not part of the
// key: change the source (or clear the directory) when they change.
//
// Note [Runtime library API]
// Binaries are loaded with cudaLibraryLoadData (context-independent: one load serves every device
// of that architecture) and launched by cudaLaunchKernel on the cudaKernel_t. Only the CUDA
// runtime is used, never a driver-API symbol, so a CUDA build of FLAME still loads on a machine
// without a GPU driver (its tests then skip). Failed runtime calls that are expected (a rejected
// cached binary, an unsupported query) clear the runtime's last error, so a later
// FLAME_CUDA_CHECK_LAUNCH does not report them.
#include <cuda_runtime.h>
#include <nvrtc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "flame/cuda.h"
#include "flame/cuda/kernels.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"

namespace flame::cuda {
namespace {

namespace fs = std::filesystem;

#define FLAME_NVRTC_CHECK(call)                                                                  \
  do {                                                                                           \
    nvrtcResult flame_nvrtc_err_ = (call);                                                       \
    if (flame_nvrtc_err_ != NVRTC_SUCCESS)                                                       \
      FLAME_FAIL("nvrtc", #call, " failed: ", nvrtcGetErrorString(flame_nvrtc_err_));            \
  } while (0)

// ---- the prelude every kernel may #include <flame/jit.cuh> ----

constexpr const char* kPreludeName = "flame/jit.cuh";
constexpr const char* kPrelude = R"FLAMEJIT(#pragma once
// FLAME's prelude for run-time compiled kernels: fixed-width integers, flame::bfloat16 and
// flame::float16 (the element layout of FLAME's bf16 / f16 tensors), compute-type conversions,
// and 1-d index helpers.
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;

namespace flame {

// bf16: the upper 16 bits of an f32. From float: round to nearest even, NaN stays a quiet NaN
// (the same bits as FLAME's host and CUDA conversions).
struct bfloat16 {
  uint16_t bits;
  bfloat16() = default;
  __device__ explicit bfloat16(float f) : bits(bits_of(f)) {}
  __device__ explicit bfloat16(double d) : bits(bits_of(static_cast<float>(d))) {}
  __device__ operator float() const { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
  __device__ static bfloat16 from_bits(uint16_t b) { bfloat16 r; r.bits = b; return r; }
  __device__ static uint16_t bits_of(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

// IEEE binary16. From float: round to nearest even; NaN becomes 0x7e00 with the sign kept.
struct float16 {
  uint16_t bits;
  float16() = default;
  __device__ explicit float16(float f) : bits(bits_of(f)) {}
  __device__ explicit float16(double d) : bits(bits_of(static_cast<float>(d))) {}
  __device__ operator float() const {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
  }
  __device__ static float16 from_bits(uint16_t b) { float16 r; r.bits = b; return r; }
  __device__ static uint16_t bits_of(float f) {
    if (f != f) return static_cast<uint16_t>(0x7e00u | ((__float_as_uint(f) >> 16) & 0x8000u));
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

// The type arithmetic is done in (FLAME's Note [Compute types]): float for bf16/f16/f32, double
// for f64, the type itself otherwise.
template <class T> struct ComputeType { typedef T type; };
template <> struct ComputeType<bfloat16> { typedef float type; };
template <> struct ComputeType<float16> { typedef float type; };
template <class T> using compute_t = typename ComputeType<T>::type;

template <class T> __device__ inline compute_t<T> to_compute(T x) { return static_cast<compute_t<T>>(x); }
template <class T> __device__ inline T from_compute(compute_t<T> v) { return T(v); }

// 1-d launches: this thread's global index and the number of threads in the grid.
__device__ inline int64_t global_thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t global_thread_count() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace flame
)FLAMEJIT";

// ---- small helpers ----

uint64_t fnv1a64(const void* data, std::size_t n, uint64_t h = 1469598103934665603ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}
uint64_t fnv1a64(const std::string& s, uint64_t h = 1469598103934665603ULL) {
  return fnv1a64(s.data(), s.size(), h);
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// A kernel name as a file-name fragment: [A-Za-z0-9_] only, at most 48 characters.
std::string file_stem(const std::string& name) {
  std::string s;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    s += ok ? c : '_';
    if (s.size() == 48) break;
  }
  return s.empty() ? std::string("kernel") : s;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

bool has_option(const std::vector<std::string>& opts, std::initializer_list<const char*> prefixes) {
  for (const auto& o : opts)
    for (const char* p : prefixes)
      if (starts_with(o, p)) return true;
  return false;
}

void clear_last_cuda_error() { (void)cudaGetLastError(); }

// Makes `device` current for the scope and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLAME_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ == device) {
      previous_ = -1;
    } else {
      FLAME_CUDA_CHECK(cudaSetDevice(device));
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// ---- NVRTC ----

struct NvrtcInfo {
  int major = 0, minor = 0;
  std::vector<int> archs;  // supported sm_XX, ascending
};

const NvrtcInfo& nvrtc_info() {
  static const NvrtcInfo info = [] {
    NvrtcInfo i;
    FLAME_NVRTC_CHECK(nvrtcVersion(&i.major, &i.minor));
    int n = 0;
    FLAME_NVRTC_CHECK(nvrtcGetNumSupportedArchs(&n));
    i.archs.resize(static_cast<std::size_t>(n));
    if (n > 0) FLAME_NVRTC_CHECK(nvrtcGetSupportedArchs(i.archs.data()));
    std::sort(i.archs.begin(), i.archs.end());
    return i;
  }();
  return info;
}

// The -arch value for a device of compute capability `arch`: its own sm_XX when NVRTC knows it,
// else PTX for the newest older one that NVRTC knows (the driver compiles that PTX on load).
std::string target_for(int arch) {
  const NvrtcInfo& info = nvrtc_info();
  if (std::find(info.archs.begin(), info.archs.end(), arch) != info.archs.end()) return "sm_" + std::to_string(arch);
  int best = -1;
  for (int a : info.archs)
    if (a < arch) best = a;
  FLAME_CHECK(best > 0, "ensure_kernel", "NVRTC ", info.major, ".", info.minor,
              " cannot compile for compute capability ", arch / 10, ".", arch % 10);
  return "compute_" + std::to_string(best);
}

std::vector<std::string> full_options(const std::vector<std::string>& user, const std::string& target) {
  std::vector<std::string> opts;
  if (!has_option(user, {"-std", "--std"})) opts.push_back("--std=c++17");
  if (!has_option(user, {"-default-device", "--device-as-default-execution-space"})) opts.push_back("-default-device");
  if (!has_option(user, {"-arch", "--gpu-architecture"})) opts.push_back("-arch=" + target);
  opts.insert(opts.end(), user.begin(), user.end());
  return opts;
}

struct Binary {
  std::string code;  // cubin, or PTX with its terminating NUL
  std::string lowered_name;
  bool ptx = false;
  int32_t num_params = -1;  // from the PTX entry (Note [Parameter checks]); -1: unknown
};

// Note [Parameter checks]
// launch() checks the argument count and sizes against the kernel's parameters. The runtime gives
// each parameter's size (cudaFuncGetParamInfo) but not their count, and probing past the end is an
// API error that compute-sanitizer reports. So the count is read once, at compile time, from the
// PTX entry's declaration (".entry name(.param ..., .param ...)"), stored with the binary, and only
// valid indices are queried. When it cannot be read, launches are not checked.
int32_t count_ptx_params(const std::string& ptx, const std::string& lowered_name) {
  const std::string head = ".entry " + lowered_name + "(";
  const std::size_t start = ptx.find(head);
  if (start == std::string::npos) return -1;
  const std::size_t open = start + head.size();
  const std::size_t close = ptx.find(')', open);
  if (close == std::string::npos) return -1;
  int32_t n = 0;
  for (std::size_t p = ptx.find(".param", open); p != std::string::npos && p < close; p = ptx.find(".param", p + 6)) ++n;
  return n;
}

class ProgramGuard {
 public:
  explicit ProgramGuard(nvrtcProgram p) : p_(p) {}
  ~ProgramGuard() { (void)nvrtcDestroyProgram(&p_); }
  ProgramGuard(const ProgramGuard&) = delete;
  ProgramGuard& operator=(const ProgramGuard&) = delete;

 private:
  nvrtcProgram p_;
};

Binary compile(const char* op, const std::string& name, const std::string& source,
               const std::vector<std::string>& opts) {
  nvrtcProgram prog = nullptr;
  const char* header_sources[] = {kPrelude};
  const char* header_names[] = {kPreludeName};
  const std::string file_name = file_stem(name) + ".cu";
  FLAME_NVRTC_CHECK(nvrtcCreateProgram(&prog, source.c_str(), file_name.c_str(), 1, header_sources, header_names));
  ProgramGuard guard(prog);
  FLAME_NVRTC_CHECK(nvrtcAddNameExpression(prog, name.c_str()));

  std::vector<const char*> argv;
  argv.reserve(opts.size());
  for (const auto& o : opts) argv.push_back(o.c_str());
  const nvrtcResult result = nvrtcCompileProgram(prog, static_cast<int>(argv.size()), argv.data());

  std::size_t log_size = 0;
  std::string log;
  if (nvrtcGetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    log.resize(log_size);
    if (nvrtcGetProgramLog(prog, log.data()) != NVRTC_SUCCESS) log.clear();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  }
  if (result != NVRTC_SUCCESS) {
    const bool bad_name = log.find("__nv_name_map") != std::string::npos;
    FLAME_FAIL(op, "kernel '", name, "' failed to compile (", nvrtcGetErrorString(result),
               ") with options [", join(opts, " "), "]",
               bad_name ? "; the name must name a __global__ function in the source (a template needs its "
                          "arguments, e.g. scale<float>)"
                        : "",
               "\nNVRTC log:\n", log);
  }

  Binary bin;
  const char* lowered = nullptr;
  FLAME_NVRTC_CHECK(nvrtcGetLoweredName(prog, name.c_str(), &lowered));
  bin.lowered_name = lowered;
  std::size_t size = 0;
  FLAME_NVRTC_CHECK(nvrtcGetCUBINSize(prog, &size));
  if (size > 0) {
    bin.code.resize(size);
    FLAME_NVRTC_CHECK(nvrtcGetCUBIN(prog, bin.code.data()));
  } else {  // a compute_XX target: PTX only
    FLAME_NVRTC_CHECK(nvrtcGetPTXSize(prog, &size));
    bin.code.resize(size);
    FLAME_NVRTC_CHECK(nvrtcGetPTX(prog, bin.code.data()));
    bin.ptx = true;
  }
  if (bin.ptx) {
    bin.num_params = count_ptx_params(bin.code, bin.lowered_name);
  } else if (nvrtcGetPTXSize(prog, &size) == NVRTC_SUCCESS && size > 0) {
    std::string ptx(size, '\0');
    if (nvrtcGetPTX(prog, ptx.data()) == NVRTC_SUCCESS) bin.num_params = count_ptx_params(ptx, bin.lowered_name);
  }
  return bin;
}

// ---- disk entries (Note [Kernel cache]) ----

constexpr char kMagic[8] = {'F', 'L', 'A', 'M', 'E', 'K', 'C', '1'};

struct FileHeader {
  char magic[8];
  uint32_t format;
  uint32_t flags;  // bit 0: PTX
  uint64_t key_size;
  uint64_t lowered_size;
  uint64_t code_size;
  uint64_t checksum;  // fnv1a64 over key, lowered name, code and num_params
  int32_t num_params;
  uint32_t reserved;
};
constexpr uint32_t kFormat = 2;
constexpr uint64_t kMaxEntryBytes = 1ULL << 30;

uint64_t entry_checksum(const std::string& key, const Binary& b) {
  return fnv1a64(&b.num_params, sizeof(b.num_params), fnv1a64(b.code, fnv1a64(b.lowered_name, fnv1a64(key))));
}

enum class DiskRead { hit, miss, reject };

DiskRead read_entry(const fs::path& path, const std::string& key, Binary& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return DiskRead::miss;
  FileHeader h{};
  if (!in.read(reinterpret_cast<char*>(&h), sizeof(h))) return DiskRead::reject;
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.format != kFormat) return DiskRead::reject;
  if (h.key_size != key.size() || h.lowered_size > 4096 || h.code_size == 0 || h.code_size > kMaxEntryBytes)
    return DiskRead::reject;
  std::string stored_key(h.key_size, '\0');
  Binary b;
  b.lowered_name.resize(h.lowered_size);
  b.code.resize(h.code_size);
  if (!in.read(stored_key.data(), static_cast<std::streamsize>(stored_key.size())) ||
      !in.read(b.lowered_name.data(), static_cast<std::streamsize>(b.lowered_name.size())) ||
      !in.read(b.code.data(), static_cast<std::streamsize>(b.code.size())))
    return DiskRead::reject;
  if (in.peek() != std::char_traits<char>::eof()) return DiskRead::reject;  // trailing bytes
  if (stored_key != key || b.lowered_name.empty()) return DiskRead::reject;
  b.ptx = (h.flags & 1u) != 0;
  b.num_params = h.num_params;
  if (h.checksum != entry_checksum(key, b)) return DiskRead::reject;
  out = std::move(b);
  return DiskRead::hit;
}

bool write_entry(const fs::path& path, const std::string& key, const Binary& b) {
  static std::atomic<uint64_t> counter{0};
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) return false;
  fs::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  FileHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.format = kFormat;
  h.flags = b.ptx ? 1u : 0u;
  h.key_size = key.size();
  h.lowered_size = b.lowered_name.size();
  h.code_size = b.code.size();
  h.checksum = entry_checksum(key, b);
  h.num_params = b.num_params;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out.write(key.data(), static_cast<std::streamsize>(key.size()));
    out.write(b.lowered_name.data(), static_cast<std::streamsize>(b.lowered_name.size()));
    out.write(b.code.data(), static_cast<std::streamsize>(b.code.size()));
    out.flush();
    if (!out) {
      out.close();
      fs::remove(tmp, ec);
      return false;
    }
  }
  fs::rename(tmp, path, ec);  // atomic replace on POSIX
  if (ec) {
    fs::remove(tmp, ec);
    return false;
  }
  return true;
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// ---- devices ----

int device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    clear_last_cuda_error();
    return 0;
  }
  return n;
}

int device_arch(int device) {
  const int n = device_count();
  FLAME_CHECK(n > 0, "ensure_kernel", "no CUDA device is available");
  FLAME_CHECK(device >= 0 && device < n, "ensure_kernel", "device cuda:", device, " does not exist (",
              n, " CUDA device", n == 1 ? "" : "s", ")");
  int major = 0, minor = 0;
  FLAME_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FLAME_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}

}  // namespace

// ---- loaded kernels ----

namespace detail {

// A binary loaded into the CUDA runtime; unloaded when the last kernel handle using it is gone.
struct LoadedLibrary {
  cudaLibrary_t library = nullptr;
  ~LoadedLibrary() {
    if (library) (void)cudaLibraryUnload(library);
  }
};

struct LoadedKernel {
  std::shared_ptr<LoadedLibrary> library;
  cudaKernel_t kernel = nullptr;
  std::string name;
  std::string lowered_name;
  int device = 0;
  int arch = 0;
  bool params_known = false;
  std::vector<std::size_t> param_sizes;
  int max_threads_per_block = 0;
  int num_regs = 0;
  std::size_t static_shared_bytes = 0;
  // Dynamic shared memory the kernel may use now; raised on demand by launches above 48 KiB.
  mutable std::atomic<uint32_t> dynamic_shared_limit{0};
  mutable std::mutex attribute_mutex;
};

}  // namespace detail

using detail::LoadedKernel;
using detail::LoadedLibrary;

namespace {

std::shared_ptr<LoadedLibrary> load_library(const Binary& bin) {
  auto lib = std::make_shared<LoadedLibrary>();
  const cudaError_t e = cudaLibraryLoadData(&lib->library, bin.code.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (e != cudaSuccess) {
    lib->library = nullptr;
    clear_last_cuda_error();
    FLAME_FAIL("ensure_kernel", "cudaLibraryLoadData failed: ", cudaGetErrorString(e));
  }
  return lib;
}

std::shared_ptr<LoadedKernel> make_kernel(const std::shared_ptr<LoadedLibrary>& lib, const Binary& bin,
                                          const std::string& name, int device, int arch) {
  auto k = std::make_shared<LoadedKernel>();
  k->library = lib;
  k->name = name;
  k->lowered_name = bin.lowered_name;
  k->device = device;
  k->arch = arch;
  cudaError_t e = cudaLibraryGetKernel(&k->kernel, lib->library, bin.lowered_name.c_str());
  if (e != cudaSuccess) {
    clear_last_cuda_error();
    FLAME_FAIL("ensure_kernel", "kernel '", name, "' (symbol ", bin.lowered_name, ") not found in its binary: ",
               cudaGetErrorString(e));
  }
  DeviceGuard guard(device);
  cudaFuncAttributes attr{};
  e = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(k->kernel));  // loads it on `device`
  if (e != cudaSuccess) {
    clear_last_cuda_error();
    FLAME_FAIL("ensure_kernel", "kernel '", name, "' cannot be loaded on cuda:", device, ": ", cudaGetErrorString(e));
  }
  k->max_threads_per_block = attr.maxThreadsPerBlock;
  k->num_regs = attr.numRegs;
  k->static_shared_bytes = attr.sharedSizeBytes;
  k->dynamic_shared_limit = static_cast<uint32_t>(std::max(0, attr.maxDynamicSharedSizeBytes));
  // Parameter sizes of the known count (Note [Parameter checks]).
  k->params_known = bin.num_params >= 0;
  for (int32_t i = 0; k->params_known && i < bin.num_params; ++i) {
    std::size_t offset = 0, size = 0;
    e = cudaFuncGetParamInfo(reinterpret_cast<const void*>(k->kernel), static_cast<std::size_t>(i), &offset, &size);
    if (e != cudaSuccess) {  // not supported by this driver: launches go unchecked
      clear_last_cuda_error();
      k->params_known = false;
      k->param_sizes.clear();
      break;
    }
    k->param_sizes.push_back(size);
  }
  return k;
}

}  // namespace

// ---- the cache ----

struct CudaKernels::Impl {
  // One binary (one key); its library and per-device handles once loaded.
  struct Slot {
    std::mutex mutex;
    std::optional<Binary> binary;
    std::shared_ptr<LoadedLibrary> library;
    std::map<int, std::shared_ptr<const LoadedKernel>> loaded;  // by device
  };

  std::string disk_dir;
  mutable std::mutex mutex;  // guards slots and arch_by_device
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots;
  std::map<int, int> arch_by_device;

  std::atomic<uint64_t> compiles{0}, memory_hits{0}, disk_hits{0}, disk_writes{0}, disk_rejects{0},
      disk_errors{0}, loads{0};

  int arch_of(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = arch_by_device.find(device);
      if (it != arch_by_device.end()) return it->second;
    }
    const int arch = device_arch(device);
    std::lock_guard<std::mutex> lock(mutex);
    arch_by_device[device] = arch;
    return arch;
  }

  static std::string make_key(const std::string& name, const std::string& source,
                              const std::vector<std::string>& opts, int arch) {
    static const std::string fixed = [] {
      const NvrtcInfo& info = nvrtc_info();
      std::ostringstream os;
      os << "flame-kernel-cache " << kFormat << "\nnvrtc " << info.major << "." << info.minor << "\nprelude "
         << hex64(fnv1a64(std::string(kPrelude))) << "\n";
      return os.str();
    }();
    std::string key = fixed;
    key += "arch " + std::to_string(arch) + "\nname " + std::to_string(name.size()) + ":" + name + "\n";
    for (const auto& o : opts) key += "option " + std::to_string(o.size()) + ":" + o + "\n";
    key += "source " + std::to_string(source.size()) + ":" + source;
    return key;
  }

  fs::path entry_path(const std::string& name, const std::string& key) const {
    return fs::path(disk_dir) / (file_stem(name) + "-" + hex64(fnv1a64(key)) + ".flamek");
  }

  std::shared_ptr<Slot> slot_for(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex);
    auto& s = slots[key];
    if (!s) s = std::make_shared<Slot>();
    return s;
  }

  // Disk lookup into slot.binary (slot locked). True on a hit.
  bool read_disk(Slot& slot, const std::string& name, const std::string& key) {
    if (disk_dir.empty()) return false;
    Binary b;
    switch (read_entry(entry_path(name, key), key, b)) {
      case DiskRead::hit:
        ++disk_hits;
        slot.binary = std::move(b);
        return true;
      case DiskRead::reject:
        ++disk_rejects;
        return false;
      case DiskRead::miss:
        return false;
    }
    return false;
  }

  // Compiles into slot.binary and writes the disk entry (slot locked).
  void compile_into(const char* op, Slot& slot, const std::string& name, const std::string& source,
                    const std::vector<std::string>& opts, const std::string& key) {
    Binary b = compile(op, name, source, opts);
    ++compiles;
    if (!disk_dir.empty()) {
      if (write_entry(entry_path(name, key), key, b)) {
        ++disk_writes;
      } else {
        ++disk_errors;
      }
    }
    slot.binary = std::move(b);
  }
};

std::string default_kernel_cache_dir() {
  if (const char* v = std::getenv("FLAME_KERNEL_CACHE")) {
    const std::string s(v);
    return (s == "off" || s == "0") ? std::string() : s;
  }
  const std::string xdg = env_or_empty("XDG_CACHE_HOME");
  if (!xdg.empty()) return (fs::path(xdg) / "flame" / "kernels").string();
  const std::string home = env_or_empty("HOME");
  if (!home.empty()) return (fs::path(home) / ".cache" / "flame" / "kernels").string();
  return {};
}

CudaKernels::CudaKernels(KernelCacheOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->disk_dir = options.disk_dir.value_or(default_kernel_cache_dir());
}
CudaKernels::~CudaKernels() = default;

CudaKernels& CudaKernels::global() {
  static CudaKernels* instance = new CudaKernels();  // never destroyed: handles outlive exit order
  return *instance;
}

Kernel CudaKernels::ensure_kernel(const std::string& name, const std::string& source,
                                  const std::vector<std::string>& options, int device) {
  FLAME_CHECK(!name.empty(), "ensure_kernel", "empty kernel name");
  const int arch = impl_->arch_of(device);
  const std::vector<std::string> opts = full_options(options, target_for(arch));
  const std::string key = Impl::make_key(name, source, opts, arch);
  auto slot = impl_->slot_for(key);
  std::lock_guard<std::mutex> lock(slot->mutex);
  if (auto it = slot->loaded.find(device); it != slot->loaded.end()) {
    ++impl_->memory_hits;
    return Kernel(it->second);
  }
  if (!slot->library) {
    bool from_disk = slot->binary.has_value() ? false : impl_->read_disk(*slot, name, key);
    if (slot->binary) {
      try {
        slot->library = load_library(*slot->binary);
        auto k = make_kernel(slot->library, *slot->binary, name, device, arch);
        ++impl_->loads;
        slot->loaded[device] = k;
        return Kernel(k);
      } catch (const Error&) {
        if (!from_disk) throw;
        ++impl_->disk_rejects;  // a cached binary the runtime refused: build it again
        slot->library.reset();
        slot->binary.reset();
      }
    }
    impl_->compile_into("ensure_kernel", *slot, name, source, opts, key);
    slot->library = load_library(*slot->binary);
  }
  auto k = make_kernel(slot->library, *slot->binary, name, device, arch);
  ++impl_->loads;
  slot->loaded[device] = k;
  return Kernel(k);
}

bool CudaKernels::precompile(const std::string& name, const std::string& source,
                             const std::vector<std::string>& options, int arch) {
  FLAME_CHECK(!name.empty(), "precompile", "empty kernel name");
  FLAME_CHECK(arch >= 10, "precompile", "architecture ", arch, " is not a compute capability like 90");
  const std::vector<std::string> opts = full_options(options, target_for(arch));
  const std::string key = Impl::make_key(name, source, opts, arch);
  auto slot = impl_->slot_for(key);
  std::lock_guard<std::mutex> lock(slot->mutex);
  if (slot->binary) {
    ++impl_->memory_hits;
    return true;
  }
  if (impl_->read_disk(*slot, name, key)) return true;
  impl_->compile_into("precompile", *slot, name, source, opts, key);
  return false;
}

KernelCacheStats CudaKernels::stats() const {
  KernelCacheStats s;
  s.compiles = impl_->compiles;
  s.memory_hits = impl_->memory_hits;
  s.disk_hits = impl_->disk_hits;
  s.disk_writes = impl_->disk_writes;
  s.disk_rejects = impl_->disk_rejects;
  s.disk_errors = impl_->disk_errors;
  s.loads = impl_->loads;
  return s;
}

const std::string& CudaKernels::disk_dir() const { return impl_->disk_dir; }

void CudaKernels::clear_memory_cache() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->slots.clear();
}

Kernel ensure_kernel(const std::string& name, const std::string& source, const std::vector<std::string>& options,
                     int device) {
  return CudaKernels::global().ensure_kernel(name, source, options, device);
}

bool kernel_compiler_available() { return true; }

std::string cuda_include_dir() {
  std::vector<fs::path> candidates;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"}) {
    const std::string v = env_or_empty(var);
    if (!v.empty()) candidates.push_back(fs::path(v) / "include");
  }
  candidates.push_back("/usr/local/cuda/include");
  for (const auto& c : candidates) {
    std::error_code ec;
    if (fs::exists(c / "cuda_fp16.h", ec)) return c.string();
  }
  return {};
}

// ---- Kernel accessors ----

namespace {
const LoadedKernel& checked(const Kernel& k, const char* what) {
  FLAME_CHECK(k.defined(), what, "empty kernel handle (use ensure_kernel)");
  return *k.impl();
}
}  // namespace

const std::string& Kernel::name() const { return checked(*this, "Kernel::name").name; }
const std::string& Kernel::lowered_name() const { return checked(*this, "Kernel::lowered_name").lowered_name; }
int Kernel::device() const { return checked(*this, "Kernel::device").device; }
int Kernel::arch() const { return checked(*this, "Kernel::arch").arch; }
int Kernel::num_params() const {
  const LoadedKernel& k = checked(*this, "Kernel::num_params");
  return k.params_known ? static_cast<int>(k.param_sizes.size()) : -1;
}
std::size_t Kernel::param_size(int index) const {
  const LoadedKernel& k = checked(*this, "Kernel::param_size");
  FLAME_CHECK(k.params_known && index >= 0 && static_cast<std::size_t>(index) < k.param_sizes.size(),
              "Kernel::param_size", "kernel '", k.name, "' has no parameter ", index);
  return k.param_sizes[static_cast<std::size_t>(index)];
}
int Kernel::max_threads_per_block() const { return checked(*this, "Kernel::max_threads_per_block").max_threads_per_block; }
int Kernel::num_regs() const { return checked(*this, "Kernel::num_regs").num_regs; }
std::size_t Kernel::static_shared_bytes() const {
  return checked(*this, "Kernel::static_shared_bytes").static_shared_bytes;
}
void* Kernel::handle() const { return reinterpret_cast<void*>(checked(*this, "Kernel::handle").kernel); }

// ---- launch ----

namespace detail {

void launch_args(const Kernel& kernel, const LaunchConfig& c, const KernelArg* args, std::size_t count) {
  const LoadedKernel& k = checked(kernel, "launch");
  if (k.params_known)
    FLAME_CHECK(count == k.param_sizes.size(), "launch", "kernel '", k.name, "' takes ", k.param_sizes.size(),
                " parameter", k.param_sizes.size() == 1 ? "" : "s", ", ", count, " argument",
                count == 1 ? " was" : "s were", " given");

  constexpr std::size_t kInline = 16;
  void* inline_params[kInline];
  void* inline_pointers[kInline];
  std::vector<void*> heap_params, heap_pointers;
  void** params = inline_params;
  void** pointers = inline_pointers;
  if (count > kInline) {
    heap_params.resize(count);
    heap_pointers.resize(count);
    params = heap_params.data();
    pointers = heap_pointers.data();
  }
  const Device want = Device::cuda(k.device);
  for (std::size_t i = 0; i < count; ++i) {
    const KernelArg& a = args[i];
    if (a.tensor) {
      const Tensor& t = *a.tensor;
      FLAME_CHECK(t.defined(), "launch", "kernel '", k.name, "': argument ", i, " is an undefined tensor");
      FLAME_CHECK(t.device() == want, "launch", "kernel '", k.name, "': argument ", i, " is a tensor on ",
                  t.device().str(), ", the kernel is loaded on ", want.str());
      pointers[i] = t.data_ptr();
      params[i] = &pointers[i];
    } else {
      params[i] = const_cast<void*>(a.value);
    }
    if (k.params_known && a.size != k.param_sizes[i])
      FLAME_FAIL("launch", "kernel '", k.name, "': argument ", i, " has ", a.size, " bytes but parameter ", i,
                 " has ", k.param_sizes[i], a.tensor ? " (a tensor is passed as an 8-byte pointer)" : "",
                 a.size == 8 && k.param_sizes[i] == 4 ? " (pass a float or int32, not a double or int64?)" : "",
                 a.size == 4 && k.param_sizes[i] == 8 ? " (pass an int64 or double, not an int or float?)" : "");
  }

  const Dim3 g = c.grid, b = c.block;
  if (g.x == 0 || g.y == 0 || g.z == 0) return;  // an empty grid: nothing to do
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  FLAME_CHECK(threads >= 1 && threads <= static_cast<uint64_t>(k.max_threads_per_block), "launch", "kernel '",
              k.name, "': block [", b.x, ", ", b.y, ", ", b.z, "] has ", threads,
              " threads; this kernel allows at most ", k.max_threads_per_block);

  DeviceGuard guard(k.device);
  const void* func = reinterpret_cast<const void*>(k.kernel);
  if (c.shared_mem > k.dynamic_shared_limit.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(k.attribute_mutex);
    if (c.shared_mem > k.dynamic_shared_limit.load()) {
      const cudaError_t e =
          cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(c.shared_mem));
      if (e != cudaSuccess) {
        clear_last_cuda_error();
        FLAME_FAIL("launch", "kernel '", k.name, "': ", c.shared_mem, " bytes of dynamic shared memory (plus ",
                   k.static_shared_bytes, " static) are more than cuda:", k.device, " allows: ", cudaGetErrorString(e));
      }
      k.dynamic_shared_limit.store(c.shared_mem, std::memory_order_release);
    }
  }
  auto stream = static_cast<cudaStream_t>(current_stream(k.device));
  const cudaError_t e =
      cudaLaunchKernel(func, dim3(g.x, g.y, g.z), dim3(b.x, b.y, b.z), params, c.shared_mem, stream);
  if (e != cudaSuccess) {
    clear_last_cuda_error();
    FLAME_FAIL("launch", "kernel '", k.name, "' on cuda:", k.device, " with grid [", g.x, ", ", g.y, ", ", g.z,
               "], block [", b.x, ", ", b.y, ", ", b.z, "], ", c.shared_mem,
               " bytes of shared memory failed: ", cudaGetErrorString(e));
  }
  // Note [Launch blocking] (cuda_backend.cu): wait, so a fault is blamed on this kernel.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (::flame::backend::cuda::launch_blocking() && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusNone) {
    const cudaError_t r = cudaStreamSynchronize(stream);
    if (r != cudaSuccess) {
      clear_last_cuda_error();
      FLAME_FAIL("launch", "kernel '", k.name, "' on cuda:", k.device, " failed while running: ", cudaGetErrorName(r),
                 ": ", cudaGetErrorString(r));
    }
  }
}

}  // namespace detail
}  // namespace flame::cuda
