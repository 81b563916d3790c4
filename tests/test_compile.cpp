// flame::compile: traced fusion (src/compile/, docs/compile.md). Every case compares the compiled
// function with the same function run eagerly on the same inputs; on the CPU the fused regions run
// through the interpreter of the same IR, on CUDA (FLAME_TEST_DEVICE=cuda) as generated kernels.
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string_view>

#include "flame/compile.h"
#include "flame/cuda/kernels.h"
#include "flame/nn/attention.h"
#include "flame/nn/conv.h"
#include "flame/nn/embedding.h"
#include "flame/nn/pool.h"
#include "flame/nn/norm.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

using Fn = std::function<TensorList(const TensorList&)>;

double tol(DType dt) { return dt == DType::bf16 ? 2e-2 : dt == DType::f16 ? 4e-3 : dt == DType::f64 ? 1e-12 : 2e-5; }

// Eager and compiled results of fn (the compiled one from a replay: the first call traces).
void expect_same_as_eager(const Fn& fn, const TensorList& in, CompiledFunction& f, double rtol, double atol) {
  const TensorList want = fn(in);
  f(in);                               // traces (eager results)
  const TensorList got = f(in);        // replays the plan
  ASSERT_EQ(f.fallback_reason(), "");
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].dtype(), want[i].dtype()) << "output " << i;
    EXPECT_EQ(got[i].device(), want[i].device()) << "output " << i;
    EXPECT_TRUE(all_close(got[i], want[i], rtol, atol)) << "output " << i;
  }
}

TEST(CompileFusion, AddScalarReluIsOneKernel) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList { return {in[0].add_scalar(1).relu()}; };
  CompiledFunction f = compile(fn);
  const Tensor x = make_input({{37, 53}, DType::f32, Layout::contiguous, -3.0, 3.0}, dev, 1);
  expect_same_as_eager(fn, {x}, f, 0, 0);
  const CompileStats s = f.stats();
  EXPECT_EQ(s.traces, 1);
  EXPECT_EQ(s.replays, 1);
  EXPECT_EQ(s.fused_kernels, 1);   // one generated kernel per replay...
  EXPECT_EQ(s.kernel_launches, 1); // ...launched once
  EXPECT_EQ(s.fused_ops, 2);       // holding add_scalar and relu
  EXPECT_EQ(s.eager_ops, 0);
  const std::string src = f.last_kernel_sources();
  EXPECT_NE(src.find("flame::fn::AddScalar{}"), std::string::npos);
  EXPECT_NE(src.find("flame::fn::Relu{}"), std::string::npos);
  // The generated code is one kernel, built from scalar_math.h's functors (embedded, not copied).
  std::size_t kernels = 0;
  for (std::size_t p = src.find("__global__"); p != std::string::npos; p = src.find("__global__", p + 1)) ++kernels;
  EXPECT_EQ(kernels, 1u);
  EXPECT_NE(src.find("FLAME_FLOAT_FN(GeluTanh,"), std::string::npos);
}

// A random elementwise program over three inputs (one broadcast, one transposed), drawn from a seed.
Fn random_chain(uint64_t seed, int length) {
  return [seed, length](const TensorList& in) -> TensorList {
    std::mt19937_64 rng(seed);
    std::vector<Tensor> vals(in.begin(), in.end());
    auto pick = [&] { return vals[rng() % vals.size()]; };
    for (int k = 0; k < length; ++k) {
      const Tensor a = pick(), b = pick();
      Tensor r;
      switch (rng() % 16) {
        case 0: r = a + b; break;
        case 1: r = a - b; break;
        case 2: r = a * b; break;
        case 3: r = a / (b.abs() + 1.0); break;
        case 4: r = maximum(a, b); break;
        case 5: r = where(a.gt(b), a, b * 0.5); break;
        case 6: r = a.relu(); break;
        case 7: r = a.sigmoid(); break;
        case 8: r = a.tanh(); break;
        case 9: r = gelu(a, true); break;
        case 10: r = a.silu(); break;
        case 11: r = a.add_scalar(0.75).mul_scalar(-1.5); break;
        case 12: r = (a * 0.5).exp(); break;
        case 13: r = a.to(DType::f32).sin().to(a.dtype()); break;
        case 14: r = gelu(a, false); break;
        default: r = 1.0 - a.square() * 0.25; break;
      }
      vals.push_back(r);
    }
    return {vals.back(), vals[vals.size() - 2]};
  };
}

TEST(CompileFusion, RandomChainsMatchEager) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " seed " + std::to_string(seed));
      const Tensor x = make_input({{6, 7, 9}, dt, Layout::contiguous}, dev, seed * 10 + 1);
      const Tensor y = make_input({{7, 1}, dt, Layout::contiguous}, dev, seed * 10 + 2);
      const Tensor z = make_input({{7, 9}, dt, Layout::transposed}, dev, seed * 10 + 3);
      Fn fn = random_chain(seed, 9);
      CompiledFunction f = compile(fn);
      // The CPU interpreter stores every value in its dtype as the eager ops do: exact. A
      // generated kernel rounds the same way; only libm's last bits may differ.
      const double t = dev.is_cpu() ? 0.0 : tol(dt);
      expect_same_as_eager(fn, {x, y, z}, f, t, t);
      EXPECT_EQ(f.stats().fused_kernels, 2);
    }
  }
}

TEST(CompileFusion, ModulateBroadcastOverTokens) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList {
    // The DiT's modulate: x * (1 + scale) + shift, scale/shift per sample broadcast over tokens.
    return {in[0] * (in[1].add_scalar(1.0)) + in[2]};
  };
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = make_input({{3, 17, 24}, dt, Layout::contiguous}, dev, 5);
    const Tensor scale = make_input({{3, 1, 24}, dt, Layout::contiguous}, dev, 6);
    const Tensor shift = make_input({{3, 1, 24}, dt, Layout::contiguous}, dev, 7);
    CompiledFunction f = compile(fn);
    const double t = dev.is_cpu() ? 0.0 : tol(dt);
    expect_same_as_eager(fn, {x, scale, shift}, f, t, t);
    EXPECT_EQ(f.stats().fused_kernels, 1);
    EXPECT_EQ(f.stats().fused_ops, 3);
  }
}

TEST(CompileFusion, ViewsOfInputsAndConstants) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor bias = make_input({{8}, DType::f32, Layout::contiguous}, dev, 9);  // captured constant
  Fn fn = [bias](const TensorList& in) -> TensorList {
    return {in[0].t() * in[1].unsqueeze(0) + bias, in[0]};  // a view of an input; an input returned
  };
  CompiledFunction f = compile(fn);
  const Tensor x = make_input({{8, 5}, DType::f32, Layout::contiguous}, dev, 10);
  const Tensor v = make_input({{8}, DType::f32, Layout::contiguous}, dev, 11);
  expect_same_as_eager(fn, {x, v}, f, 0, 0);
  EXPECT_EQ(f.stats().fused_kernels, 1);
  // A new input of the same signature: the replay reads the new values (views re-made on it).
  const Tensor x2 = make_input({{8, 5}, DType::f32, Layout::contiguous}, dev, 12);
  EXPECT_TRUE(all_close(f({x2, v})[0], fn({x2, v})[0], 0, 0));
  EXPECT_EQ(f.stats().traces, 1);
}

// matmul and reductions replay eagerly between fused regions (Note [Plan steps]).
TEST(CompileFusion, EagerOpsBetweenRegions) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList {
    const Tensor h = in[0] * in[1].add_scalar(1.0) + in[2];  // region 1 (modulate)
    const Tensor z = gelu(matmul(h, in[3]) + in[4], true);  // eager matmul, region 2 (bias + gelu)
    return {z * mean(z, {2}, true).sigmoid(), sum(h, {}, false)};  // eager mean, region 3; eager sum
  };
  auto inputs = [&](bool grad) {
    TensorList in = {make_input({{2, 5, 8}, DType::f32, Layout::contiguous}, dev, 81),
                     make_input({{2, 1, 8}, DType::f32, Layout::contiguous}, dev, 82),
                     make_input({{2, 1, 8}, DType::f32, Layout::contiguous}, dev, 83),
                     make_input({{8, 6}, DType::f32, Layout::transposed}, dev, 84),
                     make_input({{6}, DType::f32, Layout::contiguous}, dev, 85)};
    if (grad) {
      for (Tensor& t : in) t.requires_grad_(true);
    }
    return in;
  };
  CompiledFunction f = compile(fn);
  const double t = dev.is_cpu() ? 1e-6 : 1e-4;  // GEMM association order may differ
  expect_same_as_eager(fn, inputs(false), f, t, t);
  CompileStats s = f.stats();
  EXPECT_EQ(s.fused_kernels, 3);
  EXPECT_EQ(s.eager_ops, 3);  // matmul, mean, sum
  // Backward through fused regions and eager ops alike.
  const TensorList ein = inputs(true), cin = inputs(true);
  const Tensor seed = make_input({{2, 5, 6}, DType::f32, Layout::contiguous}, dev, 86);
  Gradients eg = fn(ein)[0].backward(BackwardOptions{seed});
  f(cin);
  const Tensor y = f(cin)[0];
  Gradients cg = y.backward(BackwardOptions{seed});
  for (std::size_t i = 0; i < ein.size(); ++i) {
    EXPECT_TRUE(all_close(cg.get(cin[i]), eg.get(ein[i]), 1e-4, 1e-5)) << "input " << i;
  }
  EXPECT_EQ(f.stats().backward_kernels, 3);
}

// A DiT-style block: norm + modulate, attention, gated residual; layer_norm and attention replay
// eagerly, the elementwise chains around them fuse.
TEST(CompileFusion, DiTStyleBlock) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList {
    const Tensor& x = in[0];  // [B, T, D]
    const Tensor h = nn::functional::layer_norm(x, {8}, Tensor(), Tensor(), 1e-6) * in[1].add_scalar(1.0) + in[2];
    const Tensor q = h.reshape({2, 5, 2, 4}).transpose(1, 2);
    const Tensor a = nn::functional::scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape({2, 5, 8});
    return {x + in[3] * a};
  };
  TensorList in = {make_input({{2, 5, 8}, DType::f32, Layout::contiguous}, dev, 101),
                   make_input({{2, 1, 8}, DType::f32, Layout::contiguous}, dev, 102),
                   make_input({{2, 1, 8}, DType::f32, Layout::contiguous}, dev, 103),
                   make_input({{2, 1, 8}, DType::f32, Layout::contiguous}, dev, 104)};
  CompileOptions quiet;
  quiet.log_fallbacks = false;
  CompiledFunction f = compile(fn, quiet);
  const TensorList want = fn(in);
  f(in);
  const TensorList got = f(in);
  // The head split views a fused value: the value is materialised and the views replay as eager
  // steps (reshape, transpose) around the eager attention.
  EXPECT_EQ(f.fallback_reason(), "");
  EXPECT_TRUE(all_close(got[0], want[0], 1e-5, 1e-5));
  EXPECT_EQ(f.stats().fused_kernels, 2);
  EXPECT_EQ(f.stats().eager_ops, 6);  // layer_norm, reshape, transpose, attention, transpose, reshape
  Fn flat = [](const TensorList& in) -> TensorList {
    const Tensor& x = in[0];
    const Tensor h = nn::functional::layer_norm(x, {8}, Tensor(), Tensor(), 1e-6) * in[1].add_scalar(1.0) + in[2];
    return {x + in[3] * nn::functional::scaled_dot_product_attention(h, h, h)};
  };
  CompiledFunction g = compile(flat);
  expect_same_as_eager(flat, in, g, 1e-5, 1e-5);
  EXPECT_EQ(g.stats().eager_ops, 2);
  EXPECT_EQ(g.stats().fused_kernels, 2);
}

// Every op kind is traceable (Note [Tracing]): conv, group norm, pooling, interpolate, cat, stack,
// pad, index_select, gather and embedding replay as opaque eager steps, and the elementwise chains
// between them fuse, forward and backward, instead of the whole function falling back.
TEST(CompileFusion, OpaqueOpsKeepRegionsOnBothSides) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  namespace F = nn::functional;
  Fn fn = [](const TensorList& in) -> TensorList {
    const Tensor h = (in[0] * 2.0 + 1.0).silu();                             // region 1
    const Tensor c = F::conv2d(h, in[1], in[2], {1}, 1);                     // conv2d
    const Tensor n = F::group_norm(c * 0.5 + 0.25, 2, in[3], in[4], 1e-5);   // region 2, group_norm
    const Tensor p = F::max_pool2d(n.tanh(), 2);                             // region 3, max_pool2d
    const Tensor u = F::interpolate(p * 3.0, F::InterpolateOptions().with_scale(2.0));  // region 4, interpolate
    const Tensor j = cat({u, F::avg_pool2d(n, 1)}, 1).relu();                // avg_pool2d, cat, region 5
    const Tensor s = index_select(j, 1, in[5]) - gather(j, 1, in[6]);        // index_select, gather, region 6
    const Tensor e = F::embedding(in[8], in[7]).sum({-1}).reshape({2, 1, 1, 1});  // embedding, sum
    const Tensor t = stack({s, pad(s, {0, 0, 0, 0}) * 0.5}, 0).sum({0}) + e; // pad, region 7, stack, sum, region 8
    return {t};
  };
  auto inputs = [&](bool grad) {
    TensorList in = {make_input({{2, 3, 8, 8}, DType::f32, Layout::contiguous}, dev, 201),
                     make_input({{4, 3, 3, 3}, DType::f32, Layout::contiguous}, dev, 202),
                     make_input({{4}, DType::f32, Layout::contiguous}, dev, 203),
                     make_input({{4}, DType::f32, Layout::contiguous}, dev, 204),
                     make_input({{4}, DType::f32, Layout::contiguous}, dev, 205),
                     Tensor::from_vec<int64_t>({0, 5, 2}, {3}, dev),
                     Tensor::from_vec<int64_t>(std::vector<int64_t>(2 * 3 * 8 * 8, 1), {2, 3, 8, 8}, dev),
                     make_input({{5, 6}, DType::f32, Layout::contiguous}, dev, 206),
                     Tensor::from_vec<int64_t>({4, 1}, {2}, dev)};
    if (grad) {
      for (int i : {0, 1, 2, 3, 4, 7}) in[i].requires_grad_(true);
    }
    return in;
  };
  CompiledFunction f = compile(fn);
  const double t = dev.is_cpu() ? 1e-5 : 1e-4;
  expect_same_as_eager(fn, inputs(false), f, t, t);
  const CompileStats st = f.stats();
  // conv2d, group_norm, max_pool2d, interpolate, avg_pool2d, cat, index_select, gather, embedding,
  // sum, reshape, pad, stack, sum
  EXPECT_EQ(st.eager_ops, 14);
  EXPECT_GE(st.fused_kernels, 6);
  const TensorList ein = inputs(true), cin = inputs(true);
  const Tensor seed = make_input({{2, 3, 8, 8}, DType::f32, Layout::contiguous}, dev, 207);
  Gradients eg = fn(ein)[0].backward(BackwardOptions{seed});
  f(cin);
  Gradients cg = f(cin)[0].backward(BackwardOptions{seed});
  EXPECT_EQ(f.fallback_reason(), "");
  for (int i : {0, 1, 2, 3, 4, 7}) {
    EXPECT_TRUE(all_close(cg.get(cin[i]), eg.get(ein[i]), 1e-4, 1e-5)) << "input " << i;
  }
}

// The reductions are one op definition (Note [Reduction definitions] in src/ops/reduce.cpp): each
// is an opaque step of the trace, with sum and prod run in f32 under autocast.
TEST(CompileFusion, EveryReductionIsAnOpaqueStep) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList {
    const Tensor h = (in[0] * 0.5 + 1.0).sigmoid() + 0.5;                     // region 1
    const Tensor p = prod(h, {1}, true);                                      // prod
    const Tensor m = amax(h, {0}, false) - amin(h * 2.0, {0}, false);         // amax, region 2, amin
    const Tensor a = argmax(h, 1, false).to(DType::f32) + argmin(h, 1, false).to(DType::f32);  // argmax, argmin
    const Tensor b = any(h.gt(h * 0.0 + 1.2), {1}, false).to(DType::f32) * all(h.gt(h * 0.0 + 0.5), {1}, false).to(DType::f32);
    return {(h / p).mean({1}) + a * 0.01 + b + m.sum()};                      // mean, sum
  };
  auto inputs = [&](bool grad) {
    TensorList in = {make_input({{4, 5}, DType::f32, Layout::contiguous}, dev, 301)};
    if (grad) in[0].requires_grad_(true);
    return in;
  };
  CompiledFunction f = compile(fn);
  const double t = dev.is_cpu() ? 1e-5 : 1e-4;
  expect_same_as_eager(fn, inputs(false), f, t, t);
  // prod, amax, amin, argmax, argmin, any, all, mean, sum
  EXPECT_EQ(f.stats().eager_ops, 9);
  EXPECT_GE(f.stats().fused_kernels, 3);
  const TensorList ein = inputs(true), cin = inputs(true);
  const Tensor seed = make_input({{4}, DType::f32, Layout::contiguous}, dev, 302);
  Gradients eg = fn(ein)[0].backward(BackwardOptions{seed});
  f(cin);
  Gradients cg = f(cin)[0].backward(BackwardOptions{seed});
  EXPECT_EQ(f.fallback_reason(), "");
  EXPECT_TRUE(all_close(cg.get(cin[0]), eg.get(ein[0]), 1e-4, 1e-5));
}

// Every public unary op of the op table (Note [Op table]) fuses with its neighbours into one
// kernel, forward and backward, and matches eager: a new row gets this test without an edit.
TEST(CompileFusion, EveryTableOpFusesForwardAndBackward) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  struct TableOp {
    const char* name;
    bool predicate;
    Tensor (*run)(const Tensor&);
  };
#define FLAME_TABLE_OP(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface({#name, std::string_view(#kind) == "predicate", [](const Tensor& x) { return flame::name(x); }}, )
  const std::vector<TableOp> ops = {FLAME_UNARY_OPS(FLAME_TABLE_OP)};
#undef FLAME_TABLE_OP
  ASSERT_GE(ops.size(), 25u);
  const Tensor seed = make_input({{6, 33}, DType::f32, Layout::contiguous}, dev, 212);
  for (const TableOp& op : ops) {
    SCOPED_TRACE(op.name);
    // |x| / 2 + 0.5 keeps log, sqrt, rsqrt and reciprocal in their domain.
    Fn fn = [&op](const TensorList& in) -> TensorList {
      const Tensor y = op.run(in[0].abs() * 0.5 + 0.5);
      return {op.predicate ? y : y * 3.0 - 1.0};
    };
    CompiledFunction f = compile(fn);
    const Tensor x = make_input({{6, 33}, DType::f32, Layout::contiguous, -2.0, 2.0}, dev, 211);
    expect_same_as_eager(fn, {x}, f, 1e-5, 1e-6);
    const CompileStats st = f.stats();
    EXPECT_EQ(st.eager_ops, 0);
    EXPECT_EQ(st.fused_kernels, 1);
    if (op.predicate) continue;
    const Tensor xe = x.detach().requires_grad_(true), xc = x.detach().requires_grad_(true);
    const Gradients eg = fn({xe})[0].backward(BackwardOptions{seed});
    const Gradients cg = f({xc})[0].backward(BackwardOptions{seed});
    EXPECT_EQ(f.fallback_reason(), "");
    // sign, floor, ceil, round, trunc: a zero gradient, as eager's
    EXPECT_TRUE(all_close(cg.get_or_zeros(xc), eg.get_or_zeros(xe), 1e-5, 1e-6));
  }
}

// adaLN as in the DiT: a GEMM of the conditioning chunked into shift/scale/gate, norm + modulate,
// gated residual; forward and every gradient equal eager (views of the GEMM output replay).
TEST(CompileAutograd, AdaLNChunkMatchesEager) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList {
    const TensorList m = matmul(in[1], in[2]).chunk(3, 1);  // [B, 3D] -> shift, scale, gate
    const Tensor h = nn::functional::layer_norm(in[0], {8}) * m[1].unsqueeze(1).add_scalar(1.0) + m[0].unsqueeze(1);
    return {in[0] + m[2].unsqueeze(1) * gelu(h, true)};
  };
  auto inputs = [&] {
    TensorList in = {make_input({{2, 5, 8}, DType::f32, Layout::contiguous}, dev, 111),
                     make_input({{2, 4}, DType::f32, Layout::contiguous}, dev, 112),
                     make_input({{4, 24}, DType::f32, Layout::contiguous}, dev, 113)};
    for (Tensor& t : in) t.requires_grad_(true);
    return in;
  };
  const TensorList ein = inputs(), cin = inputs();
  const Tensor seed = make_input({{2, 5, 8}, DType::f32, Layout::contiguous}, dev, 114);
  const Tensor want = fn(ein)[0];
  Gradients eg = want.backward(BackwardOptions{seed});
  CompiledFunction f = compile(fn);
  f(cin);
  const Tensor got = f(cin)[0];
  ASSERT_EQ(f.fallback_reason(), "");
  EXPECT_EQ(f.stats().fused_kernels, 1);  // modulate, gelu and the gated residual: one kernel
  EXPECT_TRUE(all_close(got, want, 1e-5, 1e-5));
  Gradients cg = got.backward(BackwardOptions{seed});
  for (std::size_t i = 0; i < ein.size(); ++i) {
    EXPECT_TRUE(all_close(cg.get(cin[i]), eg.get(ein[i]), 1e-4, 1e-5)) << "input " << i;
  }
}

// A captured tensor that gets new geometry (set_data) makes the trace stale: it is traced again.
TEST(CompileTrace, CapturedTensorWithNewShapeRetraces) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor bias = make_input({{5}, DType::f32, Layout::contiguous}, dev, 131);
  Fn fn = [bias](const TensorList& in) -> TensorList { return {(in[0] + bias).relu()}; };
  CompiledFunction f = compile(fn);
  const Tensor x = make_input({{4, 5}, DType::f32, Layout::contiguous}, dev, 132);
  expect_same_as_eager(fn, {x}, f, 0, 0);
  bias.set_data(make_input({{4, 5}, DType::f32, Layout::transposed}, dev, 133));
  EXPECT_TRUE(all_close(f({x})[0], fn({x})[0], 0, 0));
  EXPECT_EQ(f.stats().traces, 2);
  EXPECT_TRUE(all_close(f({x})[0], fn({x})[0], 0, 0));  // and replays the new trace
  EXPECT_EQ(f.stats().replays, 2);
}

TEST(CompileTrace, RetraceOnNewShapeAndBoundedCache) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList { return {(in[0] * 2.0).tanh()}; };
  CompileOptions opt;
  opt.max_signatures = 2;
  CompiledFunction f = compile(fn, opt);
  const double t = dev.is_cpu() ? 0.0 : 1e-6;  // tanh of NVRTC's and nvcc's builds
  for (int64_t n : {5, 9, 5, 13}) {
    const Tensor x = make_input({{n, 3}, DType::f32, Layout::contiguous}, dev, static_cast<uint64_t>(n));
    EXPECT_TRUE(all_close(f({x})[0], fn({x})[0], t, t)) << n;
    EXPECT_TRUE(all_close(f({x})[0], fn({x})[0], t, t)) << n;
  }
  const CompileStats s = f.stats();
  EXPECT_EQ(s.traces, 3);     // 5, 9, 13 (the second 5 replayed)
  EXPECT_EQ(s.evictions, 1);  // 13 dropped the least recently used (9)
  EXPECT_EQ(s.replays, 5);
  // A different dtype or requires_grad is a new signature too.
  f({make_input({{5, 3}, DType::f64, Layout::contiguous}, dev, 3)});
  EXPECT_EQ(f.stats().traces, 4);
}

TEST(CompileAutograd, BackwardMatchesEager) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList {
    const Tensor h = in[0] * in[1].add_scalar(1.0) + in[2];  // modulate
    return {in[0] + in[3] * gelu(h, true)};                  // gated residual of a gelu
  };
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto inputs = [&] {
      TensorList in = {make_input({{4, 6, 16}, dt, Layout::contiguous}, dev, 21),
                       make_input({{4, 1, 16}, dt, Layout::contiguous}, dev, 22),
                       make_input({{4, 1, 16}, dt, Layout::contiguous}, dev, 23),
                       make_input({{4, 1, 16}, dt, Layout::contiguous}, dev, 24)};
      for (Tensor& t : in) t.requires_grad_(true);
      return in;
    };
    const TensorList ein = inputs(), cin = inputs();
    const Tensor seed = make_input({{4, 6, 16}, dt, Layout::contiguous}, dev, 25);
    Gradients eg = fn(ein)[0].backward(BackwardOptions{seed});
    CompiledFunction f = compile(fn);
    f(cin);  // trace
    const Tensor y = f(cin)[0];
    EXPECT_EQ(std::string(y.grad_fn_name()), "FusedBackward");
    Gradients cg = y.backward(BackwardOptions{seed});
    const double t = dev.is_cpu() && dt == DType::f32 ? 1e-5 : tol(dt) * 2;
    for (std::size_t i = 0; i < ein.size(); ++i) {
      ASSERT_TRUE(cg.contains(cin[i])) << i;
      EXPECT_EQ(cg.get(cin[i]).sizes(), cin[i].sizes());
      EXPECT_EQ(cg.get(cin[i]).dtype(), dt);
      EXPECT_TRUE(all_close(cg.get(cin[i]), eg.get(ein[i]), t, t)) << "input " << i;
    }
    const CompileStats s = f.stats();
    EXPECT_EQ(s.backward_kernels, 1);  // the whole region's backward: one generated kernel
    EXPECT_LE(s.saved_inputs, 4);      // region inputs only, no intermediate
  }
}

// x + b: both gradients are the output gradient itself (b's summed down): no backward kernel.
TEST(CompileAutograd, PassThroughGradientsLaunchNothing) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList { return {in[0] + in[1]}; };
  TensorList in = {make_input({{5, 6}, DType::bf16, Layout::contiguous}, dev, 91),
                   make_input({{6}, DType::bf16, Layout::contiguous}, dev, 92)};
  for (Tensor& t : in) t.requires_grad_(true);
  const Tensor seed = make_input({{5, 6}, DType::bf16, Layout::contiguous}, dev, 93);
  CompiledFunction f = compile(fn);
  f(in);
  Gradients g = f(in)[0].backward(BackwardOptions{seed});
  EXPECT_EQ(f.stats().backward_kernels, 0);
  EXPECT_TRUE(all_close(g.get(in[0]), seed, 0, 0));
  EXPECT_TRUE(all_close(g.get(in[1]), seed.to(DType::f32).sum({0}).to(DType::bf16), 1e-2, 1e-2));
}

// Gradcheck (f64, CPU) through the compiled function: exercises every derivative formula of
// autodiff.cpp against finite differences of the interpreted forward of the same IR.
TEST(CompileAutograd, GradcheckF64) {
  const std::vector<std::pair<const char*, Fn>> cases = {
      {"arith", [](const TensorList& in) -> TensorList {
         return {(in[0] * in[1] - in[0] / (in[1].square() + 1.0)).add_scalar(0.5) * 3.0 - in[1].neg()};
       }},
      {"activations", [](const TensorList& in) -> TensorList {
         return {gelu(in[0], true) + gelu(in[1], false) * in[0].silu() + in[0].sigmoid() * in[1].tanh() +
                 softplus(in[0], 1.5, 20.0) + in[1].mish() + elu(in[0], 0.7) + leaky_relu(in[1], 0.1)};
       }},
      {"transcendental", [](const TensorList& in) -> TensorList {
         const Tensor p = in[0].abs() + 0.5;
         return {p.log() + p.sqrt() + p.rsqrt() + p.reciprocal() + in[1].exp() + in[1].expm1() + p.log1p() +
                 in[0].sin() * in[1].cos() + pow(p, 1.7) + (2.0 / p)};
       }},
      {"select", [](const TensorList& in) -> TensorList {
         return {where(in[0].gt(in[1]), in[0] * 2.0, in[1].relu()) + maximum(in[0], in[1] * 0.5) +
                 minimum(in[0], in[1]) + clamp(in[0], -0.5, 0.7) + pow(in[0].abs() + 0.5, in[1])};
       }},
      {"broadcast", [](const TensorList& in) -> TensorList {
         return {in[0] * in[1].add_scalar(1.0) + in[1].tanh()};
       }},
  };
  for (const auto& [name, fn] : cases) {
    SCOPED_TRACE(name);
    CompiledFunction f = compile(fn);
    const bool bc = std::string(name) == "broadcast";
    const Tensor a = make_input({{3, 4}, DType::f64, Layout::contiguous}, Device::cpu(), 31);
    const Tensor b = make_input({bc ? Shape{1, 4} : Shape{3, 4}, DType::f64, Layout::transposed}, Device::cpu(), 32);
    // Trace the signature gradcheck's analytic pass uses (detached inputs that require grad), so
    // its gradients come from the fused backward; the numeric passes (no grad) run other traces.
    Tensor wa = a.detach(), wb = b.detach();
    wa.requires_grad_(true);
    wb.requires_grad_(true);
    f({wa, wb});
    const GradcheckResult r = gradcheck([&](const TensorList& in) { return f(in)[0]; }, {a, b});
    EXPECT_TRUE(r.ok) << r.message;
    EXPECT_GT(r.checked, 0);
    EXPECT_EQ(f.fallback_reason(), "");
    EXPECT_GT(f.stats().replays, 0);
    EXPECT_GT(f.stats().backward_kernels, 0);
  }
}

void expect_fallback(const Fn& fn, const TensorList& in, const std::string& reason_part) {
  CompileOptions opt;
  opt.log_fallbacks = false;
  CompiledFunction f = compile(fn, opt);
  const TensorList want = fn(in);
  for (int call = 0; call < 2; ++call) {
    const TensorList got = f(in);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(all_close(got[i], want[i], 1e-6, 1e-6));
  }
  EXPECT_NE(f.fallback_reason().find(reason_part), std::string::npos) << f.fallback_reason();
  EXPECT_EQ(f.stats().eager_calls, 2);
  EXPECT_EQ(f.stats().replays, 0);
  EXPECT_EQ(f.stats().fused_kernels, 0);
}

TEST(CompileFallback, EachReason) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = make_input({{4, 5}, DType::f32, Layout::contiguous}, dev, 41);
  // A host read: the value would be baked into the trace.
  expect_fallback([](const TensorList& in) -> TensorList { return {in[0] * in[0].sum().item<float>()}; }, {x},
                  "host read");
  // An op the tracer does not record, whose result the function uses.
  expect_fallback([](const TensorList& in) -> TensorList { return {zeros_like(in[0]) + in[0].relu()}; }, {x},
                  "is not traced");
  // A data-dependent shape (masked_select's length comes from the values).
  expect_fallback([](const TensorList& in) -> TensorList { return {masked_select(in[0], in[0].gt(in[0] * 0.0)) * 2.0}; },
                  {x}, "is not traced");
  // In-place writes.
  expect_fallback([](const TensorList& in) -> TensorList {
    Tensor t = in[0].clone();
    TensorList c = {t};
    c[0].add_(1.0);
    return {c[0] * 2.0};
  }, {x}, "in-place");
  // An expand of inputs that share storage (a view leaf would not know which input it views).
  expect_fallback([](const TensorList& in) -> TensorList { return {in[0].expand({2, 4, 5}) + in[1]}; }, {x, x},
                  "share storage");
  // A view the tracer does not replay as a step (expand) of an input that requires grad (it
  // would need an as_strided backward).
  Tensor xg = x.clone();
  xg.requires_grad_(true);
  expect_fallback([](const TensorList& in) -> TensorList { return {in[0].expand({3, 4, 5}) * 2.0}; }, {xg},
                  "requires grad");
}

// Inputs that share storage (the chunks of one GEMM output) compile: each is read by itself.
TEST(CompileFusion, InputsSharingStorage) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Fn fn = [](const TensorList& in) -> TensorList { return {in[0] * in[1].add_scalar(1.0) + in[2]}; };
  const Tensor m = make_input({{4, 9}, DType::f32, Layout::contiguous}, dev, 121);
  const TensorList parts = m.chunk(3, 1);
  CompiledFunction f = compile(fn);
  expect_same_as_eager(fn, {parts[0], parts[1], parts[2]}, f, 0, 0);
  EXPECT_EQ(f.stats().fused_kernels, 1);
}

TEST(CompileFallback, NestedCompileRunsInsideTheOuterTrace) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  CompiledFunction inner = compile([](const TensorList& in) -> TensorList { return {in[0].sigmoid()}; });
  Fn fn = [inner](const TensorList& in) -> TensorList { return {inner({in[0] * 3.0})[0] + 1.0}; };
  CompiledFunction outer = compile(fn);
  const Tensor x = make_input({{9}, DType::f32, Layout::contiguous}, dev, 51);
  expect_same_as_eager(fn, {x}, outer, 0, dev.is_cpu() ? 0 : 1e-6);
  EXPECT_EQ(outer.stats().fused_kernels, 1);
  EXPECT_EQ(outer.stats().fused_ops, 3);
}

// The generated source compiles with NVRTC (needs a CUDA build, not a GPU), and a second cache
// over the same directory finds it on disk instead of compiling it again.
TEST(CompileCache, GeneratedKernelsCompileAndComeFromDisk) {
  if (!cuda::kernel_compiler_available()) GTEST_SKIP() << "CPU-only build: no NVRTC";
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("flame_compile_cache_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Fn fn = [](const TensorList& in) -> TensorList {
    const Tensor h = in[0] * in[1].add_scalar(1.0) + in[2];
    return {where(h.gt(in[2]), gelu(h, true), h.silu()).to(DType::f32)};
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    SCOPED_TRACE(dtype_name(dt));
    CompiledFunction f = compile(fn);
    const TensorList in = {make_input({{4, 6, 8}, dt, Layout::transposed}, Device::cpu(), 61),
                           make_input({{4, 1, 8}, dt, Layout::contiguous}, Device::cpu(), 62),
                           make_input({{8}, dt, Layout::contiguous}, Device::cpu(), 63)};
    f(in);
    const std::string src = f.last_kernel_sources();
    const auto p = src.find("flame_fused_");
    ASSERT_NE(p, std::string::npos);
    const std::string name = src.substr(p, std::string("flame_fused_").size() + 16);
    const std::string kernel_src = src.substr(0, src.find("\n// ---- end of"));
    {
      cuda::CudaKernels cache(cuda::KernelCacheOptions{dir.string()});
      EXPECT_FALSE(cache.precompile(name, kernel_src, {}, 90));
      EXPECT_EQ(cache.stats().compiles, 1u);
    }
    cuda::CudaKernels again(cuda::KernelCacheOptions{dir.string()});
    EXPECT_TRUE(again.precompile(name, kernel_src, {}, 90));
    EXPECT_EQ(again.stats().compiles, 0u);
    EXPECT_EQ(again.stats().disk_hits, 1u);
  }
  std::filesystem::remove_all(dir);
}

// On the GPU: a replay after the process-wide memory cache is cleared loads from disk.
TEST(CompileCache, ClearedMemoryCacheLoadsFromDisk) {
  FLAME_SKIP_IF_NO_CUDA();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("flame_compile_disk_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  cuda::CudaKernels& global = cuda::CudaKernels::global();
  if (global.disk_dir().empty()) GTEST_SKIP() << "the disk cache is off (FLAME_KERNEL_CACHE=off)";
  Fn fn = [](const TensorList& in) -> TensorList { return {(in[0] * 1.25).add_scalar(0.125).silu()}; };
  const Tensor x = make_input({{33, 7}, DType::bf16, Layout::contiguous}, Device::cuda(0), 71);
  CompiledFunction f1 = compile(fn);
  f1({x});
  const Tensor a = f1({x})[0];
  global.clear_memory_cache();
  const auto before = global.stats();
  CompiledFunction f2 = compile(fn);  // a new plan: its kernel is looked up again
  f2({x});
  const Tensor b = f2({x})[0];
  const auto after = global.stats();
  EXPECT_EQ(after.compiles, before.compiles);
  EXPECT_EQ(after.disk_hits, before.disk_hits + 1);
  EXPECT_TRUE(all_close(a, b, 0, 0));
  EXPECT_TRUE(all_close(b, fn({x})[0], tol(DType::bf16), tol(DType::bf16)));
}

}  // namespace
}  // namespace flame::test
