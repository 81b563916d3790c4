// Fused scaled dot-product attention on CUDA through cuDNN's SDPA graph nodes (cudnn-frontend),
// forward and backward (Backend::sdpa_forward / sdpa_backward; the contract is Note [Fused SDPA
// contract] in src/ops/attention.cpp). Routing around known cuDNN failures happens in the op
// layer, not here; with flame::cuda::set_short_attention on, what FLAME's short-sequence kernels
// take runs there instead (Note [Short-sequence attention] in sdpa_short.cu).
//
// Note [cuDNN SDPA plans]
// A built cudnn-frontend graph (operation graph + the heuristic's first plan that builds) is
// cached per device, direction, dtype, sizes, strides, bias shape, causal flag and scale. Plans
// are bound to the cuDNN handle they were built with, and cuDNN handles must not be used by two
// threads at once, so handles and plan caches are per thread (thread_local): no locks, and two
// threads never share a plan. The handle is bound to the current stream on every call
// (Note [Current stream] in cuda_backend.h), and the workspace comes from FLAME's pool on that
// stream (freed stream-ordered after the call; a graph-private block under capture). The first
// eager execution of a plan may time the heuristic's candidates (Note [cuDNN autotuning]).
#include <cudnn.h>

#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

// cudnn-frontend is third-party header code: its warnings are not ours to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-variable"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include "src/backend/cuda/attention/sdpa_short.h"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/cudnn_autotune.h"
#include "src/backend/cuda/cudnn_handle.h"
#include "src/backend/short_attention.h"

namespace flame::backend::cuda {

namespace {
namespace fe = cudnn_frontend;
constexpr const char* kOp = "scaled_dot_product_attention";

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kBias, kDO, kDQ, kDK, kDV };

#define FLAME_CUDNN_CHECK(call)                                                                   \
  do {                                                                                            \
    cudnnStatus_t flame_st_ = (call);                                                             \
    if (flame_st_ != CUDNN_STATUS_SUCCESS)                                                        \
      FLAME_FAIL(kOp, "cuDNN call ", #call, " failed: ", cudnnGetErrorString(flame_st_), " at ", \
                 __FILE__, ":", __LINE__);                                                        \
  } while (0)

void check_fe(fe::error_t err, const char* step, const std::vector<int64_t>& key) {
  if (!err.is_bad()) return;
  const Shape sizes(key.begin() + 3, key.begin() + 11);
  FLAME_FAIL(kOp, "cuDNN SDPA ", step, " failed for sizes [B,H,L,S,E,Ev,bias B,bias H] = [", sizes,
             "] (cuDNN ", cudnnGetVersion(), "): ", err.get_message());
}

// Note [cuDNN SDPA plans]: one handle per (thread, device), created on first use.
cudnnHandle_t cudnn_handle(int device) {
  thread_local std::unordered_map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = create_cudnn_handle(device, kOp);  // Note [cuDNN handle under capture]
  handles.emplace(device, h);
  return h;
}

struct KeyHash {
  std::size_t operator()(const std::vector<int64_t>& k) const {
    std::size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<std::size_t>(v)) * 1099511628211ull;
    return h;
  }
};

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  cudnn_autotune::State tune;  // the plan that executes and its workspace
};

fe::DataType_t io_type(DType dt) {
  switch (dt) {
    case DType::bf16: return fe::DataType_t::BFLOAT16;
    case DType::f16: return fe::DataType_t::HALF;
    default: break;
  }
  FLAME_FAIL(kOp, "the CUDA fused path takes bf16 or f16, got ", dtype_name(dt));
}

std::vector<int64_t> strides4(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }
std::vector<int64_t> sizes4(const Tensor& t) { return {t.size(0), t.size(1), t.size(2), t.size(3)}; }

void append(std::vector<int64_t>& key, const std::vector<int64_t>& v) { key.insert(key.end(), v.begin(), v.end()); }

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, Uid uid, const Tensor& t) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(sizes4(t)).set_stride(strides4(t)));
}

// Sizes and layout shared by forward and backward keys.
std::vector<int64_t> base_key(int dir, int device, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& bias, double scale, bool causal) {
  std::vector<int64_t> key{dir, device, static_cast<int64_t>(q.dtype())};
  append(key, {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)});
  append(key, bias.defined() ? std::vector<int64_t>{bias.size(0), bias.size(1)} : std::vector<int64_t>{0, 0});
  append(key, strides4(q));
  append(key, strides4(k));
  append(key, strides4(v));
  if (bias.defined()) append(key, strides4(bias));
  int64_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof(scale_bits));
  append(key, {scale_bits, causal ? 1 : 0});
  return key;
}

void finish(Plan& plan, cudnnHandle_t handle, const std::vector<int64_t>& key) {
  fe::graph::Graph& g = *plan.graph;
  check_fe(g.validate(), "validate", key);
  check_fe(g.build_operation_graph(handle), "build_operation_graph", key);
  check_fe(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", key);
  check_fe(g.check_support(handle), "check_support", key);
  check_fe(g.build_plans(handle), "build_plans", key);
  int64_t workspace = 0;
  check_fe(g.get_workspace_size(workspace), "get_workspace_size", key);
  plan.tune = cudnn_autotune::plan_state(g, workspace);
}

void new_graph(Plan& plan, DType dt) {
  plan.graph = std::make_shared<fe::graph::Graph>();
  plan.graph->set_io_data_type(io_type(dt))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
}

using PlanCache = std::unordered_map<std::vector<int64_t>, Plan, KeyHash>;

Plan& forward_plan(cudnnHandle_t handle, const std::vector<int64_t>& key, const Tensor& out, const Tensor& stats,
                         const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, double scale,
                         bool causal) {
  thread_local PlanCache cache;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Plan plan;
  new_graph(plan, q.dtype());
  fe::graph::Graph& g = *plan.graph;
  auto Q = input(g, "Q", kQ, q), K = input(g, "K", kK, k), V = input(g, "V", kV, v);
  auto opts = fe::graph::SDPA_attributes().set_name("flame_sdpa").set_generate_stats(true).set_attn_scale(
      static_cast<float>(scale));
  if (causal) opts.set_causal_mask(true);  // top-left aligned, as PyTorch
  if (bias.defined()) opts.set_bias(input(g, "Bias", kBias, bias));
  auto [O, Stats] = g.sdpa(Q, K, V, opts);
  O->set_output(true).set_uid(kO).set_dim(sizes4(out)).set_stride(strides4(out));
  Stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(sizes4(stats)).set_stride(
      strides4(stats));
  finish(plan, handle, key);
  return cache.emplace(key, std::move(plan)).first->second;
}

Plan& backward_plan(cudnnHandle_t handle, const std::vector<int64_t>& key, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& dout, const Tensor& stats, const Tensor& bias, double scale, bool causal) {
  thread_local PlanCache cache;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Plan plan;
  new_graph(plan, q.dtype());
  fe::graph::Graph& g = *plan.graph;
  auto Q = input(g, "Q", kQ, q), K = input(g, "K", kK, k), V = input(g, "V", kV, v);
  auto O = input(g, "O", kO, out), dO = input(g, "dO", kDO, dout);
  auto Stats = g.tensor(fe::graph::Tensor_attributes()
                            .set_name("Stats")
                            .set_uid(kStats)
                            .set_dim(sizes4(stats))
                            .set_stride(strides4(stats))
                            .set_data_type(fe::DataType_t::FLOAT));
  auto opts = fe::graph::SDPA_backward_attributes().set_name("flame_sdpa_backward").set_attn_scale(
      static_cast<float>(scale));
  if (causal) opts.set_causal_mask(true);
  if (bias.defined()) opts.set_bias(input(g, "Bias", kBias, bias));
  auto [dQ, dK, dV] = g.sdpa_backward(Q, K, V, O, dO, Stats, opts);
  dQ->set_output(true).set_uid(kDQ).set_dim(sizes4(dq)).set_stride(strides4(dq));
  dK->set_output(true).set_uid(kDK).set_dim(sizes4(dk)).set_stride(strides4(dk));
  dV->set_output(true).set_uid(kDV).set_dim(sizes4(dv)).set_stride(strides4(dv));
  finish(plan, handle, key);
  return cache.emplace(key, std::move(plan)).first->second;
}

void run(CudaBackend& be, Plan& plan, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
         const std::vector<int64_t>& key) {
  auto describe = [&key] {  // Note [cuDNN autotuning]
    std::string what = key[0] == 0 ? "SDPA forward [B,H,L,S,E,Ev] = [" : "SDPA backward [B,H,L,S,E,Ev] = [";
    for (int i = 3; i < 9; ++i) what += std::to_string(key[i]) + (i < 8 ? "," : "]");
    return what;
  };
  check_fe(cudnn_autotune::execute(plan.tune, *plan.graph, handle, pack, be, describe), "execute", key);
}

// Makes `device` current for the scope (common.cuh's DeviceGuard needs nvcc; this file is host C++).
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) FLAME_FAIL(kOp, "cudaGetDevice failed");
    if (previous_ != device && cudaSetDevice(device) != cudaSuccess) FLAME_FAIL(kOp, "cannot select cuda:", device);
  }
  ~CurrentDevice() {
    if (previous_ != device_) (void)cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

void check_operand(const Tensor& t, const char* name, DType dt) {
  FLAME_CHECK(t.dim() == 4 && t.stride(3) == 1 && t.dtype() == dt, kOp, "fused CUDA SDPA: ", name,
              " must be 4-d, ", dtype_name(dt), ", last-dim stride 1; got shape ", t.sizes(), " strides ",
              t.strides(), " ", dtype_name(t.dtype()));
}

}  // namespace

void CudaBackend::sdpa_forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& bias, double scale, bool causal) {
  const DType dt = q.dtype();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}}) check_operand(*t, name, dt);
  if (bias.defined()) check_operand(bias, "bias", dt);
  CurrentDevice guard(device_);
  if (short_attention::enabled() && sdpa_short::supports(q, k, v, bias, causal, {&out})) {
    sdpa_short::forward(out, stats, q, k, v, scale, stream());  // Note [Short-sequence attention]
    short_attention::count(true);
    return;
  }
  cudnnHandle_t handle = cudnn_handle(device_);
  FLAME_CUDNN_CHECK(cudnnSetStream(handle, stream()));
  std::vector<int64_t> key = base_key(0, device_, q, k, v, bias, scale, causal);
  append(key, strides4(out));
  Plan& plan = forward_plan(handle, key, out, stats, q, k, v, bias, scale, causal);
  std::unordered_map<int64_t, void*> pack{{kQ, q.data_ptr()},   {kK, k.data_ptr()},        {kV, v.data_ptr()},
                                          {kO, out.data_ptr()}, {kStats, stats.data_ptr()}};
  if (bias.defined()) pack[kBias] = bias.data_ptr();
  run(*this, plan, handle, pack, key);
}

void CudaBackend::sdpa_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& stats,
                                const Tensor& bias, double scale, bool causal, Tensor* column_sums) {
  const DType dt = q.dtype();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}, {&dq, "dq"},
                         {&dk, "dk"}, {&dv, "dv"}})
    check_operand(*t, name, dt);
  if (bias.defined()) check_operand(bias, "bias", dt);
  CurrentDevice guard(device_);
  if (short_attention::enabled() && sdpa_short::supports(q, k, v, bias, causal, {&out, &dout, &dq, &dk, &dv})) {
    sdpa_short::backward(dq, dk, dv, q, k, v, out, dout, stats, scale, stream(), column_sums);
    short_attention::count(false);
    return;
  }
  cudnnHandle_t handle = cudnn_handle(device_);
  FLAME_CUDNN_CHECK(cudnnSetStream(handle, stream()));
  std::vector<int64_t> key = base_key(1, device_, q, k, v, bias, scale, causal);
  append(key, strides4(out));
  append(key, strides4(dout));
  append(key, strides4(dq));
  append(key, strides4(dk));
  append(key, strides4(dv));
  Plan& plan = backward_plan(handle, key, dq, dk, dv, q, k, v, out, dout, stats, bias, scale, causal);
  std::unordered_map<int64_t, void*> pack{
      {kQ, q.data_ptr()},   {kK, k.data_ptr()},       {kV, v.data_ptr()},        {kO, out.data_ptr()},
      {kDO, dout.data_ptr()}, {kStats, stats.data_ptr()}, {kDQ, dq.data_ptr()}, {kDK, dk.data_ptr()},
      {kDV, dv.data_ptr()}};
  if (bias.defined()) pack[kBias] = bias.data_ptr();
  run(*this, plan, handle, pack, key);
}

}  // namespace flame::backend::cuda
