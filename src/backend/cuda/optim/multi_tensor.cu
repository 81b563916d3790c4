// Note [Multi-tensor apply]
// The fused optimizer and EMA kernels update a whole list of tensors in one launch. The launcher
// packs, for up to kMaxTensors tensors, their pointers, sizes and per-tensor scalars into ONE
// kernel-argument struct (passed as __grid_constant__, so it stays in the parameter bank: CUDA
// 12.1+ allows 32,764 bytes of kernel parameters on Volta and later), plus a prefix table of
// each tensor's first chunk. Each tensor is cut into chunks of kChunk elements; as many blocks
// as fit on the GPU at once (occupancy, so no block waits for a second wave) walk the global
// chunk list grid-stride and find a chunk's tensor by binary search in the prefix table
// (uniform across the block: a broadcast read of the parameter bank). Inside a chunk, threads
// take 4 elements at a time with vector loads (16 bytes for f32) when every pointer of that
// tensor is aligned to 4 elements, and one at a time otherwise. Lists longer than kMaxTensors
// take ceil(n / kMaxTensors) launches.
//
// Nothing here allocates, synchronises or reads device memory on the host, so a step can be
// captured into a CUDA graph. A non-capturable step bakes its host-side scalars (lr, bias
// corrections) into the kernel arguments, so a replay repeats them, as with torch's
// non-capturable fused optimizers; a capturable step (Note [Capturable optimizers]) passes
// pointers to the hyperparameters and step counts instead, read by every block at kernel time.
//
// The element math is shared with the CPU reference (Note [Optimizer element math]).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "src/backend/fused/multi_tensor.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/optim_math.h"

namespace flame::backend::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 32768;  // elements; a multiple of 4 so chunks keep the vector alignment
constexpr int kMaxTensors = 272;
constexpr int kMaxEmaTensors = 800;

struct OptimTensorArgs {
  void* param;
  const void* grad;
  void* master;
  void* state[3];
  void* low;  // f32 parameters: the kept bf16/f16 copy (OptimTensor::low), or null
  int64_t numel;
  double step_size;
  double bias2_sqrt;
  uint64_t rng_index;
  uint64_t rng_offset;
  const double* device_step;  // capturable steps: t, from which the three scalars above are computed
  int32_t first;
  int16_t aligned;
  int16_t low_kind;  // LowKind of `low`
};

enum LowKind : int16_t { kLowNone = 0, kLowBf16 = 1, kLowF16 = 2 };

struct OptimLaunchArgs {
  OptimHyper hyper;
  int32_t count;
  int32_t chunk_start[kMaxTensors + 1];  // first global chunk of each tensor; [count] = total
  OptimTensorArgs tensors[kMaxTensors];
};
static_assert(sizeof(OptimLaunchArgs) <= 32764, "kernel arguments exceed the 32,764-byte limit");

struct EmaTensorArgs {
  void* shadow;
  const void* param;
  int64_t numel;
  int64_t aligned;
};

struct EmaLaunchArgs {
  double weight;
  // Capturable EMA: the update count read at kernel time; weight = 1 - decay_at(*step).
  const double* step;
  double decay;
  int32_t warmup;
  int32_t count;
  int32_t chunk_start[kMaxEmaTensors + 1];
  EmaTensorArgs tensors[kMaxEmaTensors];
};
static_assert(sizeof(EmaLaunchArgs) <= 32764, "kernel arguments exceed the 32,764-byte limit");

// Index k with chunk_start[k] <= c < chunk_start[k + 1].
__device__ __forceinline__ int find_tensor(const int32_t* chunk_start, int count, int32_t c) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (chunk_start[mid] <= c) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Four consecutive elements, aligned to their size (16 bytes for f32, 8 for half types).
template <class T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

template <class T>
__device__ __forceinline__ Vec4<T> load4(const T* p, int64_t i) {
  return *reinterpret_cast<const Vec4<T>*>(p + i);
}
template <class T>
__device__ __forceinline__ void store4(T* p, int64_t i, const Vec4<T>& v) {
  *reinterpret_cast<Vec4<T>*>(p + i) = v;
}

template <class C, class T>
__device__ __forceinline__ C to_c(T x) {
  return dconvert<C>(x);
}

// The update of element i (or of 4 elements at i with vector access) of one tensor.
// P: parameter type; S: state/master type; C: compute type; K: the optimizer.
template <class P, class S, OptimKind K, bool kMaster>
struct OptimElement {
  using C = compute_t<S>;
  const optim_math::Hyper<C>& h;
  const OptimHyper& raw;
  const OptimTensorArgs& t;
  const optim_math::StepScalars& sc;  // t's step size, bias correction and rounding offset

  __device__ __forceinline__ void update(C& p, C g, C& s0, C& s1, C& s2) const {
    if constexpr (K == OptimKind::sgd) {
      optim_math::sgd_update(h, t.first != 0, p, g, s0);
    } else if constexpr (K == OptimKind::adam) {
      optim_math::adam_update(h, static_cast<C>(sc.step_size), static_cast<C>(sc.bias2_sqrt), p, g, s0, s1, s2);
    } else {
      optim_math::lion_update(h, p, g, s0);
    }
  }

  __device__ __forceinline__ P round_param(C p, int64_t i) const {
    if constexpr (kMaster && std::is_same_v<P, bfloat16>) {
      if (raw.stochastic_rounding) {
        const uint32_t bits =
            optim_math::rounding_bits(raw.seed, t.rng_index + static_cast<uint64_t>(i), sc.rng_offset);
        return optim_math::stochastic_round_bf16(static_cast<float>(static_cast<S>(p)), bits);
      }
    }
    if constexpr (kMaster) {
      return dconvert<P>(static_cast<S>(p));  // the rounded master, as the CPU reference writes it
    } else {
      return dconvert<P>(p);
    }
  }

  // The kept low-precision copy of an f32 parameter: element i (or 4 from i) rounded as a cast.
  __device__ __forceinline__ void store_low(int64_t i, float v) const {
    if (t.low_kind == kLowBf16) static_cast<bfloat16*>(t.low)[i] = dconvert<bfloat16>(v);
    else static_cast<float16*>(t.low)[i] = dconvert<float16>(v);
  }
  template <class H>
  __device__ __forceinline__ void store_low4_as(int64_t i, const float* v) const {
    Vec4<H> lv;
#pragma unroll
    for (int j = 0; j < 4; ++j) lv.v[j] = dconvert<H>(v[j]);
    store4(static_cast<H*>(t.low), i, lv);
  }
  __device__ __forceinline__ void store_low4(int64_t i, const float* v) const {
    if (t.low_kind == kLowBf16) store_low4_as<bfloat16>(i, v);
    else store_low4_as<float16>(i, v);
  }
  static constexpr bool kHasLow = !kMaster && std::is_same_v<P, float>;

  // Which state slots this optimizer reads and writes.
  __device__ __forceinline__ bool has(int slot) const { return t.state[slot] != nullptr; }

  __device__ __forceinline__ void scalar(int64_t i) const {
    P* param = static_cast<P*>(t.param);
    S* master = static_cast<S*>(t.master);
    S* st[3] = {static_cast<S*>(t.state[0]), static_cast<S*>(t.state[1]), static_cast<S*>(t.state[2])};
    C p = kMaster ? to_c<C>(master[i]) : to_c<C>(param[i]);
    const C g = to_c<C>(static_cast<const P*>(t.grad)[i]);
    C s[3] = {C(0), C(0), C(0)};
    const bool skip0 = K == OptimKind::sgd && t.first != 0;
#pragma unroll
    for (int k = 0; k < 3; ++k)
      if (st[k] && !(k == 0 && skip0)) s[k] = to_c<C>(st[k][i]);
    update(p, g, s[0], s[1], s[2]);
#pragma unroll
    for (int k = 0; k < 3; ++k)
      if (st[k]) st[k][i] = dconvert<S>(s[k]);
    if constexpr (kMaster) master[i] = dconvert<S>(p);
    const P out = round_param(p, i);
    param[i] = out;
    if constexpr (kHasLow) {
      if (t.low_kind != kLowNone) store_low(i, out);
    }
  }

  __device__ __forceinline__ void vector(int64_t i) const {
    P* param = static_cast<P*>(t.param);
    S* master = static_cast<S*>(t.master);
    S* st[3] = {static_cast<S*>(t.state[0]), static_cast<S*>(t.state[1]), static_cast<S*>(t.state[2])};
    C p[4], g[4], s[3][4];
    if constexpr (kMaster) {
      const Vec4<S> mv = load4(master, i);
#pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = to_c<C>(mv.v[j]);
    } else {
      const Vec4<P> pv = load4(param, i);
#pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = to_c<C>(pv.v[j]);
    }
    const Vec4<P> gv = load4(static_cast<const P*>(t.grad), i);
#pragma unroll
    for (int j = 0; j < 4; ++j) g[j] = to_c<C>(gv.v[j]);
    const bool skip0 = K == OptimKind::sgd && t.first != 0;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (st[k] && !(k == 0 && skip0)) {
        const Vec4<S> sv = load4(st[k], i);
#pragma unroll
        for (int j = 0; j < 4; ++j) s[k][j] = to_c<C>(sv.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) s[k][j] = C(0);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) update(p[j], g[j], s[0][j], s[1][j], s[2][j]);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (st[k]) {
        Vec4<S> sv;
#pragma unroll
        for (int j = 0; j < 4; ++j) sv.v[j] = dconvert<S>(s[k][j]);
        store4(st[k], i, sv);
      }
    }
    if constexpr (kMaster) {
      Vec4<S> mv;
#pragma unroll
      for (int j = 0; j < 4; ++j) mv.v[j] = dconvert<S>(p[j]);
      store4(master, i, mv);
    }
    Vec4<P> pv;
#pragma unroll
    for (int j = 0; j < 4; ++j) pv.v[j] = round_param(p[j], i + j);
    store4(param, i, pv);
    if constexpr (kHasLow) {
      if (t.low_kind != kLowNone) store_low4(i, pv.v);
    }
  }
};

template <class P, class S, OptimKind K, bool kMaster>
__global__ void __launch_bounds__(kThreads) optim_kernel(const __grid_constant__ OptimLaunchArgs args) {
  using C = compute_t<S>;
  const OptimHyper raw = optim_math::resolve_hyper(args.hyper);
  const optim_math::Hyper<C> h = optim_math::make_hyper<C>(raw);
  const int32_t total = args.chunk_start[args.count];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const int k = find_tensor(args.chunk_start, args.count, c);
    const OptimTensorArgs& t = args.tensors[k];
    const optim_math::StepScalars sc = optim_math::step_scalars(raw, t);
    const OptimElement<P, S, K, kMaster> el{h, raw, t, sc};
    const int64_t begin = static_cast<int64_t>(c - args.chunk_start[k]) * kChunk;
    const int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
    if (t.aligned) {
      const int64_t vec_end = begin + ((end - begin) & ~int64_t{3});
      for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end; i += 4 * kThreads) el.vector(i);
      for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) el.scalar(i);
    } else {
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) el.scalar(i);
    }
  }
}

template <class S, class P>
__global__ void __launch_bounds__(kThreads) ema_kernel(const __grid_constant__ EmaLaunchArgs args) {
  using C = compute_t<S>;
  double weight = args.weight;
  if (args.step != nullptr) weight = 1.0 - optim_math::ema_decay(args.decay, args.warmup != 0, *args.step);
  const C w = static_cast<C>(weight);
  const int32_t total = args.chunk_start[args.count];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const int k = find_tensor(args.chunk_start, args.count, c);
    const EmaTensorArgs& t = args.tensors[k];
    S* shadow = static_cast<S*>(t.shadow);
    const P* param = static_cast<const P*>(t.param);
    const int64_t begin = static_cast<int64_t>(c - args.chunk_start[k]) * kChunk;
    const int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
    int64_t scalar_from = begin;
    if (t.aligned) {
      const int64_t vec_end = begin + ((end - begin) & ~int64_t{3});
      for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end; i += 4 * kThreads) {
        Vec4<S> sv = load4(shadow, i);
        const Vec4<P> pv = load4(param, i);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const C s = to_c<C>(sv.v[j]);
          sv.v[j] = dconvert<S>(s + w * (to_c<C>(pv.v[j]) - s));
        }
        store4(shadow, i, sv);
      }
      scalar_from = vec_end;
    }
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) {
      const C s = to_c<C>(shadow[i]);
      shadow[i] = dconvert<S>(s + w * (to_c<C>(param[i]) - s));
    }
  }
}

bool aligned4(const void* p, std::size_t element_size) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (4 * element_size) == 0;
}

int32_t chunks_of(int64_t numel) { return static_cast<int32_t>((numel + kChunk - 1) / kChunk); }

// Blocks of `Kernel` that fit on the GPU at once (read once per kernel instantiation: their
// register counts differ): a grid-stride grid larger than that would run in uneven waves.
template <auto Kernel>
unsigned int grid_for(int device, int32_t total_chunks) {
  static std::atomic<int> per_sm{0};
  int n = per_sm.load(std::memory_order_relaxed);
  if (n == 0) {
    FLAME_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0));
    n = std::max(n, 1);
    per_sm.store(n, std::memory_order_relaxed);
  }
  const int64_t resident = static_cast<int64_t>(n) * sm_count(device);
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(total_chunks, resident)));
}

template <class P, class S, OptimKind K, bool kMaster>
void launch_optim(CudaBackend& be, const OptimLaunchArgs& args) {
  constexpr auto kernel = optim_kernel<P, S, K, kMaster>;
  kernel<<<grid_for<kernel>(be.device(), args.chunk_start[args.count]), kThreads, 0, be.stream()>>>(args);
  FLAME_CUDA_CHECK_LAUNCH();
}

template <class P, class S>
void launch_optim_kind(CudaBackend& be, const OptimLaunchArgs& args, bool master) {
  auto with_master = [&](auto kind_tag) {
    constexpr OptimKind K = decltype(kind_tag)::value;
    if constexpr (std::is_same_v<P, S>) {
      launch_optim<P, S, K, false>(be, args);
    } else {
      if (master) launch_optim<P, S, K, true>(be, args);
      else FLAME_FAIL("optim_step", "f32 state for ", dtype_name(dtype_of_v<P>), " parameters needs master weights");
    }
  };
  switch (args.hyper.kind) {
    case OptimKind::sgd: with_master(std::integral_constant<OptimKind, OptimKind::sgd>{}); break;
    case OptimKind::adam: with_master(std::integral_constant<OptimKind, OptimKind::adam>{}); break;
    case OptimKind::lion: with_master(std::integral_constant<OptimKind, OptimKind::lion>{}); break;
  }
}

}  // namespace

static void optim_step_cuda(const OptimHyper& h, const std::vector<OptimTensor>& tensors) {
  if (tensors.empty()) return;
  CudaBackend& be = cuda_backend(tensors.front().param.device().index);
  DeviceGuard guard(be.device());
  const DType pdt = tensors.front().param.dtype();
  const OptimTensor& front = tensors.front();
  const bool master = front.master.defined();
  const Tensor& probe = master ? front.master : front.state[0];
  const DType sdt = probe.defined() ? probe.dtype() : pdt;
  FLAME_CHECK(sdt == pdt || sdt == DType::f32, "optim_step", "state dtype ", dtype_name(sdt),
              " for parameters of dtype ", dtype_name(pdt), " (expected the parameter dtype or f32)");
  const std::size_t psize = dtype_size(pdt), ssize = dtype_size(sdt);

  // The launch arguments are large (~32 KB): build them once per call in a thread-local buffer.
  thread_local OptimLaunchArgs args;
  args.hyper = h;
  std::size_t next = 0;
  while (next < tensors.size()) {
    int32_t count = 0, chunk = 0;
    for (; next < tensors.size() && count < kMaxTensors; ++next) {
      const OptimTensor& e = tensors[next];
      const int64_t n = e.param.numel();
      if (n == 0) continue;
      OptimTensorArgs& a = args.tensors[count];
      a.param = e.param.data_ptr();
      a.grad = e.grad.data_ptr();
      a.master = e.master.defined() ? e.master.data_ptr() : nullptr;
      for (int k = 0; k < 3; ++k) a.state[k] = e.state[k].defined() ? e.state[k].data_ptr() : nullptr;
      a.low = nullptr;
      a.low_kind = kLowNone;
      if (e.low.defined() && pdt == DType::f32 && !master) {
        FLAME_CHECK(e.low.dtype() == DType::bf16 || e.low.dtype() == DType::f16, "optim_step",
                    "kept copy of dtype ", dtype_name(e.low.dtype()), " (expected bf16 or f16)");
        a.low = e.low.data_ptr();
        a.low_kind = e.low.dtype() == DType::bf16 ? kLowBf16 : kLowF16;
      }
      a.numel = n;
      a.step_size = e.step_size;
      a.bias2_sqrt = e.bias2_sqrt;
      a.rng_index = e.rng_index;
      a.rng_offset = e.rng_offset;
      a.device_step = e.device_step;
      a.first = e.first ? 1 : 0;
      bool al = aligned4(a.param, psize) && aligned4(a.grad, psize) && aligned4(a.master, ssize);
      for (int k = 0; k < 3; ++k) al = al && aligned4(a.state[k], ssize);
      al = al && aligned4(a.low, 2);
      a.aligned = al ? 1 : 0;
      FLAME_CHECK(static_cast<int64_t>(chunk) + chunks_of(n) < INT32_MAX, "optim_step", "too many elements in one call");
      args.chunk_start[count] = chunk;
      chunk += chunks_of(n);
      ++count;
    }
    if (count == 0) break;
    args.count = count;
    args.chunk_start[count] = chunk;
    dispatch_floating(pdt, "optim_step", [&](auto ptag) {
      using P = typename decltype(ptag)::type;
      if (sdt == pdt) launch_optim_kind<P, P>(be, args, master);
      else if constexpr (!std::is_same_v<P, double>) launch_optim_kind<P, float>(be, args, master);
      else FLAME_FAIL("optim_step", "f32 state for f64 parameters");
    });
    optim_count_launch();
  }
}

namespace {
void launch_ema(CudaBackend& be, const TensorList& shadow, const TensorList& params, double weight,
                const double* step, double decay, bool warmup) {
  if (shadow.empty()) return;
  DeviceGuard guard(be.device());
  const DType sdt = shadow.front().dtype(), pdt = params.front().dtype();
  const std::size_t ssize = dtype_size(sdt), psize = dtype_size(pdt);
  thread_local EmaLaunchArgs args;
  args.weight = weight;
  args.step = step;
  args.decay = decay;
  args.warmup = warmup ? 1 : 0;
  std::size_t next = 0;
  while (next < shadow.size()) {
    int32_t count = 0, chunk = 0;
    for (; next < shadow.size() && count < kMaxEmaTensors; ++next) {
      const int64_t n = shadow[next].numel();
      if (n == 0) continue;
      EmaTensorArgs& a = args.tensors[count];
      a.shadow = shadow[next].data_ptr();
      a.param = params[next].data_ptr();
      a.numel = n;
      a.aligned = aligned4(a.shadow, ssize) && aligned4(a.param, psize) ? 1 : 0;
      FLAME_CHECK(static_cast<int64_t>(chunk) + chunks_of(n) < INT32_MAX, "ema_update", "too many elements in one call");
      args.chunk_start[count] = chunk;
      chunk += chunks_of(n);
      ++count;
    }
    if (count == 0) break;
    args.count = count;
    args.chunk_start[count] = chunk;
    dispatch_floating(sdt, "ema_update", [&](auto stag) {
      using S = typename decltype(stag)::type;
      dispatch_floating(pdt, "ema_update", [&](auto ptag) {
        using P = typename decltype(ptag)::type;
        if constexpr (sizeof(P) <= sizeof(S)) {
          constexpr auto kernel = ema_kernel<S, P>;
          kernel<<<grid_for<kernel>(be.device(), chunk), kThreads, 0, be.stream()>>>(args);
          FLAME_CUDA_CHECK_LAUNCH();
        } else {
          FLAME_FAIL("ema_update", "shadow dtype ", dtype_name(sdt), " narrower than the parameters' ", dtype_name(pdt));
        }
      });
    });
    optim_count_launch();
  }
}
}  // namespace

static void ema_update_cuda(const TensorList& shadow, const TensorList& params, double weight) {
  if (shadow.empty()) return;
  CudaBackend& be = cuda_backend(shadow.front().device().index);
  launch_ema(be, shadow, params, weight, nullptr, 0.0, false);
}

static void ema_update_device_cuda(const TensorList& shadow, const TensorList& params, const Tensor& step,
                                   double decay, bool warmup) {
  if (shadow.empty()) return;
  CudaBackend& be = cuda_backend(shadow.front().device().index);
  launch_ema(be, shadow, params, 0.0, static_cast<const double*>(step.data_ptr()), decay, warmup);
}

void register_optim_kernels() {
  fused::optim_step.define(DeviceType::cuda, &optim_step_cuda);
  fused::ema_update.define(DeviceType::cuda, &ema_update_cuda);
  fused::ema_update_device.define(DeviceType::cuda, &ema_update_device_cuda);
}

}  // namespace flame::backend::cuda
