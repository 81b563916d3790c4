// CUDA convolution through cuDNN's graph API (the header-only cudnn-frontend): forward (fprop),
// backward-data (dgrad) and backward-filter (wgrad). Host code only; kept in its own translation
// unit because the frontend headers compile slowly.
//
// Note [cuDNN conv plans]
// A plan (an operation graph with one conv node, its first supported engine from heuristics mode A,
// then FALLBACK, and its workspace size) is cached per (device, op, dtype, dims and strides of the
// three tensors, stride, padding, dilation, groups) in a map under a shared_mutex: known shapes take
// the shared lock only; a miss builds outside any lock and inserts under the exclusive lock (a
// racing duplicate is dropped). Plans are never erased, so references stay valid. Real strides go
// to cuDNN, so contiguous and channels-last tensors get their own plans and no copies. A 1-d conv
// runs as a 2-d one with a leading spatial dim of size 1 (cuDNN wants 4-d or 5-d tensors).
// A problem cuDNN cannot build a plan for is cached as a failure; a channels-last one is then run
// contiguous through staging copies (Note [cuDNN layout fallback]), a contiguous one raises.
// The first eager execution of a plan may time the heuristic's candidates and keep the fastest
// (Note [cuDNN autotuning] in cudnn_autotune.h).
//
// Note [cuDNN handles]
// cuDNN handles are not safe to share between threads that set different streams, so each thread
// owns one handle per device, taken from a process-wide free list and given back when the thread
// exits (handles are never destroyed: destruction at process exit may run after the CUDA context
// is gone). Before each call the handle is bound to the thread's current stream (cudnnSetStream).
// The workspace comes from FLAME's stream-ordered pool (Backend::allocate), freed in stream order
// after the call. Execution of one plan is serialised by a per-plan mutex: the frontend's execute
// is only documented as const, not as thread-safe.
//
// Note [cuDNN conv workspace]
// The plan's engine is the heuristic's first whose workspace is at most kMaxConvWorkspace (2 GiB):
// its first f32 (TF32 off) choice for the SD/FLUX VAE's convolutions at 1024² needed a 129 GiB
// workspace, which an 80 GB GPU cannot allocate (and a 24 GB one far less). PyTorch likewise
// passes over algorithms whose workspace it cannot allocate. When no engine fits under the cap,
// the cap is lifted and the heuristic's choice stands.
//
// Compute types: f32 runs with float compute and may use TF32 tensor cores while
// flame::cuda::allow_conv_tf32() (default on, as PyTorch's torch.backends.cudnn.allow_tf32); off,
// the engine configurations with the TENSOR_CORE or DOWN_CONVERT_INPUTS numerical notes are
// deselected, so only full-f32 engines remain (the setting is part of the plan key). bf16/f16
// accumulate in float; f64 in double where cuDNN has an engine for it (else the call raises
// flame::Error naming the op and shapes).
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

// The frontend headers define static helpers this file does not call; GCC reports those at the
// end of the translation unit, so the warning is silenced for the whole file.
#pragma GCC diagnostic ignored "-Wunused-function"
#include <cudnn_frontend.h>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/cudnn_autotune.h"
#include "src/backend/cuda/cudnn_handle.h"
#include "src/core/memory_format.h"

namespace flame::backend::cuda {
namespace {
constexpr int64_t kMaxConvWorkspace = int64_t{2} << 30;  // Note [cuDNN conv workspace]
}  // namespace
namespace {

namespace fe = cudnn_frontend;
using ConvParams = Backend::ConvParams;

enum class ConvOp : int32_t { fprop = 0, dgrad = 1, wgrad = 2 };
const char* op_label(ConvOp op) {
  switch (op) {
    case ConvOp::fprop: return "forward";
    case ConvOp::dgrad: return "backward-data";
    default: return "backward-filter";
  }
}

std::string conv_name(const ConvParams& p) {
  return "conv" + std::to_string(p.nsp) + "d (cuDNN)";
}

// ---------------------------------------------------------------------------------------------
// Handles (Note [cuDNN handles])
// ---------------------------------------------------------------------------------------------
constexpr int kMaxConvDevices = 64;

struct HandleFreeList {
  std::mutex mutex;
  std::array<std::vector<cudnnHandle_t>, kMaxConvDevices> free;
};
HandleFreeList& free_list() {
  static auto* list = new HandleFreeList();  // leaked: thread exits may run during static teardown
  return *list;
}

struct ThreadHandles {
  std::array<cudnnHandle_t, kMaxConvDevices> h{};
  ~ThreadHandles() {
    HandleFreeList& fl = free_list();
    std::lock_guard<std::mutex> lock(fl.mutex);
    for (int d = 0; d < kMaxConvDevices; ++d)
      if (h[d] != nullptr) fl.free[d].push_back(h[d]);
  }
};

void check_cudnn(cudnnStatus_t st, const char* what, const std::string& op) {
  if (st != CUDNN_STATUS_SUCCESS) FLAME_FAIL(op.c_str(), "cuDNN call ", what, " failed: ", cudnnGetErrorString(st));
}

cudnnHandle_t thread_handle(int device, cudaStream_t stream, const std::string& op) {
  FLAME_CHECK(device >= 0 && device < kMaxConvDevices, op.c_str(), "device index ", device, " out of range");
  thread_local ThreadHandles handles;
  cudnnHandle_t& h = handles.h[device];
  if (h == nullptr) {
    HandleFreeList& fl = free_list();
    {
      std::lock_guard<std::mutex> lock(fl.mutex);
      if (!fl.free[device].empty()) {
        h = fl.free[device].back();
        fl.free[device].pop_back();
      }
    }
    if (h == nullptr) h = create_cudnn_handle(device, op.c_str());  // Note [cuDNN handle under capture]
  }
  check_cudnn(cudnnSetStream(h, stream), "cudnnSetStream", op);
  return h;
}

// ---------------------------------------------------------------------------------------------
// Plan cache (Note [cuDNN conv plans])
// ---------------------------------------------------------------------------------------------
struct ConvKey {
  int32_t device, op, dtype, nd, tf32, unused;  // tf32: f32 with allow_conv_tf32() on
  int64_t x_dim[5], x_stride[5], w_dim[5], w_stride[5], y_dim[5], y_stride[5];
  int64_t stride[3], pad_lo[3], pad_hi[3], dilation[3];
  int64_t groups;
  bool operator==(const ConvKey& o) const { return std::memcmp(this, &o, sizeof(ConvKey)) == 0; }
};
struct ConvKeyHash {
  std::size_t operator()(const ConvKey& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the zero-initialised bytes
    for (std::size_t i = 0; i < sizeof(ConvKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

constexpr int64_t kUidX = 1, kUidW = 2, kUidY = 3;

struct ConvPlan {
  std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN could not build this one (error below)
  std::string error;
  cudnn_autotune::State tune;  // the plan that executes and its workspace; guarded by run_mutex
  std::mutex run_mutex;
};

// Dims and strides as cuDNN sees them: 1-d gets a leading spatial dim of size 1, and the strides
// are the dense strides of the call's layout computed from the sizes, so that size-1 dims (whose
// stride is arbitrary in FLAME) look like the rest of the layout to cuDNN. The op layer hands
// every operand dense in that layout (Backend::ConvParams), so the description is exact.
struct Geometry {
  std::vector<int64_t> dim, stride;
};
Geometry geometry(const Tensor& t, int64_t nsp, bool cl) {
  Geometry g;
  g.dim = t.sizes();
  if (nsp == 1) g.dim.insert(g.dim.begin() + 2, 1);
  const std::size_t nd = g.dim.size();
  g.stride.assign(nd, 1);
  // Innermost first: contiguous W, H, (D), C, N; channels-last C, W, H, (D), N.
  std::vector<std::size_t> order;
  if (cl) {
    order.push_back(1);
    for (std::size_t d = nd - 1; d >= 2; --d) order.push_back(d);
  } else {
    for (std::size_t d = nd - 1; d >= 1; --d) order.push_back(d);
  }
  order.push_back(0);
  int64_t run = 1;
  for (std::size_t d : order) {
    g.stride[d] = run;
    run *= std::max<int64_t>(g.dim[d], 1);
  }
  return g;
}

fe::DataType_t fe_type(DType t, const std::string& op) {
  switch (t) {
    case DType::f32: return fe::DataType_t::FLOAT;
    case DType::f64: return fe::DataType_t::DOUBLE;
    case DType::bf16: return fe::DataType_t::BFLOAT16;
    case DType::f16: return fe::DataType_t::HALF;
    default: FLAME_FAIL(op.c_str(), "cuDNN convolutions take floating tensors, got ", dtype_name(t));
  }
}

std::string describe(ConvOp op, const Tensor& x, const Tensor& w, const Tensor& y, const ConvParams& p) {
  using flame::shape_str;
  std::ostringstream s;
  s << op_label(op) << " of x " << shape_str(x.sizes()) << " (strides " << shape_str(x.strides()) << "), w "
    << shape_str(w.sizes()) << " (strides " << shape_str(w.strides()) << "), y " << shape_str(y.sizes())
    << " (strides " << shape_str(y.strides()) << "), " << dtype_name(x.dtype()) << ", stride "
    << shape_str(Shape(p.stride, p.stride + p.nsp)) << ", padding " << shape_str(Shape(p.pad_lo, p.pad_lo + p.nsp))
    << "+" << shape_str(Shape(p.pad_hi, p.pad_hi + p.nsp)) << ", dilation "
    << shape_str(Shape(p.dilation, p.dilation + p.nsp)) << ", groups " << p.groups;
  return s.str();
}

void check_fe(const fe::error_t& e, const char* step, const std::string& op, const std::string& what) {
  if (e.is_bad()) {
    fe::error_t copy = e;
    FLAME_FAIL(op.c_str(), "cuDNN ", step, " failed for ", what, ": ", copy.get_message());
  }
}

std::unique_ptr<ConvPlan> build_plan(ConvOp op, const Tensor& x, const Tensor& w, const Tensor& y, const ConvParams& p,
                                     const Geometry& gx, const Geometry& gw, const Geometry& gy, bool tf32,
                                     cudnnHandle_t handle, const std::string& name, bool cap_workspace = true) {
  const std::string what = describe(op, x, w, y, p);
  const fe::DataType_t io = fe_type(x.dtype(), name);
  const fe::DataType_t compute = x.dtype() == DType::f64 ? fe::DataType_t::DOUBLE : fe::DataType_t::FLOAT;
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(io).set_intermediate_data_type(compute).set_compute_data_type(compute);

  std::vector<int64_t> stride, pad_lo, pad_hi, dilation;
  if (p.nsp == 1) {
    stride.push_back(1);
    pad_lo.push_back(0);
    pad_hi.push_back(0);
    dilation.push_back(1);
  }
  for (int64_t i = 0; i < p.nsp; ++i) {
    stride.push_back(p.stride[i]);
    pad_lo.push_back(p.pad_lo[i]);
    pad_hi.push_back(p.pad_hi[i]);
    dilation.push_back(p.dilation[i]);
  }
  auto make = [&](const char* n, const Geometry& g, int64_t uid) {
    return graph->tensor(
        fe::graph::Tensor_attributes().set_name(n).set_dim(g.dim).set_stride(g.stride).set_uid(uid).set_data_type(io));
  };
  // The attributes every conv node shares (fprop, dgrad and wgrad have the same setters).
  auto with_params = [&](auto attrs, const char* n) {
    attrs.set_name(n)
        .set_compute_data_type(compute)
        .set_pre_padding(pad_lo)
        .set_post_padding(pad_hi)
        .set_stride(stride)
        .set_dilation(dilation);
    return attrs;
  };
  switch (op) {
    case ConvOp::fprop: {
      auto X = make("x", gx, kUidX);
      auto W = make("w", gw, kUidW);
      auto attrs = with_params(fe::graph::Conv_fprop_attributes(), "fprop");
      auto Y = graph->conv_fprop(X, W, attrs);
      Y->set_output(true).set_dim(gy.dim).set_stride(gy.stride).set_uid(kUidY).set_data_type(io);
      break;
    }
    case ConvOp::dgrad: {
      auto DY = make("dy", gy, kUidY);
      auto W = make("w", gw, kUidW);
      auto attrs = with_params(fe::graph::Conv_dgrad_attributes(), "dgrad");
      auto DX = graph->conv_dgrad(DY, W, attrs);
      DX->set_output(true).set_dim(gx.dim).set_stride(gx.stride).set_uid(kUidX).set_data_type(io);
      break;
    }
    case ConvOp::wgrad: {
      auto DY = make("dy", gy, kUidY);
      auto X = make("x", gx, kUidX);
      auto attrs = with_params(fe::graph::Conv_wgrad_attributes(), "wgrad");
      auto DW = graph->conv_wgrad(DY, X, attrs);
      DW->set_output(true).set_dim(gw.dim).set_stride(gw.stride).set_uid(kUidW).set_data_type(io);
      break;
    }
  }
  check_fe(graph->validate(), "graph validation", name, what);
  check_fe(graph->build_operation_graph(handle), "operation graph build", name, what);
  check_fe(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "heuristics query", name,
           what);
  // TF32 off: no engine that rounds f32 inputs (PyTorch filters the same notes).
  if (x.dtype() == DType::f32 && !tf32)
    graph->deselect_numeric_notes({fe::NumericalNote_t::TENSOR_CORE, fe::NumericalNote_t::DOWN_CONVERT_INPUTS});
  // Note [cuDNN conv workspace]: engines whose workspace passes kMaxConvWorkspace are passed over
  // (cuDNN 9.2+ filters them in the support check); when none fits, the graph is built again
  // without the cap.
  if (cap_workspace) {
    graph->deselect_workspace_greater_than(kMaxConvWorkspace);
    if (graph->check_support(handle).is_bad() ||
        graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE).is_bad())
      return build_plan(op, x, w, y, p, gx, gw, gy, tf32, handle, name, /*cap_workspace=*/false);
  } else {
    check_fe(graph->check_support(handle), "support check (no engine supports this convolution)", name, what);
    check_fe(graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "plan build", name, what);
  }
  auto plan = std::make_unique<ConvPlan>();
  int64_t workspace = 0;
  check_fe(graph->get_workspace_size(workspace), "workspace query", name, what);
  plan->tune = cudnn_autotune::plan_state(*graph, workspace);
  plan->graph = std::move(graph);
  return plan;
}

void fill_geometry(int64_t* dims, int64_t* strides, const Geometry& g) {
  for (std::size_t d = 0; d < g.dim.size(); ++d) {
    dims[d] = g.dim[d];
    strides[d] = g.stride[d];
  }
}

ConvPlan& get_plan(int device, ConvOp op, const Tensor& x, const Tensor& w, const Tensor& y, const ConvParams& p,
                   cudnnHandle_t handle, const std::string& name) {
  // One layout for the call: channels-last when any operand is strictly channels-last (the op
  // layer then gave all of them dense channels-last), else contiguous.
  const bool cl = conv_detail::channels_last(x) || conv_detail::channels_last(w) || conv_detail::channels_last(y);
  const Geometry gx = geometry(x, p.nsp, cl), gw = geometry(w, p.nsp, cl), gy = geometry(y, p.nsp, cl);
  ConvKey key;
  std::memset(&key, 0, sizeof(key));
  key.device = device;
  key.op = static_cast<int32_t>(op);
  key.dtype = static_cast<int32_t>(x.dtype());
  key.nd = static_cast<int32_t>(gx.dim.size());
  const bool tf32 = x.dtype() == DType::f32 && flame::cuda::allow_conv_tf32();
  key.tf32 = tf32 ? 1 : 0;
  fill_geometry(key.x_dim, key.x_stride, gx);
  fill_geometry(key.w_dim, key.w_stride, gw);
  fill_geometry(key.y_dim, key.y_stride, gy);
  for (int64_t i = 0; i < p.nsp; ++i) {
    key.stride[i] = p.stride[i];
    key.pad_lo[i] = p.pad_lo[i];
    key.pad_hi[i] = p.pad_hi[i];
    key.dilation[i] = p.dilation[i];
  }
  key.groups = p.groups;

  static std::shared_mutex mutex;
  static auto* cache = new std::unordered_map<ConvKey, std::unique_ptr<ConvPlan>, ConvKeyHash>();  // never freed
  {
    std::shared_lock<std::shared_mutex> lock(mutex);
    auto it = cache->find(key);
    if (it != cache->end()) return *it->second;
  }
  // A failure is cached too (graph null), so that a layout cuDNN rejects costs one build attempt.
  std::unique_ptr<ConvPlan> plan;
  try {
    plan = build_plan(op, x, w, y, p, gx, gw, gy, tf32, handle, name);
  } catch (const Error& e) {
    plan = std::make_unique<ConvPlan>();
    plan->error = e.what();
  }
  std::unique_lock<std::shared_mutex> lock(mutex);
  auto [it, inserted] = cache->emplace(key, std::move(plan));
  return *it->second;
}

// cuDNN's engines assume 16-byte aligned operands; a view at an odd offset is staged through a
// fresh tensor of the same layout (pool blocks are aligned far more).
bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }
Tensor staging_like(const Tensor& t) {
  return conv_detail::empty_in_layout(t.sizes(), t.dtype(), t.device(), conv_detail::channels_last(t));
}
Tensor aligned_input(CudaBackend& be, const Tensor& t) {
  if (aligned16(t)) return t;
  Tensor c = staging_like(t);
  be.copy(c, t);
  return c;
}

void run_conv(CudaBackend& be, ConvOp op, const Tensor& x, const Tensor& w, const Tensor& y, const ConvParams& p);

// The operand that op writes (y, x or w) is staged when misaligned, the others copied.
void run_conv_aligned(CudaBackend& be, ConvOp op, const Tensor& x, const Tensor& w, const Tensor& y,
                      const ConvParams& p) {
  const Tensor& out = op == ConvOp::fprop ? y : op == ConvOp::dgrad ? x : w;
  if (aligned16(x) && aligned16(w) && aligned16(y)) return run_conv(be, op, x, w, y, p);
  Tensor xs = op == ConvOp::dgrad ? (aligned16(x) ? x : staging_like(x)) : aligned_input(be, x);
  Tensor ws = op == ConvOp::wgrad ? (aligned16(w) ? w : staging_like(w)) : aligned_input(be, w);
  Tensor ys = op == ConvOp::fprop ? (aligned16(y) ? y : staging_like(y)) : aligned_input(be, y);
  run_conv(be, op, xs, ws, ys, p);
  const Tensor& staged = op == ConvOp::fprop ? ys : op == ConvOp::dgrad ? xs : ws;
  if (staged.data_ptr() != out.data_ptr()) be.copy(out, staged);
}

void run_conv(CudaBackend& be, ConvOp op, const Tensor& x, const Tensor& w, const Tensor& y, const ConvParams& p) {
  const std::string name = conv_name(p);
  FLAME_CHECK(x.dim() == p.nsp + 2 && x.dim() <= 5, name.c_str(), "expected ", p.nsp + 2, "-d tensors, got x ",
              x.sizes());
  FLAME_CHECK(x.dtype() == w.dtype() && x.dtype() == y.dtype(), name.c_str(), "x, w and y must share a dtype");
  const cudaStream_t stream = be.stream();
  cudnnHandle_t handle = thread_handle(be.device(), stream, name);
  ConvPlan& plan = get_plan(be.device(), op, x, w, y, p, handle, name);
  if (plan.graph == nullptr) {
    const bool cl = conv_detail::channels_last(x) || conv_detail::channels_last(w) || conv_detail::channels_last(y);
    if (!cl) throw Error(plan.error);
    // Note [cuDNN layout fallback]: no engine for this channels-last problem; run it contiguous
    // through staging copies (correct, slower) rather than fail. Reached once per call, as the
    // failure is cached.
    auto contiguous = [&](const Tensor& t, bool written) {
      Tensor c = conv_detail::empty_in_layout(t.sizes(), t.dtype(), t.device(), false);
      if (!written) be.copy(c, t);
      return c;
    };
    const Tensor xc = contiguous(x, op == ConvOp::dgrad), wc = contiguous(w, op == ConvOp::wgrad),
                 yc = contiguous(y, op == ConvOp::fprop);
    run_conv(be, op, xc, wc, yc, p);
    if (op == ConvOp::fprop) be.copy(y, yc);
    else if (op == ConvOp::dgrad) be.copy(x, xc);
    else be.copy(w, wc);
    return;
  }
  std::unordered_map<int64_t, void*> pack{{kUidX, x.data_ptr()}, {kUidW, w.data_ptr()}, {kUidY, y.data_ptr()}};
  std::lock_guard<std::mutex> lock(plan.run_mutex);
  // Tunes when due (Note [cuDNN autotuning]); the workspace goes back to the pool in stream order.
  const fe::error_t e =
      cudnn_autotune::execute(plan.tune, *plan.graph, handle, pack, be, [&] { return describe(op, x, w, y, p); });
  if (e.is_bad()) {
    fe::error_t copy = e;
    FLAME_FAIL(name.c_str(), "cuDNN execution failed for ", describe(op, x, w, y, p), ": ", copy.get_message());
  }
}

}  // namespace

void CudaBackend::conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) {
  run_conv_aligned(*this, ConvOp::fprop, x, w, y, p);
}

void CudaBackend::conv_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p) {
  run_conv_aligned(*this, ConvOp::dgrad, dx, w, dy, p);
}

void CudaBackend::conv_backward_filter(const Tensor& dw, const Tensor& x, const Tensor& dy, const ConvParams& p) {
  run_conv_aligned(*this, ConvOp::wgrad, x, dw, dy, p);
}

}  // namespace flame::backend::cuda
