// The 8-bit block-wise AdamW step on CUDA (Note [8-bit optimizer state] in
// src/backend/fused/adamw8bit.h). One thread block per quantisation block: its threads dequantise
// the block's codes (the two maps sit in shared memory), apply the AdamW element update (Note
// [Optimizer element math]), reduce the new absmax of each moment over the block, and requantise.
// Like the multi-tensor kernels (Note [Multi-tensor apply]), one launch covers up to kMaxTensors
// tensors: the launch arguments carry the maps, each tensor's pointers and scalars, and a prefix
// table of each tensor's first block; blocks walk the global block list grid-stride and find
// their tensor by binary search. Nothing here allocates or synchronises, so a step can be captured.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/fused/adamw8bit.h"
#include "src/backend/optim_math.h"

namespace flame::backend::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxTensors = 200;

struct Adam8TensorArgs {
  void* param;
  const void* grad;
  float* master;
  uint8_t* codes[2];
  float* absmax[2];
  int64_t numel;
  double step_size;
  double bias2_sqrt;
  uint64_t rng_index;
  uint64_t rng_offset;
};

struct Adam8LaunchArgs {
  OptimHyper hyper;
  float maps[2][kQuantMapSize];
  int64_t block_size;
  int32_t count;
  int64_t block_start[kMaxTensors + 1];  // first global block of each tensor; [count] = total
  Adam8TensorArgs tensors[kMaxTensors];
};
static_assert(sizeof(Adam8LaunchArgs) <= 32764, "kernel arguments exceed the 32,764-byte limit");

struct AbsmaxOp {
  __device__ __forceinline__ static float identity() { return 0.0f; }
  __device__ __forceinline__ static float combine(float a, float b) { return quant8::absmax_with(a, b); }
};

__device__ __forceinline__ int find_tensor(const int64_t* block_start, int count, int64_t b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (block_start[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// P: parameter type; kMaster: f32 master weights beside a half parameter.
template <class P, bool kMaster>
__global__ void __launch_bounds__(kThreads) adamw8bit_kernel(const __grid_constant__ Adam8LaunchArgs args) {
  using C = compute_t<P>;
  extern __shared__ float moments[];  // [2][block_size]: this block's updated m and v
  __shared__ float maps[2][kQuantMapSize];
  __shared__ float reduce_smem[32];
  __shared__ float new_absmax[2];
  for (int i = threadIdx.x; i < 2 * kQuantMapSize; i += blockDim.x)
    maps[i / kQuantMapSize][i % kQuantMapSize] = args.maps[i / kQuantMapSize][i % kQuantMapSize];
  __syncthreads();
  const OptimHyper& raw = args.hyper;
  const optim_math::Hyper<C> h = optim_math::make_hyper<C>(raw);
  const int64_t bs = args.block_size;
  const int64_t total = args.block_start[args.count];
  for (int64_t gb = blockIdx.x; gb < total; gb += gridDim.x) {
    const int k = find_tensor(args.block_start, args.count, gb);
    const Adam8TensorArgs& t = args.tensors[k];
    const int64_t b = gb - args.block_start[k];
    const int64_t begin = b * bs;
    const int64_t end = begin + bs < t.numel ? begin + bs : t.numel;
    const float am = t.absmax[0][b], av = t.absmax[1][b];
    const C step_size = static_cast<C>(t.step_size), bias2_sqrt = static_cast<C>(t.bias2_sqrt);
    P* param = static_cast<P*>(t.param);
    float local_m = 0.0f, local_v = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      C p = kMaster ? static_cast<C>(t.master[i]) : dconvert<C>(param[i]);
      C m = static_cast<C>(quant8::dequantize(maps[0], t.codes[0][i], am));
      C v = static_cast<C>(quant8::dequantize(maps[1], t.codes[1][i], av));
      C unused = C(0);
      optim_math::adam_update(h, step_size, bias2_sqrt, p, dconvert<C>(static_cast<const P*>(t.grad)[i]), m, v,
                              unused);
      const float mf = static_cast<float>(m), vf = static_cast<float>(v);
      moments[i - begin] = mf;
      moments[bs + (i - begin)] = vf;
      local_m = quant8::absmax_with(local_m, mf);
      local_v = quant8::absmax_with(local_v, vf);
      if constexpr (kMaster) {
        const float pm = static_cast<float>(p);
        t.master[i] = pm;
        if constexpr (std::is_same_v<P, bfloat16>) {
          if (raw.stochastic_rounding) {
            const uint32_t bits =
                optim_math::rounding_bits(raw.seed, t.rng_index + static_cast<uint64_t>(i), t.rng_offset);
            param[i] = optim_math::stochastic_round_bf16(pm, bits);
            continue;
          }
        }
        param[i] = dconvert<P>(pm);
      } else {
        param[i] = dconvert<P>(p);
      }
    }
    local_m = block_reduce<AbsmaxOp>(local_m, reduce_smem);
    if (threadIdx.x == 0) new_absmax[0] = local_m;
    local_v = block_reduce<AbsmaxOp>(local_v, reduce_smem);
    if (threadIdx.x == 0) new_absmax[1] = local_v;
    __syncthreads();
    const float nm = new_absmax[0], nv = new_absmax[1];
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      t.codes[0][i] = quant8::quantize(maps[0], moments[i - begin], nm);
      t.codes[1][i] = quant8::quantize(maps[1], moments[bs + (i - begin)], nv);
    }
    if (threadIdx.x == 0) {
      t.absmax[0][b] = nm;
      t.absmax[1][b] = nv;
    }
    __syncthreads();  // moments and new_absmax are reused by the next block
  }
}

template <class P, bool kMaster>
void launch_adamw8bit(CudaBackend& be, const Adam8LaunchArgs& args) {
  constexpr auto kernel = adamw8bit_kernel<P, kMaster>;
  const std::size_t smem = 2 * static_cast<std::size_t>(args.block_size) * sizeof(float);
  int per_sm = 0;
  FLAME_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count(be.device());
  const int64_t grid = std::max<int64_t>(1, std::min(args.block_start[args.count], resident));
  kernel<<<static_cast<unsigned int>(grid), kThreads, smem, be.stream()>>>(args);
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

static void adamw8bit_step_cuda(const OptimHyper& h, int64_t block_size, const std::vector<Optim8bitTensor>& tensors) {
  if (tensors.empty()) return;
  CudaBackend& be = cuda_backend(tensors.front().param.device().index);
  DeviceGuard guard(be.device());
  const DType pdt = tensors.front().param.dtype();
  const bool master = tensors.front().master.defined();
  FLAME_CHECK(block_size > 0 && 2 * block_size * static_cast<int64_t>(sizeof(float)) <= 48 * 1024, "adamw8bit_step",
              "block_size ", block_size, " needs more than 48 KiB of shared memory (at most 6144)");
  // The launch arguments are large (~24 KB): build them in a thread-local buffer.
  thread_local Adam8LaunchArgs args;
  args.hyper = h;
  args.block_size = block_size;
  const QuantMaps& maps = quant_maps();
  for (int s = 0; s < 2; ++s) std::copy(maps.map[s].begin(), maps.map[s].end(), args.maps[s]);
  std::size_t next = 0;
  while (next < tensors.size()) {
    int32_t count = 0;
    int64_t blocks = 0;
    for (; next < tensors.size() && count < kMaxTensors; ++next) {
      const Optim8bitTensor& e = tensors[next];
      const int64_t n = e.param.numel();
      if (n == 0) continue;
      Adam8TensorArgs& a = args.tensors[count];
      a.param = e.param.data_ptr();
      a.grad = e.grad.data_ptr();
      a.master = e.master.defined() ? static_cast<float*>(e.master.data_ptr()) : nullptr;
      for (int s = 0; s < 2; ++s) {
        a.codes[s] = static_cast<uint8_t*>(e.codes[s].data_ptr());
        a.absmax[s] = static_cast<float*>(e.absmax[s].data_ptr());
      }
      a.numel = n;
      a.step_size = e.step_size;
      a.bias2_sqrt = e.bias2_sqrt;
      a.rng_index = e.rng_index;
      a.rng_offset = e.rng_offset;
      args.block_start[count] = blocks;
      blocks += (n + block_size - 1) / block_size;
      ++count;
    }
    if (count == 0) break;
    args.count = count;
    args.block_start[count] = blocks;
    dispatch_floating(pdt, "adamw8bit_step", [&](auto ptag) {
      using P = typename decltype(ptag)::type;
      if constexpr (std::is_same_v<P, bfloat16> || std::is_same_v<P, float16>) {
        if (master) launch_adamw8bit<P, true>(be, args);
        else launch_adamw8bit<P, false>(be, args);
      } else {
        FLAME_CHECK(!master, "adamw8bit_step", "master weights for ", dtype_name(pdt), " parameters");
        launch_adamw8bit<P, false>(be, args);
      }
    });
    optim_count_launch();
  }
}

void register_adamw8bit_kernels() { fused::adamw8bit_step.define(DeviceType::cuda, &adamw8bit_step_cuda); }

}  // namespace flame::backend::cuda
