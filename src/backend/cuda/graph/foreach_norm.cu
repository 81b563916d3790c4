// Sync-free gradient norm and clipping on CUDA (Note [Device gradient clipping] in
// src/autograd/grad_clip_device.cpp).
//
// Note [Multi-tensor norm]
// foreach_norm_accumulate packs up to kMaxTensors tensors (pointer, numel) and a prefix table of
// their chunks into one __grid_constant__ argument struct, like the fused optimizer (Note
// [Multi-tensor apply], optim/multi_tensor.cu). A grid of as many blocks as fit on the GPU at once
// walks the chunks grid-stride; each thread accumulates |x|^p (or max |x|) in double, the block
// folds its threads in a fixed tree and writes one partial per block; a second, single-block kernel
// folds the partials in index order into the f64 accumulator. No atomics, so the norm is the same
// on every run of the same shapes. foreach_clip_scale reads the total norm in the kernel, forms
// min(1, max_norm / (norm + 1e-6)) in double (NaN propagates, like torch.clamp), and multiplies
// each element in the tensor's compute type; a coefficient of exactly 1 writes nothing. Nothing
// here synchronises with the host, so both can be captured into a CUDA graph; the partials buffer
// comes from the pool on the current stream (the graph's private pool during a capture).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "src/backend/fused/multi_tensor.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;  // elements per chunk
constexpr int kMaxTensors = 1400;

enum NormMode : int32_t { kSquares = 0, kAbs = 1, kMax = 2, kPow = 3 };

struct NormTensorArgs {
  void* ptr;
  int64_t numel;
};

struct NormLaunchArgs {
  double p;
  int32_t mode;
  int32_t count;
  int32_t chunk_start[kMaxTensors + 1];
  NormTensorArgs tensors[kMaxTensors];
};
static_assert(sizeof(NormLaunchArgs) <= 32764, "kernel arguments exceed the 32,764-byte limit");

struct ScaleLaunchArgs {
  const double* norm;
  double max_norm;
  int32_t count;
  int32_t chunk_start[kMaxTensors + 1];
  NormTensorArgs tensors[kMaxTensors];
};
static_assert(sizeof(ScaleLaunchArgs) <= 32764, "kernel arguments exceed the 32,764-byte limit");

__device__ __forceinline__ int find_chunk_tensor(const int32_t* chunk_start, int count, int32_t c) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (chunk_start[mid] <= c) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// max that keeps a NaN once seen (torch's max propagates NaN).
__device__ __forceinline__ double nan_max(double m, double x) { return (m != m || m >= x) ? m : x; }

__device__ __forceinline__ double fold(int32_t mode, double a, double b) {
  return mode == kMax ? nan_max(a, b) : a + b;
}

// Folds the block's values in a fixed tree (deterministic); the result is in smem[0].
__device__ __forceinline__ double block_fold(int32_t mode, double v, double* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) smem[threadIdx.x] = fold(mode, smem[threadIdx.x], smem[threadIdx.x + s]);
    __syncthreads();
  }
  return smem[0];
}

template <class T>
__global__ void __launch_bounds__(kThreads) norm_partials_kernel(const __grid_constant__ NormLaunchArgs args,
                                                                 double* partials) {
  __shared__ double smem[kThreads];
  const int32_t total = args.chunk_start[args.count];
  double acc = 0.0;
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const int k = find_chunk_tensor(args.chunk_start, args.count, c);
    const T* x = static_cast<const T*>(args.tensors[k].ptr);
    const int64_t n = args.tensors[k].numel;
    const int64_t begin = static_cast<int64_t>(c - args.chunk_start[k]) * kChunk;
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      double a;
      if constexpr (std::is_same_v<T, double>) a = fabs(x[i]);
      else a = fabs(static_cast<double>(dconvert<float>(x[i])));
      switch (args.mode) {
        case kSquares: acc += a * a; break;
        case kAbs: acc += a; break;
        case kMax: acc = nan_max(acc, a); break;
        default: acc += pow(a, args.p); break;
      }
    }
  }
  const double block = block_fold(args.mode, acc, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

// One block: acc = fold(acc, partials[0..n)) in index order (each thread folds a strided slice,
// then the fixed tree).
__global__ void __launch_bounds__(kThreads) norm_finish_kernel(const double* partials, int n, int32_t mode, double* acc) {
  __shared__ double smem[kThreads];
  double v = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kThreads) v = fold(mode, v, partials[i]);
  const double total = block_fold(mode, v, smem);
  if (threadIdx.x == 0) *acc = fold(mode, *acc, total);
}

template <class T>
__global__ void __launch_bounds__(kThreads) clip_scale_kernel(const __grid_constant__ ScaleLaunchArgs args) {
  using C = compute_t<T>;
  double coef = args.max_norm / (*args.norm + 1e-6);
  if (!(coef != coef) && coef > 1.0) coef = 1.0;
  if (coef == 1.0) return;  // the gradients stay as they are (x * 1 == x)
  const C cf = static_cast<C>(coef);
  const int32_t total = args.chunk_start[args.count];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const int k = find_chunk_tensor(args.chunk_start, args.count, c);
    T* x = static_cast<T*>(args.tensors[k].ptr);
    const int64_t n = args.tensors[k].numel;
    const int64_t begin = static_cast<int64_t>(c - args.chunk_start[k]) * kChunk;
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) x[i] = dconvert<T>(dconvert<C>(x[i]) * cf);
  }
}

int32_t chunks_in(int64_t numel) { return static_cast<int32_t>((numel + kChunk - 1) / kChunk); }

template <auto Kernel>
int resident_blocks(int device) {
  static std::atomic<int> per_sm{0};
  int n = per_sm.load(std::memory_order_relaxed);
  if (n == 0) {
    FLAME_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0));
    n = std::max(n, 1);
    per_sm.store(n, std::memory_order_relaxed);
  }
  return n * sm_count(device);
}

// Packs tensors[next..] into `args` (at most kMaxTensors non-empty ones); returns the chunk total.
template <class Args>
int32_t pack(Args& args, const TensorList& tensors, std::size_t& next, const char* op) {
  int32_t count = 0, chunk = 0;
  for (; next < tensors.size() && count < kMaxTensors; ++next) {
    const int64_t n = tensors[next].numel();
    if (n == 0) continue;
    FLAME_CHECK(static_cast<int64_t>(chunk) + chunks_in(n) < INT32_MAX, op, "too many elements in one call");
    args.tensors[count] = NormTensorArgs{tensors[next].data_ptr(), n};
    args.chunk_start[count] = chunk;
    chunk += chunks_in(n);
    ++count;
  }
  args.count = count;
  args.chunk_start[count] = chunk;
  return chunk;
}

}  // namespace

static void foreach_norm_accumulate_cuda(const TensorList& tensors, double norm_type, const Tensor& acc) {
  CudaBackend& be = cuda_backend(acc.device().index);
  if (tensors.empty()) return;
  DeviceGuard guard(be.device());
  thread_local NormLaunchArgs args;
  args.p = norm_type;
  args.mode = std::isinf(norm_type) ? kMax : norm_type == 2.0 ? kSquares : norm_type == 1.0 ? kAbs : kPow;
  double* acc_ptr = static_cast<double*>(acc.data_ptr());
  std::size_t next = 0;
  while (next < tensors.size()) {
    const int32_t total = pack(args, tensors, next, "foreach_norm_accumulate");
    if (args.count == 0) break;
    dispatch_floating(tensors.front().dtype(), "foreach_norm_accumulate", [&](auto tag) {
      using T = typename decltype(tag)::type;
      constexpr auto kernel = norm_partials_kernel<T>;
      const int grid = std::max(1, std::min<int>(total, resident_blocks<kernel>(be.device())));
      auto partials = be.allocate(static_cast<std::size_t>(grid) * sizeof(double));
      double* part = static_cast<double*>(partials.get());
      kernel<<<grid, kThreads, 0, be.stream()>>>(args, part);
      FLAME_CUDA_CHECK_LAUNCH();
      norm_finish_kernel<<<1, kThreads, 0, be.stream()>>>(part, grid, args.mode, acc_ptr);
      FLAME_CUDA_CHECK_LAUNCH();
    });  // `partials` is freed here, stream-ordered after the finishing kernel
  }
}

static void foreach_clip_scale_cuda(const TensorList& tensors, const Tensor& total_norm, double max_norm) {
  CudaBackend& be = cuda_backend(total_norm.device().index);
  if (tensors.empty()) return;
  DeviceGuard guard(be.device());
  thread_local ScaleLaunchArgs args;
  args.norm = static_cast<const double*>(total_norm.data_ptr());
  args.max_norm = max_norm;
  std::size_t next = 0;
  while (next < tensors.size()) {
    const int32_t total = pack(args, tensors, next, "foreach_clip_scale");
    if (args.count == 0) break;
    dispatch_floating(tensors.front().dtype(), "foreach_clip_scale", [&](auto tag) {
      using T = typename decltype(tag)::type;
      constexpr auto kernel = clip_scale_kernel<T>;
      const int grid = std::max(1, std::min<int>(total, resident_blocks<kernel>(be.device())));
      kernel<<<grid, kThreads, 0, be.stream()>>>(args);
      FLAME_CUDA_CHECK_LAUNCH();
    });
  }
}

void register_foreach_kernels() {
  fused::foreach_norm_accumulate.define(DeviceType::cuda, &foreach_norm_accumulate_cuda);
  fused::foreach_clip_scale.define(DeviceType::cuda, &foreach_clip_scale_cuda);
}

}  // namespace flame::backend::cuda
