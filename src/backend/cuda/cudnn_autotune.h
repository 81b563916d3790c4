#pragma once
// Note [cuDNN autotuning]
// cuDNN's heuristic (mode A) ranks a graph's engine configurations without running them, and its
// first choice is not always the fastest on this GPU for this problem. With autotuning on
// (flame::cuda::set_cudnn_autotune, FLAME_CUDNN_AUTOTUNE=1; off by default, as PyTorch's
// cudnn.benchmark, since the heuristic's pick measured fastest for nearly every problem the
// benchmarks run: docs/nn-conv.md has the figures), a plan cache entry also
// builds the heuristic's next configurations, up to kCandidates in all, and the first execution
// outside a CUDA graph capture times each one that builds (a warm-up run, then kTimedRuns runs
// between CUDA events on the call's stream, their median) on the call's own operands. The fastest
// runs from then on, unless it beats the heuristic's choice by less than kMinGain (timing noise
// on a power-capped GPU is a few percent, and the heuristic's pick is the better-known quantity).
// Convolution (fprop, dgrad, wgrad) and SDPA (forward, backward) only write their outputs and
// workspace, so the extra runs change nothing but time. A candidate whose workspace exceeds
// kMaxWorkspace is skipped. The timing waits for the GPU once per problem; under capture the
// heuristic's plan runs until an eager call tunes it. The switch is read when a problem's plan is
// made: a problem first seen with autotuning off keeps the heuristic's plan for the process, and
// one made with it on is tuned at its first eager call even if the switch changed in between.
// Included after cudnn_frontend.h.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "src/backend/cuda/tune_timing.h"
#include "src/backend/cudnn_tune.h"

namespace flame::backend::cuda::cudnn_autotune {

constexpr int64_t kCandidates = 8;
constexpr int kTimedRuns = 3;
constexpr double kMinGain = 0.03;
constexpr int64_t kMaxWorkspace = int64_t{1} << 30;

// Per cached plan: the plan that executes, the candidates built for timing, and whether they were.
struct State {
  std::vector<int64_t> candidates;  // plan indices that built, heuristic order
  bool done = true;                 // nothing (left) to time
  int64_t index = -1;               // plan to execute; -1: the graph's own choice (Graph::execute)
  int64_t workspace = 0;            // bytes the executing plan needs
};

inline bool enabled() { return cudnn_tune::level() > 0; }

// After build_plans(HEURISTICS_CHOICE): the heuristic's plan and its workspace execute; with
// autotuning on, also builds configurations 0..kCandidates-1 (the one already built is kept) and
// records which built. Nothing to tune when fewer than two did.
template <class Graph>
State plan_state(Graph& g, int64_t heuristic_workspace) {
  State st;
  st.workspace = heuristic_workspace;
  if (!enabled()) return st;
  const int64_t n = std::min<int64_t>(g.get_execution_plan_count(), kCandidates);
  for (int64_t i = 0; i < n; ++i)
    if (g.build_plan_at_index(i).is_good()) st.candidates.push_back(i);
  st.done = st.candidates.size() < 2;
  return st;
}

// Times st.candidates on the call's operands (outside capture only) and fills st.index and
// st.workspace with the choice. `what` names the problem in verbose output.
template <class Graph>
void tune(State& st, Graph& g, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack, CudaBackend& be,
          const std::string& what) {
  if (st.done || capturing_now(be)) return;
  st.done = true;
  const cudaStream_t stream = be.stream();
  TimingEvents ev(kTimedRuns + 1);
  std::vector<std::pair<int64_t, double>> timed;  // (index, median ms)
  std::string report;
  for (int64_t idx : st.candidates) {
    int64_t ws = 0;
    if (g.get_workspace_size_plan_at_index(idx, ws).is_bad() || ws > kMaxWorkspace) continue;
    std::shared_ptr<void> buf = ws > 0 ? be.allocate(static_cast<std::size_t>(ws)) : nullptr;
    if (g.execute_plan_at_index(handle, pack, buf.get(), idx).is_bad()) continue;  // warm-up
    bool ok = cudaEventRecord(ev[0], stream) == cudaSuccess;
    for (int r = 0; ok && r < kTimedRuns; ++r)
      ok = g.execute_plan_at_index(handle, pack, buf.get(), idx).is_good() &&
           cudaEventRecord(ev[r + 1], stream) == cudaSuccess;
    if (!ok || cudaEventSynchronize(ev[kTimedRuns]) != cudaSuccess) continue;
    std::vector<float> ms(kTimedRuns);
    for (int r = 0; r < kTimedRuns; ++r) (void)cudaEventElapsedTime(&ms[r], ev[r], ev[r + 1]);
    std::nth_element(ms.begin(), ms.begin() + kTimedRuns / 2, ms.end());
    timed.emplace_back(idx, ms[kTimedRuns / 2]);
    if (cudnn_tune::level() > 1) {
      std::string name;
      (void)g.get_plan_name_at_index(idx, name);
      report += "  " + std::to_string(idx) + " " + name + ": " + std::to_string(ms[kTimedRuns / 2]) + " ms\n";
    }
  }
  (void)cudaGetLastError();  // a candidate that failed to launch leaves nothing behind
  if (timed.empty()) return;
  auto best = std::min_element(timed.begin(), timed.end(), [](auto& a, auto& b) { return a.second < b.second; });
  // The heuristic's own plan (the first candidate that built) keeps its place unless clearly
  // beaten; when it could not be timed, the fastest timed one runs.
  if (timed.front().first == st.candidates.front() && best->first != timed.front().first &&
      best->second > timed.front().second * (1.0 - kMinGain))
    best = timed.begin();
  st.index = best->first;
  (void)g.get_workspace_size_plan_at_index(st.index, st.workspace);
  cudnn_tune::count_tuned(timed.size());
  if (cudnn_tune::level() > 1)
    std::fprintf(stderr, "flame: cuDNN autotune %s: %zu candidates timed, running %lld\n%s", what.c_str(),
                 timed.size(), static_cast<long long>(st.index), report.c_str());
}

// One execution: tunes first when due (`describe()` names the problem in verbose output), then
// runs the chosen plan (the graph's own while untuned) with its workspace from be's pool, freed
// in stream order after the call.
template <class Graph, class Describe>
auto execute(State& st, Graph& g, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack, CudaBackend& be,
             Describe&& describe) {
  if (!st.done) tune(st, g, handle, pack, be, describe());
  std::shared_ptr<void> ws;
  if (st.workspace > 0) ws = be.allocate(static_cast<std::size_t>(st.workspace));
  return st.index < 0 ? g.execute(handle, pack, ws.get()) : g.execute_plan_at_index(handle, pack, ws.get(), st.index);
}

}  // namespace flame::backend::cuda::cudnn_autotune
