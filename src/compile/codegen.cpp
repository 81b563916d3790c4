// CUDA code generation for fused regions.
//
// Note [Generated kernels]
// One Expr becomes one extern "C" kernel whose source is
//   the embedded headers (flame/macros.h, flame/half.h, src/opdef/scalar_math.h: the very text the
//   eager CPU and CUDA kernels are compiled from, embedded at build time by CMake, with a few
//   std:: shims because NVRTC has no standard library) + a generated body.
// The body is a grid-stride loop over the iteration shape. Shapes and strides are static (a new
// shape or layout is a new trace), so they are baked into the source as constants: the index
// arithmetic divides by constants, dims that every operand walks contiguously are merged first,
// and an input laid out like the output is read at the flat index. Values are computed with the
// op's functor (flame::fn::Relu{}(x, params)) in the compute type, and the source is compiled and
// cached (memory and disk) by the existing NVRTC cache (src/backend/cuda/jit.cpp): the second
// process finds the binary on disk.
//
// Note [Rounding]
// After every node the value is rounded through its dtype (bf16 -> float after a bf16 op), which
// is what the eager ops store between kernels: a fused chain gives the eager results bit for bit
// (libm differences aside), and the CPU interpreter of the same Expr is an exact reference. For
// f32/f64 the round trip is a no-op the compiler removes; for bf16/f16 it costs two integer ops.
// For the same reason kernels are compiled with --fmad=false: x * s + b stays a rounded multiply
// and a rounded add, as the two eager kernels compute it, not one fused multiply-add.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "flame/cuda/kernels.h"
#include "src/compile/ir.h"
#include "src/core/tensor_impl.h"

namespace flame::compile_detail {

// Embedded at build time (CMake writes it into the build tree): the headers' text, concatenated.
extern const char* const kFusionHeaders;

std::atomic<int64_t> g_kernel_launches{0};
constexpr int kUnroll = 8;  // elements per thread per tile: enough bytes in flight for HBM
std::atomic<int64_t> g_kernel_sources{0};

namespace {

constexpr const char* kShims = R"FLAMESHIM(// std:: pieces that scalar_math.h and half.h use (NVRTC has no standard library).
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
// half.h's bit casts; with a constant size the loop folds into a register move.
__host__ __device__ __forceinline__ void* flame_shim_memcpy(void* d, const void* s, size_t n) {
  char* dc = static_cast<char*>(d);
  const char* sc = static_cast<const char*>(s);
  for (size_t i = 0; i < n; ++i) dc[i] = sc[i];
  return d;
}
#define memcpy flame_shim_memcpy
namespace std {
template <class T, T v> struct integral_constant { static constexpr T value = v; };
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> inline constexpr bool is_same_v = is_same<A, B>::value;
template <class T> struct remove_cv { typedef T type; };
template <class T> struct remove_cv<const T> { typedef T type; };
template <class T> struct remove_cv<volatile T> { typedef T type; };
template <class T> struct remove_cv<const volatile T> { typedef T type; };
template <class T> struct is_fp_ : false_type {};
template <> struct is_fp_<float> : true_type {};
template <> struct is_fp_<double> : true_type {};
template <class T> struct is_floating_point : is_fp_<typename remove_cv<T>::type> {};
template <class T> inline constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_int_ : false_type {};
template <> struct is_int_<bool> : true_type {};
template <> struct is_int_<char> : true_type {};
template <> struct is_int_<signed char> : true_type {};
template <> struct is_int_<unsigned char> : true_type {};
template <> struct is_int_<short> : true_type {};
template <> struct is_int_<unsigned short> : true_type {};
template <> struct is_int_<int> : true_type {};
template <> struct is_int_<unsigned int> : true_type {};
template <> struct is_int_<long> : true_type {};
template <> struct is_int_<unsigned long> : true_type {};
template <> struct is_int_<long long> : true_type {};
template <> struct is_int_<unsigned long long> : true_type {};
template <class T> struct is_integral : is_int_<typename remove_cv<T>::type> {};
template <class T> inline constexpr bool is_integral_v = is_integral<T>::value;
template <class T> struct numeric_limits;
#define FLAME_SHIM_LIMITS(T, lo, hi) \
  template <> struct numeric_limits<T> { \
    static constexpr __host__ __device__ T min() { return lo; } \
    static constexpr __host__ __device__ T max() { return hi; } };
FLAME_SHIM_LIMITS(signed char, -128, 127)
FLAME_SHIM_LIMITS(unsigned char, 0, 255)
FLAME_SHIM_LIMITS(short, -32768, 32767)
FLAME_SHIM_LIMITS(unsigned short, 0, 65535)
FLAME_SHIM_LIMITS(int, -2147483647 - 1, 2147483647)
FLAME_SHIM_LIMITS(unsigned int, 0u, 4294967295u)
FLAME_SHIM_LIMITS(long, -9223372036854775807L - 1, 9223372036854775807L)
FLAME_SHIM_LIMITS(unsigned long, 0ul, 18446744073709551615ul)
#undef FLAME_SHIM_LIMITS
}  // namespace std
)FLAMESHIM";

// The embedded headers without their #include / #pragma once lines, after the shims.
const std::string& prelude() {
  static const std::string text = [] {
    std::string out = kShims;
    std::istringstream in(kFusionHeaders);
    std::string line;
    while (std::getline(in, line)) {
      const auto first = line.find_first_not_of(" \t");
      if (first != std::string::npos && (line.compare(first, 8, "#include") == 0 ||
                                         line.compare(first, 12, "#pragma once") == 0)) {
        continue;
      }
      out += line;
      out += '\n';
    }
    out +=
        "__device__ __forceinline__ double flame_d(unsigned long long b) { return __longlong_as_double((long "
        "long)b); }\n";
    return out;
  }();
  return text;
}

const char* element_type(DType dt) {
  switch (dt) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::bf16: return "flame::bfloat16";
    case DType::f16: return "flame::float16";
    case DType::i32: return "int32_t";
    case DType::i64: return "int64_t";
    case DType::u8: return "uint8_t";
    case DType::boolean: return "bool";
    default: break;  // 8-bit floats are never traced: their ops raise first
  }
  return "?";
}

const char* unary_functor(backend::UnaryOp op) {
  switch (op) {
#define FLAME_F(name, Functor, kind, ...) \
  case backend::UnaryOp::name: return #Functor;
    FLAME_UNARY_OPS(FLAME_F)
#undef FLAME_F
  }
  return "?";
}
const char* binary_functor(backend::BinaryOp op) {
  switch (op) {
#define FLAME_F(name, Functor, kind, ...) \
  case backend::BinaryOp::name: return #Functor;
    FLAME_BINARY_OPS(FLAME_F)
#undef FLAME_F
  }
  return "?";
}

// A double, exactly (NaN and infinities included).
std::string dlit(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  char buf[48];
  std::snprintf(buf, sizeof(buf), "flame_d(0x%016llxull)", static_cast<unsigned long long>(bits));
  return buf;
}

// Strides (in elements) of t read over `shape` (right-aligned broadcasting: 0 on broadcast dims).
Shape broadcast_strides(const OperandLayout& t, const Shape& shape) {
  const std::size_t n = shape.size(), m = t.sizes.size();
  Shape s(n, 0);
  for (std::size_t i = 0; i < m; ++i) {
    const std::size_t d = n - m + i;
    s[d] = t.sizes[i] == 1 && shape[d] != 1 ? 0 : t.strides[i];
  }
  return s;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::vector<OperandLayout> layouts_of(const TensorList& inputs) {
  std::vector<OperandLayout> out;
  for (const Tensor& t : inputs) out.push_back(OperandLayout{t.dtype(), t.sizes(), t.strides()});
  return out;
}

std::string generate_kernel_source(const Expr& e, const std::vector<OperandLayout>& inputs, std::string* kernel_name) {
  // Operand layouts over the iteration shape; dims of size 1 dropped, mergeable dims merged.
  Shape shape;
  std::vector<Shape> strides(inputs.size());
  {
    std::vector<Shape> full(inputs.size());
    for (std::size_t k = 0; k < inputs.size(); ++k) full[k] = broadcast_strides(inputs[k], e.shape);
    std::vector<int64_t> dims;
    for (std::size_t d = 0; d < e.shape.size(); ++d) {
      if (e.shape[d] != 1) dims.push_back(static_cast<int64_t>(d));
    }
    // Walk from the innermost dim outwards, merging d into the current group when every input
    // steps over it as one longer dim (the outputs are contiguous: they always do).
    std::vector<int64_t> sizes_rev;
    std::vector<Shape> strides_rev(inputs.size());
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
      const auto d = static_cast<std::size_t>(*it);
      bool merge = !sizes_rev.empty();
      if (merge) {
        for (std::size_t k = 0; k < inputs.size() && merge; ++k) {
          merge = full[k][d] == strides_rev[k].back() * sizes_rev.back();
        }
      }
      if (merge) {
        sizes_rev.back() *= e.shape[d];
      } else {
        sizes_rev.push_back(e.shape[d]);
        for (std::size_t k = 0; k < inputs.size(); ++k) strides_rev[k].push_back(full[k][d]);
      }
    }
    shape.assign(sizes_rev.rbegin(), sizes_rev.rend());
    for (std::size_t k = 0; k < inputs.size(); ++k) strides[k].assign(strides_rev[k].rbegin(), strides_rev[k].rend());
  }
  int64_t n = 1;
  for (int64_t s : e.shape) n *= s;
  int64_t max_offset = n;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    int64_t reach = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) reach += (shape[d] - 1) * std::abs(strides[k][d]);
    max_offset = std::max(max_offset, reach + 1);
  }
  const char* idx = max_offset < (int64_t{1} << 31) ? "unsigned" : "unsigned long long";

  std::ostringstream body;
  body << "(";
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    body << (k ? ", " : "") << "const " << element_type(inputs[k].dtype) << "* __restrict__ in" << k;
  }
  for (std::size_t o = 0; o < e.outputs.size(); ++o) {
    body << (inputs.empty() && o == 0 ? "" : ", ") << element_type(e.nodes[e.outputs[o]].dtype) << "* __restrict__ out"
         << o;
  }
  body << ") {\n  typedef " << idx << " I;\n";
  // Each block covers tiles of kUnroll * 256 elements, each thread kUnroll of them 256 apart
  // (coalesced), unrolled so that the loads of all of them are in flight together.
  body << "  for (I t = (I)blockIdx.x * (I)" << kUnroll * 256 << "u + (I)threadIdx.x; t < (I)" << n
       << "ull; t += (I)gridDim.x * (I)" << kUnroll * 256 << "u) {\n";
  body << "   #pragma unroll\n   for (I u = 0; u < (I)" << kUnroll << "u; ++u) {\n";
  body << "    const I i = t + u * (I)256u;\n    if (i >= (I)" << n << "ull) break;\n";
  // Coordinates, innermost first (only when some input needs them).
  const Shape contiguous = contiguous_strides(shape);
  bool need_coords = false;
  std::vector<bool> flat(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    flat[k] = strides[k] == contiguous;
    need_coords = need_coords || !flat[k];
  }
  if (need_coords && !shape.empty()) {
    body << "    I r = i;\n";
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (d == 0) {
        body << "    const I c0 = r;\n";
      } else {
        body << "    const I c" << d << " = r % (I)" << shape[d] << "ull; r /= (I)" << shape[d] << "ull;\n";
      }
    }
  }
  auto offset = [&](std::size_t k) {
    if (flat[k]) return std::string("i");
    std::ostringstream s;
    bool any = false;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      if (strides[k][d] == 0) continue;
      s << (any ? " + " : "") << "c" << d << " * (I)" << strides[k][d] << "ll";
      any = true;
    }
    return any ? s.str() : std::string("0");
  };
  for (std::size_t i = 0; i < e.nodes.size(); ++i) {
    const ExprNode& nd = e.nodes[i];
    const char* T = element_type(nd.dtype);
    // Streams, not std::string concatenation (GCC 12 reports a false -Wrestrict on the latter).
    std::ostringstream x;
    switch (nd.op) {
      case ExprOp::input:
        x << "in" << nd.slot << "[" << offset(static_cast<std::size_t>(nd.slot)) << "]";
        break;
      case ExprOp::constant: x << dlit(nd.value); break;
      case ExprOp::unary:
        x << "flame::fn::" << unary_functor(nd.unary) << "{}(v" << nd.a << ", flame::fn::UnaryParams{"
          << dlit(nd.params.a) << ", " << dlit(nd.params.b) << ", " << dlit(nd.params.c) << "})";
        break;
      case ExprOp::binary: x << "flame::fn::" << binary_functor(nd.binary) << "{}(v" << nd.a << ", v" << nd.b << ")"; break;
      case ExprOp::where: x << "v" << nd.c << " ? v" << nd.a << " : v" << nd.b; break;
      case ExprOp::cast: x << "v" << nd.a; break;
      case ExprOp::eager: FLAME_FAIL("compile", "an eager op inside a fused expression");
    }
    body << "    const flame::compute_t<" << T << "> v" << i << " = ";
    if (nd.op == ExprOp::input || nd.op == ExprOp::constant) {
      body << "flame::convert<flame::compute_t<" << T << ">>(" << x.str() << ")";
    } else {  // Note [Rounding]
      body << "flame::convert<flame::compute_t<" << T << ">>(flame::convert<" << T << ">(" << x.str() << "))";
    }
    body << ";  // " << expr_op_name(nd) << "\n";
  }
  for (std::size_t o = 0; o < e.outputs.size(); ++o) {
    const int node = e.outputs[o];
    body << "    out" << o << "[i] = flame::convert<" << element_type(e.nodes[node].dtype) << ">(v" << node << ");\n";
  }
  body << "   }\n  }\n}\n";
  const std::string text = body.str();
  char name[40];
  std::snprintf(name, sizeof(name), "flame_fused_%016llx", static_cast<unsigned long long>(fnv1a(text)));
  *kernel_name = name;
  std::ostringstream src;
  src << prelude() << "\nextern \"C\" __global__ void __launch_bounds__(256) " << name << text;
  return src.str();
}

#ifdef FLAME_WITH_CUDA
// Kernels of one Expr by operand layout, so a replay does not rebuild the source (Note
// [Generated kernels]); shared by copies of the Expr.
struct ExprKernelCache {
  std::mutex mu;
  std::unordered_map<std::string, cuda::Kernel> kernels;
};

namespace {
std::mutex g_cache_mu;
std::unordered_map<const Expr*, std::shared_ptr<ExprKernelCache>>& caches() {
  static auto* m = new std::unordered_map<const Expr*, std::shared_ptr<ExprKernelCache>>();
  return *m;
}
}  // namespace
#endif

TensorList launch_expr(const Expr& e, const TensorList& inputs, const std::string& tag) {
#ifdef FLAME_WITH_CUDA
  const Device dev = inputs[0].device();
  std::string key = std::to_string(dev.index);
  for (const Tensor& t : inputs) {
    FLAME_CHECK(t.device() == dev, "compile", tag, ": inputs on ", dev.str(), " and ", t.device().str());
    key += '|';
    key += dtype_name(t.dtype());
    for (int64_t s : t.sizes()) key += ',' + std::to_string(s);
    key += ':';
    for (int64_t s : t.strides()) key += ',' + std::to_string(s);
  }
  std::shared_ptr<ExprKernelCache> cache;
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    auto& slot = caches()[&e];
    if (!slot) slot = std::make_shared<ExprKernelCache>();
    cache = slot;
  }
  cuda::Kernel kernel;
  {
    std::lock_guard<std::mutex> lock(cache->mu);
    auto it = cache->kernels.find(key);
    if (it != cache->kernels.end()) {
      kernel = it->second;
    } else {
      std::string name;
      const std::string src = generate_kernel_source(e, layouts_of(inputs), &name);
      kernel = cuda::ensure_kernel(name, src, {"--fmad=false"}, dev.index);  // Note [Rounding]
      ++g_kernel_sources;
      cache->kernels.emplace(key, kernel);
    }
  }
  TensorList outs;
  std::vector<cuda::detail::KernelArg> args;
  for (const Tensor& t : inputs) args.push_back(cuda::detail::kernel_arg(t));
  for (int o : e.outputs) outs.push_back(make_empty(e.shape, e.nodes[o].dtype, dev, "compile"));
  for (const Tensor& t : outs) args.push_back(cuda::detail::kernel_arg(t));
  int64_t n = 1;
  for (int64_t s : e.shape) n *= s;
  if (n > 0) {
    cuda::LaunchConfig cfg;
    const int64_t tile = int64_t{kUnroll} * 256;  // the generated loop's (Note [Generated kernels])
    const int64_t blocks = std::min<int64_t>((n + tile - 1) / tile, int64_t{1} << 20);
    cfg.grid = cuda::Dim3(static_cast<uint32_t>(blocks));
    cfg.block = cuda::Dim3(256);
    cuda::detail::launch_args(kernel, cfg, args.data(), args.size());
    ++g_kernel_launches;
  }
  return outs;
#else
  (void)e;
  (void)inputs;
  FLAME_FAIL("compile", tag, ": CUDA tensors, but FLAME was built without CUDA");
#endif
}

// Forgets the kernel cache of an Expr about to be destroyed (its address may be reused).
void forget_expr_kernels(const Expr* e) {
#ifdef FLAME_WITH_CUDA
  std::lock_guard<std::mutex> lock(g_cache_mu);
  caches().erase(e);
#else
  (void)e;
#endif
}

}  // namespace flame::compile_detail
