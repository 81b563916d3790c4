// flame::cuda::Graph: capture a sequence of FLAME ops into a CUDA graph and replay it.
//
// Note [Graph capture]
// capture_begin takes a recycled side stream (Note [Recycled streams]), makes it the calling
// thread's current stream for the device (so every op of the thread on that device is queued
// there) and calls cudaStreamBeginCapture in thread-local mode: other threads keep running eager
// work, while this thread may not call anything that would synchronise. Three things keep the
// captured ops valid on replay:
//  - Memory (Note [Graph-private pool], memory_pool.cu). Blocks allocated during the capture come
//    from the graph's private pool and keep their addresses as long as the graph lives; shared
//    blocks freed during the capture are retained by the graph, since replays read them.
//  - Host reads and waits raise before reaching CUDA (check_not_capturing): copy_to_host,
//    copy_from_host, masked_select, synchronize, Stream/Event::synchronize, empty_cache. The
//    message names the op and says a graph is being captured.
//  - Random numbers (Note [Graph-safe RNG], src/backend/graph_rng.h): captured draws read their seed
//    and offset from a device-resident pair per generator, which replay() refills first.
// replay() launches the executable graph on the current stream, after a wait on the previous
// replay's event if that ran on another stream (the Philox pairs and private blocks are shared by
// all replays) and after the host prologues the capture registered (GraphRng::add_replay_hook:
// kept weight copies brought up to date with eager edits); the epilogues run after the launch
// (a captured optimizer step advancing its parameters' versions). The destructor waits for the last replay before freeing the pool.
#include <algorithm>
#include <mutex>
#include <optional>
#include <vector>

#include "flame/cuda.h"
#include "flame/random.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/backend/graph_rng.h"

namespace flame::cuda {

namespace bc = ::flame::backend::cuda;

namespace {

constexpr int kMaxGraphGenerators = 16;

struct PhiloxPairs {
  uint64_t v[2 * kMaxGraphGenerators];  // (seed, first offset) per generator
};

// Kernel arguments are copied at launch, so the host needs no buffer that outlives the call.
__global__ void write_philox_pairs_kernel(uint64_t* dst, PhiloxPairs pairs, int n) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < 2 * n) dst[i] = pairs.v[i];
}

}  // namespace

struct Graph::Impl final : random_detail::GraphRng {
  struct GeneratorSlot {
    Generator* generator;
    uint64_t start;  // the generator's offset at its first draw in the capture
    uint64_t drawn;  // offsets one replay consumes
  };

  std::mutex mutex;  // serialises capture_end / replay / reset of one graph
  int device_ = -1;
  bool capturing = false;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::shared_ptr<bc::GraphPool> pool;
  std::optional<Stream> capture_stream;
  std::optional<StreamGuard> guard;
  random_detail::GraphRng* previous_rng = nullptr;
  uint64_t* philox = nullptr;  // device: 2 * kMaxGraphGenerators words
  std::vector<GeneratorSlot> generators;
  // Host hooks (GraphRng::add_replay_hook) run before / after each replay's launch.
  std::vector<std::pair<const void*, std::function<void()>>> prologues, epilogues;
  cudaEvent_t last_replay = nullptr;
  cudaStream_t last_replay_stream = nullptr;

  int device() const override { return device_; }

  void random(backend::RandomKind kind, const Tensor& dst, Generator& g, double a, double b) override {
    const uint64_t offset = g.next_offset();
    auto it = std::find_if(generators.begin(), generators.end(),
                           [&](const GeneratorSlot& s) { return s.generator == &g; });
    if (it == generators.end()) {
      FLAME_CHECK(generators.size() < kMaxGraphGenerators, "cuda::Graph",
                  "a captured graph may draw from at most ", kMaxGraphGenerators, " generators");
      generators.push_back({&g, offset, 0});
      it = generators.end() - 1;
    }
    const std::size_t slot = static_cast<std::size_t>(it - generators.begin());
    bc::cuda_backend(device_).random_from_device_state(kind, dst, philox + 2 * slot, offset - it->start, a, b);
  }

  void add_replay_hook(When when, const void* key, std::function<void()> fn) override {
    auto& hooks = when == When::before ? prologues : epilogues;
    for (const auto& h : hooks)
      if (h.first == key) return;
    hooks.emplace_back(key, std::move(fn));
  }

  // Ends the thread's capture state (stream, pool routing, RNG hook) and rewinds the generators.
  void leave_capture() noexcept {
    random_detail::current_graph_rng() = previous_rng;
    guard.reset();
    try {
      bc::cuda_backend(device_).pool().end_capture(pool);
    } catch (...) {
    }
    for (GeneratorSlot& s : generators) {
      s.drawn = s.generator->offset() - s.start;
      s.generator->set_state({s.generator->seed(), s.start});  // the capture ran nothing
    }
    capturing = false;
  }

  void abort_capture() noexcept {
    if (!capturing) return;
    cudaGraph_t g = nullptr;
    (void)cudaStreamEndCapture(static_cast<cudaStream_t>(capture_stream->handle()), &g);
    if (g != nullptr) (void)cudaGraphDestroy(g);
    (void)cudaGetLastError();
    leave_capture();
  }

  void destroy() noexcept {
    if (device_ < 0) return;
    abort_capture();
    int previous = -1;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) (void)cudaSetDevice(device_);
    if (last_replay != nullptr) {
      (void)cudaEventSynchronize(last_replay);  // replays use the pool and the Philox pairs
      (void)cudaEventDestroy(last_replay);
      last_replay = nullptr;
    }
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
    if (pool) {
      try {
        bc::cuda_backend(device_).pool().release_graph_pool(pool);
      } catch (...) {
      }
      pool.reset();
    }
    if (philox != nullptr) (void)cudaFree(philox);
    philox = nullptr;
    generators.clear();
    prologues.clear();
    epilogues.clear();
    capture_stream.reset();
    last_replay_stream = nullptr;
    (void)cudaGetLastError();
    if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
    device_ = -1;
  }

  ~Impl() override { destroy(); }
};

Graph::Graph() : impl_(std::make_shared<Impl>()) {}
Graph::~Graph() { impl_->destroy(); }

bool Graph::captured() const { return impl_->exec != nullptr; }

uint64_t Graph::random_offsets_per_replay() const {
  uint64_t n = 0;
  for (const auto& s : impl_->generators) n += s.drawn;
  return n;
}

void Graph::capture_begin(int device) {
  Impl& g = *impl_;
  std::lock_guard<std::mutex> lock(g.mutex);
  FLAME_CHECK(!g.capturing && g.exec == nullptr, "cuda::Graph::capture_begin",
              "the graph already holds a capture; reset() it first");
  bc::CudaBackend& be = bc::cuda_backend(device);
  FLAME_CHECK(!bc::thread_is_capturing(device), "cuda::Graph::capture_begin",
              "this thread is already capturing a graph on cuda:", device);
  FLAME_CHECK(random_detail::current_graph_rng() == nullptr, "cuda::Graph::capture_begin",
              "this thread is already capturing a graph");
  bc::DeviceGuard dguard(device);
  bc::prepare_capture(device);  // library handles and workspaces are created outside the capture
  g.device_ = device;
  if (g.philox == nullptr) {
    FLAME_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&g.philox), sizeof(PhiloxPairs)));
  }
  if (g.last_replay == nullptr) FLAME_CUDA_CHECK(cudaEventCreateWithFlags(&g.last_replay, cudaEventDisableTiming));
  g.capture_stream = Stream::create(device);
  g.pool = std::make_shared<bc::GraphPool>();
  g.generators.clear();
  g.prologues.clear();
  g.epilogues.clear();
  be.pool().begin_capture(g.pool);
  g.guard.emplace(*g.capture_stream);
  g.previous_rng = random_detail::current_graph_rng();
  random_detail::current_graph_rng() = &g;
  g.capturing = true;
  const cudaError_t err =
      cudaStreamBeginCapture(static_cast<cudaStream_t>(g.capture_stream->handle()), cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    g.leave_capture();
    be.pool().release_graph_pool(g.pool);
    g.pool.reset();
    bc::raise_cuda_error(err, "cudaStreamBeginCapture", __FILE__, __LINE__);
  }
}

void Graph::capture_end() {
  Impl& g = *impl_;
  std::lock_guard<std::mutex> lock(g.mutex);
  FLAME_CHECK(g.capturing, "cuda::Graph::capture_end", "no capture in progress (call capture_begin first)");
  FLAME_CHECK(bc::thread_is_capturing(g.device_), "cuda::Graph::capture_end",
              "capture_end must be called on the thread that called capture_begin");
  bc::DeviceGuard dguard(g.device_);
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(static_cast<cudaStream_t>(g.capture_stream->handle()), &graph);
  g.leave_capture();
  if (err != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    g.destroy();
    FLAME_FAIL("cuda::Graph::capture_end", "the capture failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
               " (a call that is not allowed during capture was made on the capturing stream)");
  }
  g.graph = graph;
  const cudaError_t ierr = cudaGraphInstantiateWithFlags(&g.exec, graph, 0);
  if (ierr != cudaSuccess) {
    (void)cudaGetLastError();
    g.exec = nullptr;
    g.destroy();
    bc::raise_cuda_error(ierr, "cudaGraphInstantiateWithFlags", __FILE__, __LINE__);
  }
}

void Graph::replay() {
  Impl& g = *impl_;
  std::lock_guard<std::mutex> lock(g.mutex);
  FLAME_CHECK(g.exec != nullptr, "cuda::Graph::replay", g.capturing ? "the capture has not ended" : "nothing captured");
  FLAME_CHECK(!bc::thread_is_capturing(g.device_), "cuda::Graph::replay",
              "cannot replay a graph while a CUDA graph is being captured on this thread");
  bc::CudaBackend& be = bc::cuda_backend(g.device_);
  bc::DeviceGuard dguard(g.device_);
  const cudaStream_t s = be.stream();
  if (g.last_replay_stream != nullptr && g.last_replay_stream != s) {
    FLAME_CUDA_CHECK(cudaStreamWaitEvent(s, g.last_replay, 0));
  }
  for (const auto& p : g.prologues) p.second();
  if (!g.generators.empty()) {
    // Note [Graph-safe RNG]: reserve this replay's offsets now, in host order.
    PhiloxPairs pairs{};
    for (std::size_t i = 0; i < g.generators.size(); ++i) {
      Generator& gen = *g.generators[i].generator;
      pairs.v[2 * i] = gen.seed();
      pairs.v[2 * i + 1] = gen.next_offset(g.generators[i].drawn);
    }
    write_philox_pairs_kernel<<<1, 2 * kMaxGraphGenerators, 0, s>>>(g.philox, pairs,
                                                                     static_cast<int>(g.generators.size()));
    FLAME_CUDA_CHECK_LAUNCH();
  }
  FLAME_CUDA_CHECK(cudaGraphLaunch(g.exec, s));
  if (bc::launch_blocking()) FLAME_CUDA_CHECK(cudaStreamSynchronize(s));
  FLAME_CUDA_CHECK(cudaEventRecord(g.last_replay, s));
  g.last_replay_stream = s;
  for (const auto& h : g.epilogues) h.second();
}

void Graph::reset() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->destroy();
}

void capture(Graph& graph, const std::function<void()>& fn, int device) {
  graph.capture_begin(device);
  try {
    fn();
  } catch (...) {
    graph.reset();  // aborts the capture and frees what it allocated
    throw;
  }
  graph.capture_end();
}

}  // namespace flame::cuda
