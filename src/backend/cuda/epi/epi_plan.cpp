// Plans of Linear's epilogue GEMMs: the plan cache, the heuristic's candidates, and the
// autotuning that times them (host code; the kernels and launchers are in linear_epilogue.cu,
// Note [Epilogue GEMM layouts] there).
//
// Note [Epilogue plans]
// Layouts and the chosen algorithm are cached per device, dtype, compute type, epilogue,
// transposes, sizes and leading dims (the rule in Note [Linear epilogues] fixes every pointer to
// 16-byte alignment, so alignment needs no key), plus the kind of plan (tuned or heuristic) and,
// for the bias-gradient epilogues, the cuda::EpilogueBiasGrad asked for. A shape the heuristic
// offers nothing for is cached as unsupported, so the question is asked once and the call returns
// false from then on (as it does when cuBLASLt answers NOT_SUPPORTED at launch, before running
// anything). The operation descriptor carries the bias and aux pointers, so it is made per call
// (host memory only, safe under graph capture) and never shared between threads. The workspace
// is matmul.cu's (Note [Matmul workspace]); under capture it comes from the graph's pool.
//
// Note [Epilogue autotuning]
// cuBLASLt's heuristic ranks algorithms by a model, and for the DiT's epilogue GEMMs its first
// answer is far from the best (the DGELU GEMM of the DiT-S MLP backward ran at a third of the
// plain GEMMs' rate). So, when cuda::epilogue_autotune() is on (default; FLAME_EPI_AUTOTUNE=0
// turns it off) a plan-cache miss outside graph capture asks the heuristic for up to 8
// algorithms and times each on the call's own operands: one warm-up run, then two rounds over all
// candidates of 3 timed runs between two CUDA events on the call's stream (a candidate keeps its
// faster round, so that a clock ramp early in the first round does not count against it), all
// queued back to back; then the host waits for the last event (the one host synchronisation of
// the path: once per new shape per process).
// Outputs (d, the aux written by GELU_AUX, the bias gradient) are overwritten by the real call
// that follows; inputs are only read. The fastest is cached under the tuned key and every later
// call of the shape runs it, so the choice is fixed within a process; timing noise may make
// another process or GPU choose differently (the results then differ in rounding only).
// A bias-gradient epilogue (BGRADB, DGELU_BGRAD) has a second kind of candidate: its twin without
// the bias gradient (DEFAULT, DGELU) followed by FLAME's column sum of the gradient (Note
// [Epilogue column sum] in column_sum.cu), timed together: cuBLASLt's BGRADB runs a separate
// reduction kernel after the GEMM (at ~1.7 TB/s on an H100 for the DiT's gradients), which a
// full-bandwidth column sum can beat; the timing decides per shape. Under capture no timing can run: the call takes a tuned plan made earlier
// (an eager warm-up step makes them), else the heuristic's first answer, cached under the
// heuristic key so that a later eager call of the shape still tunes. With autotuning off the
// heuristic's first answer of the key's own epilogue runs, as before autotuning existed
// (cuda::set_epilogue_bias_grad(column_sum) forces the column-sum kind either way).
#include "src/backend/cuda/epi/epi_plan.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "flame/cuda.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/epi/column_sum.h"
#include "src/backend/cuda/epi/lt_shared.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/backend/cuda/tune_timing.h"
#include "src/backend/epi_tune.h"

#define FLAME_EPI_CHECK(op, call)                                                                    \
  do {                                                                                               \
    cublasStatus_t flame_st_ = (call);                                                               \
    if (flame_st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      FLAME_FAIL(op, "cuBLASLt call ", #call, " failed: ", cublasLtGetStatusName(flame_st_), " (",  \
                 cublasLtGetStatusString(flame_st_), ") at ", __FILE__, ":", __LINE__);             \
  } while (0)

namespace flame::backend::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Epilogue GEMM plans (Note [Epilogue plans], Note [Epilogue autotuning]).
// ---------------------------------------------------------------------------------------------
constexpr int kPlanHeuristic = 0, kPlanTuned = 1;
constexpr int kCandidates = 8;  // algorithms asked of the heuristic per epilogue when tuning
constexpr int kTimedReps = 3;   // timed runs per candidate and round, after one warm-up run
constexpr int kRounds = 2;      // rounds over all candidates; each keeps its faster round

// How a plan runs: an algorithm of `epilogue` (the key's own, or for a column-sum plan the same
// epilogue without its bias gradient), then epi_column_sum for the bias gradient.
struct EpiChoice {
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
  int epilogue = 0;
  bool column_sum = false;
};
struct EpiPlan {
  bool supported = false;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  EpiChoice choice;
};

std::shared_mutex& epi_mutex() {
  static std::shared_mutex mu;
  return mu;
}
std::unordered_map<EpiKey, EpiPlan, EpiKeyHash>& epi_cache() {
  static auto* cache = new std::unordered_map<EpiKey, EpiPlan, EpiKeyHash>();  // never destroyed
  return *cache;
}
const EpiPlan* find_plan(const EpiKey& key) {
  std::shared_lock<std::shared_mutex> lock(epi_mutex());
  const auto it = epi_cache().find(key);
  return it == epi_cache().end() ? nullptr : &it->second;  // nodes never move or go
}

// The bias-gradient epilogue's twin without the bias gradient (a column-sum plan runs it); -1
// for the epilogues without one.
int without_bias_grad(int epilogue) {
  switch (epilogue) {
    case CUBLASLT_EPILOGUE_BGRADB: return CUBLASLT_EPILOGUE_DEFAULT;
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return CUBLASLT_EPILOGUE_DGELU;
    default: return -1;
  }
}

// A fresh operation descriptor for key's transposes with `epilogue` and the pointers bound (null
// ones are left unset); the caller destroys it.
cublasLtMatmulDesc_t make_desc(const EpiKey& key, int epilogue, const void* bias, const void* aux) {
  cublasLtMatmulDesc_t op = nullptr;
  FLAME_EPI_CHECK("linear",
                  lt_gemm_desc(&op, static_cast<cublasComputeType_t>(key.compute), CUDA_R_32F, key.ta, key.tb));
  const auto epi = static_cast<cublasLtEpilogue_t>(epilogue);
  cublasStatus_t st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (st == CUBLAS_STATUS_SUCCESS && bias != nullptr)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  if (st == CUBLAS_STATUS_SUCCESS && aux != nullptr) {
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &key.ld_aux, sizeof(key.ld_aux));
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulDescDestroy(op);
    FLAME_FAIL("linear", "cannot describe the epilogue GEMM (epilogue ", epilogue,
               "): ", cublasLtGetStatusName(st));
  }
  return op;
}

void destroy_layouts(EpiPlan& plan) { lt_destroy_layouts(plan.la, plan.lb, plan.lc); }

// Up to `want` algorithms the heuristic offers for plan's layouts with `epilogue`, best first.
std::vector<EpiChoice> heuristic_choices(const EpiKey& key, const EpiPlan& plan, int epilogue, bool column_sum,
                                         const EpiCall& c, int want) {
  std::vector<EpiChoice> out;
  cublasLtMatmulDesc_t op = make_desc(key, epilogue, column_sum ? nullptr : c.bias, c.aux);
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulDescDestroy(op);
    FLAME_EPI_CHECK("linear", st);
  }
  st = lt_set_preference(pref, kLtWorkspaceBytes, 16, 16, 16);  // every pointer 16-byte aligned (Note [Epilogue plans])
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(want));
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(shared_lt_handle(key.device), op, plan.la, plan.lb, plan.lc, plan.lc, pref,
                                        want, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(op);
  if (st != CUBLAS_STATUS_SUCCESS) return out;  // NOT_SUPPORTED: nothing for this epilogue/shape
  for (int i = 0; i < found && i < want; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[static_cast<std::size_t>(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > kLtWorkspaceBytes) continue;
    EpiChoice ch;
    ch.algo = r.algo;
    ch.workspace = r.workspaceSize;
    ch.epilogue = epilogue;
    ch.column_sum = column_sum;
    out.push_back(ch);
  }
  return out;
}

// Queues one run of the call with `ch` on be's stream: the GEMM, then the column sum of a
// column-sum plan. A status other than SUCCESS means nothing was queued (NOT_SUPPORTED: cuBLASLt
// refused before launching, or the shared workspace is too small).
cublasStatus_t launch_choice(CudaBackend& be, const EpiKey& key, const EpiPlan& plan, const EpiChoice& ch,
                             const EpiCall& c) {
  const cudaStream_t stream = be.stream();
  std::shared_ptr<void> captured_workspace;
  void* workspace = nullptr;
  if (ch.workspace > 0) {
    if (thread_is_capturing(be.device())) {  // Note [Matmul workspace]
      captured_workspace = be.allocate(ch.workspace);
      workspace = captured_workspace.get();
    } else {
      std::size_t have = 0;
      workspace = shared_lt_workspace(be.device(), stream, &have);
      if (have < ch.workspace) return CUBLAS_STATUS_NOT_SUPPORTED;
    }
  }
  cublasLtMatmulDesc_t op = make_desc(key, ch.epilogue, ch.column_sum ? nullptr : c.bias, c.aux);
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t st = cublasLtMatmul(shared_lt_handle(be.device()), op, &one, c.a, plan.la, c.b, plan.lb, &zero,
                                           c.d, plan.lc, c.d, plan.lc, &ch.algo, workspace, ch.workspace, stream);
  cublasLtMatmulDescDestroy(op);
  if (st == CUBLAS_STATUS_SUCCESS && ch.column_sum)
    epi_column_sum(be, static_cast<DType>(key.dtype), c.sum_src, c.sum_rows, c.sum_cols, const_cast<void*>(c.bias),
                   static_cast<DType>(key.out_dtype));
  return st;
}

std::string describe_choice(const EpiChoice& ch) {
  int id = -1, tile = -1, stages = -1;
  (void)cublasLtMatmulAlgoConfigGetAttribute(&ch.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), nullptr);
  (void)cublasLtMatmulAlgoConfigGetAttribute(&ch.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), nullptr);
  (void)cublasLtMatmulAlgoConfigGetAttribute(&ch.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages),
                                             nullptr);
  return "algo " + std::to_string(id) + " tile " + std::to_string(tile) + " stages " + std::to_string(stages) +
         " epilogue " + std::to_string(ch.epilogue) + (ch.column_sum ? " + column sum" : "") + ", workspace " +
         std::to_string(ch.workspace);
}

// Times every candidate on the call's own operands (Note [Epilogue autotuning]) and returns the
// fastest. All runs are queued first; the host then waits once, for the last event. Candidates
// cuBLASLt refuses are skipped; when it refuses all, the first is kept (the real call then
// refuses too, and the op composes).
EpiChoice tune_choices(CudaBackend& be, const EpiKey& key, const EpiPlan& plan, const std::vector<EpiChoice>& cands,
                       const EpiCall& c, bool verbose) {
  const cudaStream_t stream = be.stream();
  const std::size_t n = cands.size();
  // Event pair of candidate i in round q: [2 (q n + i)] before its timed runs, [... + 1] after.
  TimingEvents ev(2 * n * kRounds);
  auto at = [&](int q, std::size_t i) { return 2 * (static_cast<std::size_t>(q) * n + i); };
  std::vector<char> ok(n, 1);
  cudaEvent_t last = nullptr;
  for (int q = 0; q < kRounds; ++q) {
    for (std::size_t i = 0; i < n; ++i) {
      if (!ok[i]) continue;
      cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
      if (q == 0) st = launch_choice(be, key, plan, cands[i], c);  // warm-up
      if (st == CUBLAS_STATUS_SUCCESS) {
        FLAME_CUDA_CHECK(cudaEventRecord(ev[at(q, i)], stream));
        for (int r = 0; r < kTimedReps && st == CUBLAS_STATUS_SUCCESS; ++r)
          st = launch_choice(be, key, plan, cands[i], c);
        FLAME_CUDA_CHECK(cudaEventRecord(ev[at(q, i) + 1], stream));
        last = ev[at(q, i) + 1];
      }
      if (st != CUBLAS_STATUS_SUCCESS) {
        ok[i] = 0;
        if (verbose)
          std::fprintf(stderr, "flame: epilogue autotune: [%zu] %s refused (%s)\n", i,
                       describe_choice(cands[i]).c_str(), cublasLtGetStatusName(st));
      }
    }
  }
  if (last != nullptr) FLAME_CUDA_CHECK(cudaEventSynchronize(last));  // the one host wait
  if (verbose)
    std::fprintf(stderr, "flame: epilogue autotune: epilogue %d dtype %s m %llu n %llu k %llu, %zu candidates\n",
                 key.epilogue, dtype_name(static_cast<DType>(key.dtype)), static_cast<unsigned long long>(key.m),
                 static_cast<unsigned long long>(key.n), static_cast<unsigned long long>(key.k), n);
  std::size_t best = n;
  float best_ms = 0.0f;
  uint64_t timed = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!ok[i]) continue;
    float ms = 0.0f;  // the faster round: clock ramps and neighbours' noise only ever add time
    for (int q = 0; q < kRounds; ++q) {
      float t = 0.0f;
      FLAME_CUDA_CHECK(cudaEventElapsedTime(&t, ev[at(q, i)], ev[at(q, i) + 1]));
      ms = q == 0 ? t : std::min(ms, t);
    }
    ms /= static_cast<float>(kTimedReps);
    ++timed;
    if (verbose) std::fprintf(stderr, "  [%zu] %s: %.1f us\n", i, describe_choice(cands[i]).c_str(), ms * 1e3);
    if (best == n || ms < best_ms) {  // ties keep the heuristic's order
      best = i;
      best_ms = ms;
    }
  }
  epi_tune::count_timed(timed);
  if (best == n) best = 0;
  if (verbose) std::fprintf(stderr, "  chosen: [%zu]\n", best);
  return cands[best];
}

// The plan for the call (Note [Epilogue plans]): the tuned one when autotuning is on and it
// exists or can be made now (not capturing), else the heuristic's. Built and cached on a miss;
// unsupported when no algorithm fits.
const EpiPlan& get_epi_plan(CudaBackend& be, EpiKey key, cudaDataType_t type, const EpiCall& c) {
  const int level = epi_tune::level();
  const int twin = without_bias_grad(key.epilogue);
  const auto mode = twin >= 0 ? flame::cuda::epilogue_bias_grad() : flame::cuda::EpilogueBiasGrad::automatic;
  key.bias_grad = static_cast<int>(mode);
  key.plan = level > 0 ? kPlanTuned : kPlanHeuristic;
  if (const EpiPlan* hit = find_plan(key)) return *hit;
  if (key.plan == kPlanTuned && capturing_now(be)) {  // no timing under capture: the heuristic's plan
    key.plan = kPlanHeuristic;
    if (const EpiPlan* hit = find_plan(key)) return *hit;
  }
  const bool tuned = key.plan == kPlanTuned;
  EpiPlan plan;
  const LtGemmShape shape{key.ta, key.tb, key.m, key.n, key.k, key.lda, key.ldb, key.ldc};
  FLAME_EPI_CHECK("linear", lt_gemm_layouts(type, shape, plan.la, plan.lb, plan.lc,
                                            types_of(static_cast<DType>(key.out_dtype)).type));
  const int want = tuned ? kCandidates : 1;
  std::vector<EpiChoice> cands;
  if (twin < 0 || mode != flame::cuda::EpilogueBiasGrad::column_sum)
    cands = heuristic_choices(key, plan, key.epilogue, false, c, want);
  const bool sum_ok = twin >= 0 && c.sum_src != nullptr &&
                      epi_column_sum_fits(static_cast<DType>(key.dtype), c.sum_src, c.sum_cols, c.bias,
                                          static_cast<DType>(key.out_dtype));
  if (sum_ok && (mode == flame::cuda::EpilogueBiasGrad::column_sum ||
                 (mode == flame::cuda::EpilogueBiasGrad::automatic && tuned))) {
    const std::vector<EpiChoice> more = heuristic_choices(key, plan, twin, true, c, want);
    cands.insert(cands.end(), more.begin(), more.end());
  }
  if (cands.empty()) {
    destroy_layouts(plan);  // cached as unsupported: the op layer composes this shape
  } else {
    plan.supported = true;
    plan.choice = tuned && cands.size() > 1 ? tune_choices(be, key, plan, cands, c, level >= 2) : cands.front();
  }
  std::unique_lock<std::shared_mutex> lock(epi_mutex());
  const auto [it, inserted] = epi_cache().emplace(key, plan);
  if (!inserted) destroy_layouts(plan);  // another thread built it meanwhile: keep theirs
  else if (plan.supported) epi_tune::count_plan(tuned, plan.choice.column_sum);
  return it->second;
}

}  // namespace

Types types_of(DType dt) {
  switch (dt) {
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case DType::f16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
    default:
      return {CUDA_R_32F, flame::cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
  }
}

bool run_epi(CudaBackend& be, const EpiKey& key, cudaDataType_t type, const EpiCall& c) {
  const EpiPlan& plan = get_epi_plan(be, key, type, c);
  if (!plan.supported) return false;
  const cublasStatus_t st = launch_choice(be, key, plan, plan.choice, c);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;  // refused before launching: compose instead
  FLAME_EPI_CHECK("linear", st);
  if (launch_blocking())
    lt_sync_if_blocking(be.stream(), "linear",
                        "cuBLASLt epilogue GEMM (epilogue " + std::to_string(key.epilogue) + ") m=" +
                            std::to_string(key.m) + " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k));
  return true;
}

}  // namespace flame::backend::cuda
