// Autotuning of Linear's cuBLASLt epilogue GEMMs and the column-sum bias gradient (Note [Epilogue
// autotuning] in src/backend/cuda/epi/linear_epilogue.cu, docs/epi.md).
//  - EpiTuneSettings.*: the switches of flame/cuda.h (every build).
//  - EpiTune.*: CUDA only (skip without a GPU). Every epilogue the ops reach (BIAS, GELU_BIAS,
//    GELU_AUX_BIAS, DGELU, BGRADB, and the plain GEMM + column-sum kernel for the bias gradient)
//    against a float64 CPU reference written with plain ops, with autotuning on and off and each
//    bias-gradient mode; row counts that are not multiples of any tile size; repeated calls give
//    the same bits; a graph captured after tuning runs the cached plan (no new plan, same bits as
//    eager); a shape first seen under capture takes the heuristic's plan and still tunes eagerly
//    afterwards. The plan counters (cuda::epilogue_tune_stats) tell which kind of plan was made.
//    Each case draws fresh row counts, so its shapes miss the process-wide plan cache.
//  - EpiTuneEnv.*: FLAME_EPI_AUTOTUNE=0 read at start-up, in a child process (Note [Epilogue
//    tune child] below).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "flame/cuda.h"
#include "flame/nn.h"
#include "flame/nn/linear_gelu.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;
using cuda::EpilogueBiasGrad;

// Sets the autotuning switch and the bias-gradient mode for a scope, restoring both after.
class TuneScope {
 public:
  TuneScope(bool autotune, EpilogueBiasGrad mode)
      : autotune_(cuda::epilogue_autotune()), mode_(cuda::epilogue_bias_grad()) {
    cuda::set_epilogue_autotune(autotune);
    cuda::set_epilogue_bias_grad(mode);
  }
  ~TuneScope() {
    cuda::set_epilogue_autotune(autotune_);
    cuda::set_epilogue_bias_grad(mode_);
  }
  TuneScope(const TuneScope&) = delete;
  TuneScope& operator=(const TuneScope&) = delete;

 private:
  bool autotune_;
  EpilogueBiasGrad mode_;
};

// Row counts no earlier call of this process used (odd: no tile size divides them).
int64_t fresh_rows() {
  static std::atomic<int64_t> next{517};
  return next.fetch_add(26);
}

double tol_for(DType dt) {
  switch (dt) {
    case DType::bf16: return 2e-2;
    case DType::f16: return 4e-3;
    default: return 2e-4;
  }
}

// gelu (tanh approximation) with plain ops: independent of the kernels under test.
Tensor ref_gelu(const Tensor& p) {
  const double k = std::sqrt(2.0 / M_PI);
  return p * 0.5 * (((p + p * p * p * 0.044715) * k).tanh() + 1.0);
}

using Fn = std::function<Tensor(const TensorList&)>;

struct Outputs {
  Tensor y;
  TensorList grads;  // of every leaf, on the CPU
};

// leaves64 (CPU f64) rounded to dt, moved to dev as fresh leaves; v64 the upstream gradient.
Outputs run_on(const Fn& fn, const TensorList& leaves64, const Tensor& v64, DType dt, Device dev) {
  TensorList leaves;
  for (const Tensor& t : leaves64) leaves.push_back(t.detach().to(dt).to(dev).requires_grad_());
  const Tensor y = fn(leaves);
  BackwardOptions o;
  o.grad_output = v64.to(dt).to(dev);
  Gradients g = y.backward(o);
  Outputs r;
  r.y = y.detach().to(Device::cpu());
  for (const Tensor& t : leaves) r.grads.push_back(g.get(t).to(Device::cpu()));
  return r;
}

Tensor rounded(const Tensor& t, DType dt) { return t.to(dt).to(DType::f64); }

// The op on the GPU against the reference on the CPU in f64 (same rounded inputs), then the op
// again: the second run must give the same bits.
void expect_case(const std::string& what, const Fn& op, const Fn& ref, const TensorList& leaves64,
                 const Tensor& v64, DType dt) {
  TensorList r64;
  for (const Tensor& t : leaves64) r64.push_back(rounded(t, dt));
  const Tensor rv = rounded(v64, dt);
  const Outputs want = run_on(ref, r64, rv, DType::f64, Device::cpu());
  const Outputs got = run_on(op, r64, rv, dt, Device::cuda(0));
  const double tol = tol_for(dt);
  EXPECT_TRUE(close_scaled(got.y, want.y, tol)) << what << " forward, " << dtype_name(dt);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (std::size_t i = 0; i < want.grads.size(); ++i)
    EXPECT_TRUE(close_scaled(got.grads[i], want.grads[i], tol)) << what << " gradient " << i << ", " << dtype_name(dt);
  const Outputs again = run_on(op, r64, rv, dt, Device::cuda(0));
  EXPECT_EQ(again.y.to_vec<double>(), got.y.to_vec<double>()) << what << ": forward bits differ between calls";
  for (std::size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_EQ(again.grads[i].to_vec<double>(), got.grads[i].to_vec<double>())
        << what << ": gradient " << i << " bits differ between calls";
}

enum class Family { linear_bias, linear_gelu, mlp_gelu };

const char* family_name(Family f) {
  switch (f) {
    case Family::linear_bias: return "linear+bias";
    case Family::linear_gelu: return "linear_gelu";
    case Family::mlp_gelu: return "mlp_gelu";
  }
  return "?";
}

// One forward+backward of the family on [rows, in] -> out (mlp: in -> out -> in).
void family_case(Family f, int64_t rows, int64_t in, int64_t out, DType dt, uint64_t seed) {
  TensorList leaves{randn_f64({rows, in}, seed), randn_f64({out, in}, seed + 1, 1.0 / std::sqrt(double(in))),
                    randn_f64({out}, seed + 2, 0.5)};
  int64_t y_cols = out;
  if (f == Family::mlp_gelu) {
    leaves.push_back(randn_f64({in, out}, seed + 3, 1.0 / std::sqrt(double(out))));
    leaves.push_back(randn_f64({in}, seed + 4, 0.5));
    y_cols = in;
  }
  const Tensor v = randn_f64({rows, y_cols}, seed + 5);
  Fn op, ref;
  switch (f) {
    case Family::linear_bias:
      op = [](const TensorList& t) { return F::linear(t[0], t[1], t[2]); };
      ref = [](const TensorList& t) { return t[0].matmul(t[1].t()) + t[2]; };
      break;
    case Family::linear_gelu:
      op = [](const TensorList& t) { return F::linear_gelu(t[0], t[1], t[2]); };
      ref = [](const TensorList& t) { return ref_gelu(t[0].matmul(t[1].t()) + t[2]); };
      break;
    case Family::mlp_gelu:
      op = [](const TensorList& t) { return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4]); };
      ref = [](const TensorList& t) { return ref_gelu(t[0].matmul(t[1].t()) + t[2]).matmul(t[3].t()) + t[4]; };
      break;
  }
  const std::string what = std::string(family_name(f)) + " rows " + std::to_string(rows) + " in " +
                           std::to_string(in) + " out " + std::to_string(out);
  expect_case(what, op, ref, leaves, v, dt);
}

// linear_gelu under no-grad: the GELU_BIAS epilogue (no pre-activation saved).
void nograd_gelu_case(int64_t rows, int64_t in, int64_t out, DType dt, uint64_t seed) {
  const Tensor x = rounded(randn_f64({rows, in}, seed), dt);
  const Tensor w = rounded(randn_f64({out, in}, seed + 1, 1.0 / std::sqrt(double(in))), dt);
  const Tensor b = rounded(randn_f64({out}, seed + 2, 0.5), dt);
  const Tensor want = ref_gelu(x.matmul(w.t()) + b);
  const Device gpu = Device::cuda(0);
  NoGradGuard no_grad;
  const Tensor xg = x.to(dt).to(gpu), wg = w.to(dt).to(gpu), bg = b.to(dt).to(gpu);
  const Tensor got = F::linear_gelu(xg, wg, bg).to(Device::cpu());
  EXPECT_TRUE(close_scaled(got, want, tol_for(dt))) << "no-grad linear_gelu rows " << rows << ", " << dtype_name(dt);
  EXPECT_EQ(F::linear_gelu(xg, wg, bg).to(Device::cpu()).to_vec<double>(), got.to_vec<double>())
      << "no-grad linear_gelu: bits differ between calls";
}

std::string mode_name(bool autotune, EpilogueBiasGrad m) {
  const char* bg = m == EpilogueBiasGrad::automatic ? "automatic" : m == EpilogueBiasGrad::epilogue ? "epilogue"
                                                                                                     : "column_sum";
  return std::string(autotune ? "autotune on" : "autotune off") + ", bias grad " + bg;
}

// ---------------------------------------------------------------------------------------------
// Settings (every build).
// ---------------------------------------------------------------------------------------------

TEST(EpiTuneSettings, SwitchesRoundTrip) {
  const TuneScope scope(true, EpilogueBiasGrad::automatic);
  EXPECT_TRUE(cuda::epilogue_autotune());
  cuda::set_epilogue_autotune(false);
  EXPECT_FALSE(cuda::epilogue_autotune());
  cuda::set_epilogue_autotune(true);
  EXPECT_TRUE(cuda::epilogue_autotune());
  for (EpilogueBiasGrad m : {EpilogueBiasGrad::column_sum, EpilogueBiasGrad::epilogue, EpilogueBiasGrad::automatic}) {
    cuda::set_epilogue_bias_grad(m);
    EXPECT_EQ(cuda::epilogue_bias_grad(), m);
  }
}

TEST(EpiTuneSettings, StatsCountOnlyWhatRan) {
  const cuda::EpilogueTuneStats s = cuda::epilogue_tune_stats();
  if (!cuda_is_available()) {  // nothing plans epilogue GEMMs without a GPU
    EXPECT_EQ(s.tuned_plans, 0u);
    EXPECT_EQ(s.heuristic_plans, 0u);
    EXPECT_EQ(s.timed_candidates, 0u);
    EXPECT_EQ(s.column_sum_plans, 0u);
  }
  EXPECT_LE(s.column_sum_plans, s.tuned_plans + s.heuristic_plans);
}

// ---------------------------------------------------------------------------------------------
// CUDA: every epilogue in every mode.
// ---------------------------------------------------------------------------------------------

TEST(EpiTune, EveryEpilogueMatchesReferenceInEveryMode) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 1000;
  for (bool autotune : {true, false}) {
    for (EpilogueBiasGrad m : {EpilogueBiasGrad::automatic, EpilogueBiasGrad::epilogue, EpilogueBiasGrad::column_sum}) {
      const TuneScope scope(autotune, m);
      for (DType dt : {DType::bf16, DType::f32}) {
        for (Family f : {Family::linear_bias, Family::linear_gelu, Family::mlp_gelu}) {
          SCOPED_TRACE(mode_name(autotune, m));
          const cuda::EpilogueTuneStats before = cuda::epilogue_tune_stats();
          family_case(f, fresh_rows(), 64, 96, dt, seed += 10);
          if (f == Family::linear_gelu) nograd_gelu_case(fresh_rows(), 64, 96, dt, seed += 10);
          const cuda::EpilogueTuneStats after = cuda::epilogue_tune_stats();
          // Fresh shapes: the forward and the weight-gradient GEMMs made new plans of the kind
          // the switch asks for, and none of the other kind (bf16: every epilogue has an
          // algorithm; f32 ones may compose).
          if (dt != DType::bf16) continue;
          if (autotune) {
            EXPECT_GE(after.tuned_plans, before.tuned_plans + 2) << family_name(f);
            EXPECT_EQ(after.heuristic_plans, before.heuristic_plans) << family_name(f);
          } else {
            EXPECT_GE(after.heuristic_plans, before.heuristic_plans + 2) << family_name(f);
            EXPECT_EQ(after.tuned_plans, before.tuned_plans) << family_name(f);
            EXPECT_EQ(after.timed_candidates, before.timed_candidates) << family_name(f);
          }
          if (m == EpilogueBiasGrad::column_sum)
            EXPECT_GT(after.column_sum_plans, before.column_sum_plans) << family_name(f);
          if (m == EpilogueBiasGrad::epilogue || (m == EpilogueBiasGrad::automatic && !autotune))
            EXPECT_EQ(after.column_sum_plans, before.column_sum_plans) << family_name(f);
        }
      }
    }
  }
}

// The DiT-S widths (384 -> 1536 and the qkv's 1152) with odd row counts: many candidates are
// timed, and the tuned choice is right whichever wins.
TEST(EpiTune, DiTWidthsTunedMatchReference) {
  FLAME_SKIP_IF_NO_CUDA();
  const TuneScope scope(true, EpilogueBiasGrad::automatic);
  const cuda::EpilogueTuneStats before = cuda::epilogue_tune_stats();
  family_case(Family::mlp_gelu, fresh_rows(), 384, 1536, DType::bf16, 2001);
  family_case(Family::linear_bias, fresh_rows(), 384, 1152, DType::bf16, 2011);
  const cuda::EpilogueTuneStats after = cuda::epilogue_tune_stats();
  EXPECT_GT(after.timed_candidates, before.timed_candidates) << "no candidate was timed";
}

// The column-sum kernel's geometries: strips of 32, 16 and 8 packs and ragged ones, a single
// row, fewer rows than one row step, and many; bf16, f16 and f32.
TEST(EpiTune, ColumnSumBiasGradientShapes) {
  FLAME_SKIP_IF_NO_CUDA();
  const TuneScope scope(false, EpilogueBiasGrad::column_sum);
  uint64_t seed = 3000;
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    for (int64_t out : {8, 24, 40, 136, 384, 1152, 1536}) {
      for (int64_t rows : {int64_t(1), int64_t(3), int64_t(70), fresh_rows(), int64_t(4099) + 2 * out}) {
        const TensorList leaves{randn_f64({rows, 16}, seed), randn_f64({out, 16}, seed + 1, 0.25),
                                randn_f64({out}, seed + 2)};
        const Tensor v = randn_f64({rows, out}, seed + 3);
        seed += 10;
        const Outputs got = run_on([](const TensorList& t) { return F::linear(t[0], t[1], t[2]); },
                                   {rounded(leaves[0], dt), rounded(leaves[1], dt), rounded(leaves[2], dt)},
                                   rounded(v, dt), dt, Device::cuda(0));
        const Tensor want = rounded(v, dt).sum({0});
        EXPECT_TRUE(close_scaled(got.grads[2], want, tol_for(dt)))
            << "bias gradient, " << dtype_name(dt) << " rows " << rows << " out " << out;
      }
    }
  }
  EXPECT_GT(cuda::epilogue_tune_stats().column_sum_plans, 0u);
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs.
// ---------------------------------------------------------------------------------------------

struct Static {
  Tensor x, w, b, dy;
};
Static static_inputs(int64_t rows, int64_t in, int64_t out, DType dt, uint64_t seed) {
  const Device gpu = Device::cuda(0);
  return {randn_f64({rows, in}, seed).to(dt).to(gpu).requires_grad_(),
          randn_f64({out, in}, seed + 1, 1.0 / std::sqrt(double(in))).to(dt).to(gpu).requires_grad_(),
          randn_f64({out}, seed + 2, 0.5).to(dt).to(gpu).requires_grad_(),
          randn_f64({rows, out}, seed + 3).to(dt).to(gpu)};
}
struct StepResult {
  Tensor y, dx, dw, db;
};
StepResult gelu_step(const Static& s) {
  const Tensor y = F::linear_gelu(s.x, s.w, s.b);
  BackwardOptions o;
  o.grad_output = s.dy;
  Gradients g = y.backward(o);
  return {y.detach(), g.get(s.x), g.get(s.w), g.get(s.b)};
}
void expect_same_bits(const StepResult& a, const StepResult& b, const char* what) {
  EXPECT_EQ(a.y.to_vec<double>(), b.y.to_vec<double>()) << what << ": y";
  EXPECT_EQ(a.dx.to_vec<double>(), b.dx.to_vec<double>()) << what << ": dx";
  EXPECT_EQ(a.dw.to_vec<double>(), b.dw.to_vec<double>()) << what << ": dw";
  EXPECT_EQ(a.db.to_vec<double>(), b.db.to_vec<double>()) << what << ": db";
}

TEST(EpiTune, CaptureAfterTuningUsesTheCachedPlan) {
  FLAME_SKIP_IF_NO_CUDA();
  for (EpilogueBiasGrad m : {EpilogueBiasGrad::automatic, EpilogueBiasGrad::column_sum}) {
    const TuneScope scope(true, m);
    const Static s = static_inputs(fresh_rows(), 128, 256, DType::bf16, 4000);
    const cuda::EpilogueTuneStats t0 = cuda::epilogue_tune_stats();
    const StepResult eager = gelu_step(s);  // tunes the shape's plans
    const cuda::EpilogueTuneStats t1 = cuda::epilogue_tune_stats();
    EXPECT_GE(t1.tuned_plans, t0.tuned_plans + 2);
    cuda::Graph graph;
    StepResult captured;
    cuda::capture(graph, [&] { captured = gelu_step(s); });
    const cuda::EpilogueTuneStats t2 = cuda::epilogue_tune_stats();
    EXPECT_EQ(t2.tuned_plans, t1.tuned_plans) << "the capture made a new plan";
    EXPECT_EQ(t2.heuristic_plans, t1.heuristic_plans) << "the capture made a new plan";
    EXPECT_EQ(t2.timed_candidates, t1.timed_candidates) << "the capture timed candidates";
    graph.replay();
    expect_same_bits(captured, eager, "replay vs eager");
    graph.replay();
    expect_same_bits(captured, eager, "second replay vs eager");
  }
}

TEST(EpiTune, NewShapeUnderCaptureTakesHeuristicThenTunesEagerly) {
  FLAME_SKIP_IF_NO_CUDA();
  const TuneScope scope(true, EpilogueBiasGrad::automatic);
  const int64_t rows = fresh_rows(), in = 64, out = 128;
  const Static s = static_inputs(rows, in, out, DType::bf16, 5000);
  const cuda::EpilogueTuneStats t0 = cuda::epilogue_tune_stats();
  cuda::Graph graph;
  StepResult captured;
  cuda::capture(graph, [&] { captured = gelu_step(s); });
  const cuda::EpilogueTuneStats t1 = cuda::epilogue_tune_stats();
  EXPECT_GE(t1.heuristic_plans, t0.heuristic_plans + 2);
  EXPECT_EQ(t1.tuned_plans, t0.tuned_plans);
  EXPECT_EQ(t1.timed_candidates, t0.timed_candidates);
  graph.replay();
  // Against the f64 reference of the same (bf16) inputs.
  const Tensor x = s.x.detach().to(Device::cpu()).to(DType::f64).requires_grad_();
  const Tensor w = s.w.detach().to(Device::cpu()).to(DType::f64).requires_grad_();
  const Tensor b = s.b.detach().to(Device::cpu()).to(DType::f64).requires_grad_();
  const Tensor y = ref_gelu(x.matmul(w.t()) + b);
  BackwardOptions o;
  o.grad_output = s.dy.to(Device::cpu()).to(DType::f64);
  Gradients g = y.backward(o);
  const double tol = tol_for(DType::bf16);
  EXPECT_TRUE(close_scaled(captured.y.to(Device::cpu()), y.detach(), tol));
  EXPECT_TRUE(close_scaled(captured.dx.to(Device::cpu()), g.get(x), tol));
  EXPECT_TRUE(close_scaled(captured.dw.to(Device::cpu()), g.get(w), tol));
  EXPECT_TRUE(close_scaled(captured.db.to(Device::cpu()), g.get(b), tol));
  // Eager calls of the shape still tune (the capture's heuristic plan is not the tuned one).
  (void)gelu_step(s);
  EXPECT_GE(cuda::epilogue_tune_stats().tuned_plans, t1.tuned_plans + 2);
}

// ---------------------------------------------------------------------------------------------
// FLAME_EPI_AUTOTUNE=0, read at start-up.
//
// Note [Epilogue tune child]
// The switch reads the environment once, so the case re-runs this binary (/proc/self/exe) with
// FLAME_EPI_TUNE_CHILD=1 and FLAME_EPI_AUTOTUNE set or unset. A global test environment sees
// FLAME_EPI_TUNE_CHILD when RUN_ALL_TESTS starts, runs one linear+bias forward+backward on the
// GPU when there is one, prints
//   FLAME_EPI_TUNE_CHILD autotune=<0|1> tuned=<n> heuristic=<n> ok=<0|1>
// and exits before any test runs. The parent parses that line.
// ---------------------------------------------------------------------------------------------
constexpr const char* kChildEnv = "FLAME_EPI_TUNE_CHILD";

class EpiTuneChildEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (std::getenv(kChildEnv) == nullptr) return;
    const bool autotune = cuda::epilogue_autotune();  // the first read: the environment's
    int ok = 1;
    if (cuda_is_available()) {
      ok = 0;
      const int64_t rows = 333, in = 64, out = 72;
      const DType dt = DType::bf16;
      const Tensor x = rounded(randn_f64({rows, in}, 7), dt), w = rounded(randn_f64({out, in}, 8, 0.125), dt);
      const Tensor b = rounded(randn_f64({out}, 9), dt), v = rounded(randn_f64({rows, out}, 10), dt);
      const Device gpu = Device::cuda(0);
      const Tensor xg = x.to(dt).to(gpu), wg = w.to(dt).to(gpu).requires_grad_(),
                   bg = b.to(dt).to(gpu).requires_grad_();
      const Tensor y = F::linear(xg, wg, bg);
      BackwardOptions o;
      o.grad_output = v.to(dt).to(gpu);
      Gradients g = y.backward(o);
      const bool good = close_scaled(y.detach().to(Device::cpu()), x.matmul(w.t()) + b, tol_for(dt)) &&
                        close_scaled(g.get(wg).to(Device::cpu()), v.t().matmul(x), tol_for(dt)) &&
                        close_scaled(g.get(bg).to(Device::cpu()), v.sum({0}), tol_for(dt));
      ok = good ? 1 : 0;
    }
    const cuda::EpilogueTuneStats s = cuda::epilogue_tune_stats();
    std::printf("FLAME_EPI_TUNE_CHILD autotune=%d tuned=%llu heuristic=%llu ok=%d\n", autotune ? 1 : 0,
                static_cast<unsigned long long>(s.tuned_plans), static_cast<unsigned long long>(s.heuristic_plans),
                ok);
    std::fflush(stdout);
    std::_Exit(0);
  }
};
[[maybe_unused]] ::testing::Environment* const g_child_env =
    ::testing::AddGlobalTestEnvironment(new EpiTuneChildEnvironment);

struct ChildResult {
  bool found = false;
  int autotune = -1, ok = 0;
  unsigned long long tuned = 0, heuristic = 0;
  std::string output;
};

// env_setting: the child's FLAME_EPI_AUTOTUNE, or null to leave it unset.
ChildResult run_child(const char* env_setting) {
  ChildResult r;
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string cmd = "env -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX -u GTEST_SHARD_STATUS_FILE -u FLAME_EPI_AUTOTUNE ";
  if (env_setting != nullptr) cmd += std::string("FLAME_EPI_AUTOTUNE=") + env_setting + " ";
  // The filter must match a test, or RUN_ALL_TESTS sets up no environment.
  cmd += std::string(kChildEnv) + "=1 '" + exe + "' --gtest_filter=EpiTuneEnv.DisabledByEnvironment 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), pipe)) r.output += buf;
  ::pclose(pipe);
  const auto pos = r.output.find("FLAME_EPI_TUNE_CHILD autotune=");
  if (pos != std::string::npos)
    r.found = std::sscanf(r.output.c_str() + pos, "FLAME_EPI_TUNE_CHILD autotune=%d tuned=%llu heuristic=%llu ok=%d",
                          &r.autotune, &r.tuned, &r.heuristic, &r.ok) == 4;
  return r;
}

TEST(EpiTuneEnv, DisabledByEnvironment) {
  const ChildResult off = run_child("0");
  ASSERT_TRUE(off.found) << off.output;
  EXPECT_EQ(off.autotune, 0);
  EXPECT_EQ(off.ok, 1) << off.output;
  const ChildResult on = run_child(nullptr);
  ASSERT_TRUE(on.found) << on.output;
  EXPECT_EQ(on.autotune, 1);
  EXPECT_EQ(on.ok, 1) << on.output;
  if (cuda_is_available()) {
    // Off: the forward (BIAS) and backward (BGRADB) GEMMs took the heuristic's plans.
    EXPECT_EQ(off.tuned, 0u);
    EXPECT_GE(off.heuristic, 2u);
    EXPECT_GE(on.tuned, 2u);
    EXPECT_EQ(on.heuristic, 0u);
  }
}

}  // namespace
}  // namespace flame::test
