// attention_qkv_packed (Note [Packed QKV attention] in src/ops/attention_packed.cpp): forward and
// qkv gradient against the explicit reshape/permute/select/SDPA composite, on the CPU for every
// route (the packed fused route runs on the CPU reference when SdpaBackend::fused is forced),
// float64 gradchecks, errors, autocast; on CUDA the cuDNN packed route against the composite in
// f32 math (bf16/f16, D 64/128, odd L, L 1, causal), the fallbacks and a CUDA-graph capture.
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "flame/amp.h"
#include "flame/cuda.h"
#include "flame/nn/attention.h"
#include "flame/profiler.h"
#include "gradcheck.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;
using F::SdpaBackend;
using F::SdpaBackendGuard;

Tensor rnd(const Shape& shape, uint64_t seed, DType dt = DType::f64, Device dev = Device::cpu()) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {DType::f64, Device::cpu()}, &g).to(dt).to(dev);
}

// What a transformer block writes without the packed op (the reference; the test's own copy).
Tensor explicit_composite(const Tensor& qkv, int64_t heads, bool causal, std::optional<double> scale = std::nullopt) {
  const int64_t b = qkv.size(0), l = qkv.size(1), hd = qkv.size(2) / (3 * heads);
  const Tensor p = qkv.reshape({b, l, 3, heads, hd}).permute({2, 0, 3, 1, 4});
  const Tensor o =
      F::scaled_dot_product_attention(p.select(0, 0), p.select(0, 1), p.select(0, 2), {}, 0.0, causal, scale);
  return o.transpose(1, 2).reshape({b, l, heads * hd});
}

struct Result {
  Tensor out, dqkv;
  std::string path, grad_fn;
};

// Forward + backward with upstream gradient `gout`; `packed` picks the op or the explicit composite.
Result run(const Tensor& qkv_values, const Tensor& gout, int64_t heads, bool causal, bool packed, SdpaBackend backend,
        std::optional<double> scale = std::nullopt) {
  Tensor qkv = qkv_values.detach().requires_grad_();
  SdpaBackendGuard guard(backend);
  Result r;
  r.out = packed ? F::attention_qkv_packed(qkv, heads, causal, scale) : explicit_composite(qkv, heads, causal, scale);
  r.path = F::sdpa_last_path();
  r.grad_fn = r.out.grad_fn_name();
  BackwardOptions opt;
  opt.grad_output = gout;
  Gradients g = r.out.backward(opt);
  r.dqkv = qkv.grad(g);
  return r;
}

void expect_gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& in) {
  const GradcheckResult r = gradcheck(fn, in);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_GT(r.checked, 0);
}

// ---------------------------------------------------------------------------------------------
// CPU: every route against the explicit composite on the math path.
// ---------------------------------------------------------------------------------------------
TEST(AttnPacked, MatchesCompositeForwardAndGradient) {
  struct Case {
    int64_t b, l, h, d;
    bool causal;
    std::optional<double> scale;
  };
  const Case cases[] = {
      {2, 5, 3, 4, false, {}}, {1, 7, 1, 8, true, {}}, {3, 4, 2, 3, true, 0.3}, {2, 1, 2, 4, false, {}}};
  uint64_t seed = 1;
  for (const DType dt : {DType::f64, DType::f32}) {
    for (const Case& c : cases) {
      const Tensor qkv = rnd({c.b, c.l, 3 * c.h * c.d}, seed++, dt);
      const Tensor gout = rnd({c.b, c.l, c.h * c.d}, seed++, dt);
      const Result want = run(qkv, gout, c.h, c.causal, false, SdpaBackend::math, c.scale);
      const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
      std::ostringstream name;
      name << dtype_name(dt) << " b" << c.b << " l" << c.l << " h" << c.h << " d" << c.d << (c.causal ? " causal" : "");
      for (const SdpaBackend be : {SdpaBackend::automatic, SdpaBackend::fused, SdpaBackend::math}) {
        const Result got = run(qkv, gout, c.h, c.causal, true, be, c.scale);
        // On the CPU `automatic` is the composite (math); forcing fused runs the packed route.
        EXPECT_EQ(got.path, be == SdpaBackend::fused ? "fused_packed" : "math") << name.str();
        if (be == SdpaBackend::fused) EXPECT_EQ(got.grad_fn, "AttentionQkvPackedBackward") << name.str();
        EXPECT_EQ(got.out.dtype(), dt);
        EXPECT_TRUE(got.out.is_contiguous()) << name.str();
        EXPECT_TRUE(close_rel(got.out, want.out, tol)) << name.str() << " out";
        EXPECT_TRUE(close_rel(got.dqkv, want.dqkv, tol)) << name.str() << " dqkv";
      }
    }
  }
}

TEST(AttnPackedGrad, PackedRouteFloat64) {
  SdpaBackendGuard fused(SdpaBackend::fused);
  expect_gradcheck([](const TensorList& x) { return F::attention_qkv_packed(x[0], 2); }, {rnd({2, 4, 18}, 20)});
  expect_gradcheck([](const TensorList& x) { return F::attention_qkv_packed(x[0], 3, true, 0.7); },
                   {rnd({1, 5, 18}, 21)});
  EXPECT_EQ(F::sdpa_last_path(), std::string("fused_packed"));
}

TEST(AttnPackedGrad, CompositeRouteFloat64) {
  expect_gradcheck([](const TensorList& x) { return F::attention_qkv_packed(x[0], 2, true); }, {rnd({2, 3, 12}, 22)});
  EXPECT_EQ(F::sdpa_last_path(), std::string("math"));
}

TEST(AttnPacked, OneNodeSavingNoProbabilities) {
  const Tensor qkv = rnd({1, 64, 3 * 2 * 2}, 30).requires_grad_();
  SdpaBackendGuard fused(SdpaBackend::fused);
  const Tensor out = F::attention_qkv_packed(qkv, 2);
  EXPECT_EQ(out.grad_fn_name(), "AttentionQkvPackedBackward");
  EXPECT_EQ(out.sizes(), (Shape{1, 64, 4}));
  // qkv, out and the stats: far less than the 2 x 64 x 64 probabilities of the math path.
  EXPECT_LT(autograd_saved_bytes(out), 2u * 64u * 64u * 8u / 2u);
  SdpaBackendGuard math(SdpaBackend::math);
  EXPECT_GE(autograd_saved_bytes(F::attention_qkv_packed(qkv, 2)), 2u * 64u * 64u * 8u);
}

TEST(AttnPacked, StridedInputs) {
  // A qkv whose last dim is not dense (transposed) is copied once; one read in place through its
  // strides (a narrow of a wider row). Gradients reach the original tensor either way.
  const int64_t b = 2, l = 5, h = 2, d = 8;
  const Tensor wide = rnd({b, l, 4 * h * d}, 40);
  const Tensor tr = rnd({b, 3 * h * d, l}, 41);
  const Tensor gout = rnd({b, l, h * d}, 42);
  for (const bool transposed : {true, false}) {
    auto make = [&](const Tensor& leaf) {
      return transposed ? leaf.transpose(1, 2) : leaf.narrow(2, h * d, 3 * h * d);
    };
    auto grads = [&](SdpaBackend be) {
      Tensor leaf = (transposed ? tr : wide).detach().requires_grad_();
      SdpaBackendGuard guard(be);
      const Tensor out = be == SdpaBackend::math ? explicit_composite(make(leaf), h, true)
                                                 : F::attention_qkv_packed(make(leaf), h, true);
      BackwardOptions opt;
      opt.grad_output = gout;
      Gradients g = out.backward(opt);
      return std::pair{out, leaf.grad(g)};
    };
    const auto [want_out, want_grad] = grads(SdpaBackend::math);
    const auto [got_out, got_grad] = grads(SdpaBackend::fused);
    EXPECT_TRUE(close_rel(got_out, want_out, 1e-12)) << (transposed ? "transposed" : "narrowed");
    EXPECT_TRUE(close_rel(got_grad, want_grad, 1e-12)) << (transposed ? "transposed" : "narrowed");
  }
}

TEST(AttnPacked, KvChunkRoutes) {
  // Note [cuDNN capture of long kv]: a forward that needs kv chunks runs the composite (whose SDPA
  // takes the chunked route); a backward that needs them (captured after an eager forward) runs
  // the chunked backward inside the packed node. Forced on the CPU reference. The chunks' dq
  // partial sums add up in f32 (rules/attention.cpp), hence the looser gradient tolerance.
  const Tensor qkv = rnd({2, 7, 3 * 2 * 4}, 50), gout = rnd({2, 7, 8}, 51);
  const Result want = run(qkv, gout, 2, false, false, SdpaBackend::math);
  SdpaBackendGuard fused(SdpaBackend::fused);
  {
    F::detail::SdpaRouteGuard chunk({false, 3});
    const Result got = run(qkv, gout, 2, false, true, SdpaBackend::fused);
    EXPECT_EQ(got.path, "fused_chunked");
    EXPECT_TRUE(close_rel(got.out, want.out, 1e-12));
    EXPECT_TRUE(close_rel(got.dqkv, want.dqkv, 1e-6));
  }
  Tensor x = qkv.detach().requires_grad_();
  const Tensor out = F::attention_qkv_packed(x, 2);
  EXPECT_EQ(F::sdpa_last_path(), std::string("fused_packed"));
  F::detail::SdpaRouteGuard chunk({false, 3});
  BackwardOptions opt;
  opt.grad_output = gout;
  Gradients g = out.backward(opt);
  EXPECT_TRUE(close_rel(x.grad(g), want.dqkv, 1e-6));
  EXPECT_FALSE(close_rel(x.grad(g), mul_scalar(want.dqkv, 1.001), 1e-6));  // the tolerance still bites
}

TEST(AttnPacked, UpstreamGradientInAnotherLayout) {
  // The rule copies a gradient that is not in the output's layout (here an expanded one from sum).
  const Tensor qkv = rnd({2, 5, 3 * 2 * 4}, 55);
  auto grad_of_sum = [&](bool packed, SdpaBackend be) {
    Tensor x = qkv.detach().requires_grad_();
    SdpaBackendGuard guard(be);
    const Tensor out = packed ? F::attention_qkv_packed(x, 2) : explicit_composite(x, 2, false);
    Gradients g = mul(out, out.detach()).sum().backward();
    return x.grad(g);
  };
  EXPECT_TRUE(close_rel(grad_of_sum(true, SdpaBackend::fused), grad_of_sum(false, SdpaBackend::math), 1e-12));
}

TEST(AttnPacked, RejectsBadInputs) {
  const Tensor ok = rnd({2, 5, 24}, 60);
  expect_error([&] { (void)F::attention_qkv_packed(rnd({2, 5, 2, 12}, 60), 2); },
               {"attention_qkv_packed", "3 dims", "[2, 5, 2, 12]"});
  expect_error([&] { (void)F::attention_qkv_packed(rnd({5, 24}, 60), 2); },
               {"attention_qkv_packed", "3 dims", "[5, 24]"});
  expect_error([&] { (void)F::attention_qkv_packed(ok, 5); },
               {"attention_qkv_packed", "divisible", "3 * num_heads = 15", "[2, 5, 24]"});
  expect_error([&] { (void)F::attention_qkv_packed(ok, 0); }, {"attention_qkv_packed", "num_heads", "0"});
  expect_error([&] { (void)F::attention_qkv_packed(ok, -1); }, {"attention_qkv_packed", "num_heads", "-1"});
  expect_error([&] { (void)F::attention_qkv_packed(ok.to(DType::i64), 2); },
               {"attention_qkv_packed", "floating", "i64"});
  expect_error([&] { (void)F::attention_qkv_packed(Tensor(), 2); }, {"attention_qkv_packed", "defined"});
  expect_error([&] { (void)F::attention_qkv_packed(ok, 2, false, std::nan("")); }, {"attention_qkv_packed", "scale"});
  {
    SdpaBackendGuard fused(SdpaBackend::fused);  // an empty batch cannot run fused
    expect_error([&] { (void)F::attention_qkv_packed(rnd({0, 5, 24}, 61), 2); },
                 {"attention_qkv_packed", "fused path", "empty"});
  }
  // The composite handles what the fused path cannot.
  EXPECT_EQ(F::attention_qkv_packed(rnd({0, 5, 24}, 61), 2).sizes(), (Shape{0, 5, 8}));
}

TEST(AttnPacked, AutocastCastsLikeSdpa) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor qkv = rnd({2, 6, 3 * 2 * 8}, 70, DType::f32, dev);
  const Tensor want = F::attention_qkv_packed(qkv.to(DType::bf16), 2, true);
  Tensor got;
  {
    amp::AutocastGuard ac(DType::bf16, dev.type);
    got = F::attention_qkv_packed(qkv, 2, true);
  }
  EXPECT_EQ(got.dtype(), DType::bf16);
  EXPECT_TRUE(all_close(got, want, 0.0, 0.0));
  const Tensor q64 = rnd({1, 3, 6}, 71, DType::f64, dev);  // f64 is never cast
  amp::AutocastGuard ac(DType::bf16, dev.type);
  EXPECT_EQ(F::attention_qkv_packed(q64, 1).dtype(), DType::f64);
}

// ---------------------------------------------------------------------------------------------
// CUDA: the cuDNN packed route against the explicit composite in f32 math on the same values.
// ---------------------------------------------------------------------------------------------
struct CudaCase {
  DType dt;
  int64_t b, l, h, d;
  bool causal;
};

std::string case_name(const CudaCase& c) {
  std::ostringstream os;
  os << dtype_name(c.dt) << "_b" << c.b << "_l" << c.l << "_h" << c.h << "_d" << c.d << (c.causal ? "_causal" : "");
  return os.str();
}

void expect_packed_matches_f32(const CudaCase& c, const char* want_path, uint64_t seed) {
  const Device dev = Device::cuda();
  // Values pass through the case's dtype first, so the f32 run sees exactly the same inputs.
  const Tensor qkv = rnd({c.b, c.l, 3 * c.h * c.d}, seed, c.dt, dev);
  const Tensor gout = rnd({c.b, c.l, c.h * c.d}, seed + 1, c.dt, dev);
  const Result got = run(qkv, gout, c.h, c.causal, true, SdpaBackend::automatic);
  const Result want = run(qkv.to(DType::f32), gout.to(DType::f32), c.h, c.causal, false, SdpaBackend::math);
  EXPECT_EQ(got.path, want_path) << case_name(c);
  EXPECT_EQ(got.out.dtype(), c.dt);
  EXPECT_EQ(got.dqkv.dtype(), c.dt);
  const double tol = c.dt == DType::bf16 ? 3e-2 : 1e-2;  // as the SDPA CUDA tests
  EXPECT_TRUE(close_rel(got.out, want.out, tol)) << case_name(c) << " out";
  EXPECT_TRUE(close_rel(got.dqkv, want.dqkv, tol)) << case_name(c) << " dqkv";
  // And against the select-based composite in the same dtype (the old route through SDPA).
  const Result old = run(qkv, gout, c.h, c.causal, false, SdpaBackend::automatic);
  EXPECT_TRUE(close_rel(got.out, old.out, tol)) << case_name(c) << " out vs select composite";
  EXPECT_TRUE(close_rel(got.dqkv, old.dqkv, tol)) << case_name(c) << " dqkv vs select composite";
}

class AttnPackedCuda : public ::testing::TestWithParam<CudaCase> {};

TEST_P(AttnPackedCuda, MatchesF32Composite) {
  FLAME_SKIP_IF_NO_CUDA();
  const CudaCase c = GetParam();
  // cuDNN rejects s_q = s_kv = 1: L = 1 runs the composite on the math path.
  expect_packed_matches_f32(c, c.l == 1 ? "math" : "fused_packed", 100);
}

INSTANTIATE_TEST_SUITE_P(
    AttnPackedShapes, AttnPackedCuda,
    ::testing::Values(CudaCase{DType::bf16, 2, 197, 3, 64, false}, CudaCase{DType::bf16, 2, 197, 3, 64, true},
                      CudaCase{DType::f16, 2, 197, 3, 64, true}, CudaCase{DType::bf16, 2, 197, 2, 128, true},
                      CudaCase{DType::f16, 2, 197, 2, 128, false}, CudaCase{DType::bf16, 3, 1, 3, 64, false},
                      CudaCase{DType::f16, 3, 1, 2, 128, true}, CudaCase{DType::bf16, 2, 256, 6, 64, false},
                      CudaCase{DType::f16, 2, 256, 6, 64, true}, CudaCase{DType::bf16, 1, 256, 2, 128, true}),
    [](const ::testing::TestParamInfo<CudaCase>& i) { return case_name(i.param); });

TEST(AttnPackedCudaRoutes, FallbacksAndLayouts) {
  FLAME_SKIP_IF_NO_CUDA();
  // f32 and a head dim that is not a multiple of 8 run the composite.
  expect_packed_matches_f32({DType::f32, 2, 33, 2, 64, false}, "math", 200);
  expect_packed_matches_f32({DType::bf16, 2, 33, 2, 12, true}, "math", 202);
  // A head dim cuDNN takes that the other cases do not use.
  expect_packed_matches_f32({DType::bf16, 2, 77, 4, 40, true}, "fused_packed", 204);
  // A forced kv-chunk route runs the composite's chunked SDPA.
  {
    F::detail::SdpaRouteGuard chunk({false, 128});
    expect_packed_matches_f32({DType::bf16, 1, 300, 2, 64, false}, "fused_chunked", 206);
  }
  // qkv with a non-dense last dim: one copy, then the packed route; its gradient reaches the leaf.
  const Device dev = Device::cuda();
  Tensor leaf = rnd({2, 3 * 2 * 64, 77}, 208, DType::bf16, dev).requires_grad_();
  const Tensor gout = rnd({2, 77, 128}, 209, DType::bf16, dev);
  BackwardOptions opt;
  opt.grad_output = gout;
  const Tensor out = F::attention_qkv_packed(leaf.transpose(1, 2), 2);
  EXPECT_EQ(F::sdpa_last_path(), std::string("fused_packed"));
  const Tensor got = leaf.grad(out.backward(opt));
  Tensor leaf32 = leaf.detach().to(DType::f32).requires_grad_();
  SdpaBackendGuard math(SdpaBackend::math);
  const Tensor want = leaf32.grad(explicit_composite(leaf32.transpose(1, 2), 2, false).backward(opt));
  EXPECT_TRUE(close_rel(out, explicit_composite(leaf32.transpose(1, 2), 2, false), 3e-2));
  EXPECT_TRUE(close_rel(got, want, 3e-2));
}

TEST(AttnPackedCudaRoutes, GraphCapture) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const CudaCase c{DType::bf16, 4, 196, 6, 64, false};  // the DiT-S shape, smaller batch
  const Tensor values = rnd({c.b, c.l, 3 * c.h * c.d}, 300, c.dt, dev);
  const Tensor gout = rnd({c.b, c.l, c.h * c.d}, 301, c.dt, dev);
  const Result want = run(values.to(DType::f32), gout.to(DType::f32), c.h, c.causal, false, SdpaBackend::math);
  Tensor qkv = values.detach().requires_grad_();
  BackwardOptions opt;
  opt.grad_output = gout;
  (void)qkv.grad(F::attention_qkv_packed(qkv, c.h).backward(opt));  // plans built outside the capture
  cuda::Graph graph;
  Tensor out, dqkv;
  std::string path;
  cuda::capture(graph, [&] {
    out = F::attention_qkv_packed(qkv, c.h);
    path = F::sdpa_last_path();
    dqkv = qkv.grad(out.backward(opt));
  });
  graph.replay();
  cuda::synchronize();
  EXPECT_EQ(path, "fused_packed");
  EXPECT_TRUE(close_rel(out, want.out, 3e-2));
  EXPECT_TRUE(close_rel(dqkv, want.dqkv, 3e-2));
}

TEST(AttnPackedCudaRoutes, BackwardRunsOnlyTheAttentionKernels) {
  // The point of the op: its backward is cuDNN's alone, with no FLAME fill, copy or add kernels
  // (the select composite's backward runs several), traced through CUPTI.
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const Tensor values = rnd({4, 196, 3 * 6 * 64}, 400, DType::bf16, dev);
  const Tensor gout = rnd({4, 196, 6 * 64}, 401, DType::bf16, dev);
  BackwardOptions opt;
  opt.grad_output = gout;
  struct Counts {
    int flame_kernels = 0, other_kernels = 0, copies = 0, memsets = 0;  // copies: device to device
  };
  auto trace_backward = [&](bool packed, Counts& c) {
    Tensor qkv = values.detach().requires_grad_();
    auto forward = [&] { return packed ? F::attention_qkv_packed(qkv, 6) : explicit_composite(qkv, 6, false); };
    (void)qkv.grad(forward().backward(opt));  // plans built before the trace
    const Tensor out = forward();
    cuda::synchronize();
    profiler::KernelTrace trace;
    if (std::string why = start_trace(trace); !why.empty()) return why;
    const Tensor dqkv = qkv.grad(out.backward(opt));
    trace.stop();
    for (const profiler::KernelRecord& r : trace.records()) {
      // Device-side copies only: cuDNN uploads small parameter blocks host-to-device itself.
      if (r.kind == profiler::KernelRecord::Kind::memcpy && (r.name == "memcpy DtoD" || r.name == "memcpy PtoP"))
        ++c.copies;
      if (r.kind == profiler::KernelRecord::Kind::memset) ++c.memsets;
      if (r.kind == profiler::KernelRecord::Kind::kernel)
        ++(r.name.find("flame::") != std::string::npos ? c.flame_kernels : c.other_kernels);
    }
    return std::string();
  };
  Counts packed, select;
  const std::string why = trace_backward(true, packed);
  if (!why.empty()) GTEST_SKIP() << "no kernel trace in this build: " << why;
  (void)trace_backward(false, select);
  EXPECT_EQ(packed.flame_kernels, 0);
  EXPECT_EQ(packed.copies, 0);
  EXPECT_GE(packed.other_kernels, 1) << "cuDNN's backward";
  EXPECT_GT(select.flame_kernels + select.memsets, packed.flame_kernels + packed.memsets)
      << "the select composite fills, copies and adds";
}

}  // namespace
}  // namespace flame::test
