// The "nccl" process group: collectives on CUDA tensors through NCCL (one GPU per process).
//
// Note [NCCL streams]
// Collectives run on one communication stream per group (high priority). Each call records an
// event on the caller's current stream and makes the communication stream wait for it, so the
// collective sees everything queued before it; the tensors are record_stream'ed on the
// communication stream, so the pool does not reuse their memory early; Work::wait() makes the
// current stream wait for the collective's event (the host does not wait). Nothing here
// synchronises the host on the hot path.
//
// Note [NCCL failures]
// The communicator is non-blocking (ncclConfig_t::blocking = 0): no NCCL call can block the host
// indefinitely, initialisation included (bounded by the timeout). A watchdog thread polls the
// pending collectives' events and ncclCommGetAsyncError. A collective that has not finished
// within the timeout, or an asynchronous NCCL error, aborts the communicator (ncclCommAbort,
// which also stops the kernels waiting for a dead peer); the error names the dead ranks the
// store knows of. Later calls raise it. The rank then exits with status 1 after a short grace
// (FLAME_DIST_EXIT_ON_FAILURE=0 keeps it alive), because a training loop blocked elsewhere (in a
// synchronising read waiting for the collective) may never call into the group again: never a
// silent hang. The report and the exit timer come before ncclCommAbort, which may itself wait.
//
// Note [Collectives in CUDA graphs]
// A collective called while the current stream is being captured (cuda::Graph, GraphedStep) is
// recorded, not run: the fork (the communication stream waits on an event of the capturing
// stream) and NCCL's kernels become part of the graph, and Work::wait() joins the communication
// stream back into the capture, as every captured Work must be before the capture ends. NCCL
// supports capture once the communicator is connected, which the eager warm-up steps do. What a
// captured call skips: the watchdog entry (its event belongs to the graph and cannot be queried
// from the host) and record_stream (the graph holds no allocations of the caller: its tensors
// must outlive the graph, like every tensor a graph reads). The watchdog therefore cannot see the
// collectives of a replay; ProcessGroup::watch() after each replay puts an event behind the
// replay on the watch list, so a dead or hung peer still fails the group within the timeout. As
// for eager collectives, the clock starts when the host queues the work, not when the GPU reaches
// it, so a host running far ahead of the GPU spends some of the timeout in the queue. barrier()
// raises during a capture; Work::is_completed() raises for a captured Work.
#include "src/core/tensor_impl.h"
#include "src/dist/internal.h"

#if defined(FLAME_WITH_NCCL)

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <optional>
#include <thread>

#include "flame/cuda.h"

namespace flame::dist {

namespace {

using Clock = std::chrono::steady_clock;
namespace fc = flame::cuda;

ncclDataType_t nccl_dtype(DType dt, const char* what) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8:
    case DType::boolean: return ncclUint8;
    default: break;  // 8-bit floats: cast first (Note [Float8 dtypes])
  }
  FLAME_FAIL(what, "unsupported dtype ", dtype_name(dt));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

struct Pending {
  uint64_t seq;
  std::string name;
  std::shared_ptr<fc::Event> done;
  Clock::time_point start;
};

// What the group, its works and its watchdog share.
struct Core {
  int rank = 0;
  int device = 0;
  Duration timeout{};
  std::shared_ptr<TCPStore> store;
  ncclComm_t comm = nullptr;
  std::mutex mu;  // comm calls, pending, error
  std::list<Pending> pending;
  std::string error;
  std::atomic<bool> failed{false};
  std::atomic<bool> stopping{false};
  uint64_t seq = 0;

  std::string snapshot_error() {
    std::lock_guard<std::mutex> lk(mu);
    return error;
  }

  // Waits for a non-blocking NCCL call to leave ncclInProgress (caller holds mu).
  ncclResult_t settle(ncclResult_t r, Clock::time_point deadline) {
    while (r == ncclInProgress) {
      if (Clock::now() > deadline) return ncclInProgress;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
    }
    return r;
  }

  // Records the failure, reports it, arms the exit timer (exit_on_failure), then aborts the
  // communicator: the report and the exit do not depend on ncclCommAbort returning.
  void fail(const std::string& what, bool exit_on_failure) {
    std::string msg = "rank " + std::to_string(rank) + ": " + what;
    const std::string dead = describe_dead_ranks(*store);
    if (!dead.empty()) msg += " (the store reports " + dead + " dead)";
    {
      std::lock_guard<std::mutex> lk(mu);
      if (failed.load()) return;
      error = msg;
      failed = true;
    }
    std::fprintf(stderr, "[flame.dist] %s; aborting the NCCL communicator\n", msg.c_str());
    std::fflush(stderr);
    if (exit_on_failure) {
      const int r = rank;
      std::thread([r] {
        std::this_thread::sleep_for(std::chrono::seconds(3));
        std::fprintf(stderr, "[flame.dist] rank %d exits after the failure above\n", r);
        std::fflush(stderr);
        std::_Exit(1);
      }).detach();
    }
    std::lock_guard<std::mutex> lk(mu);
    if (comm) {
      ncclCommAbort(comm);
      comm = nullptr;
    }
  }
};

struct NcclWork final : Work::State {
  std::shared_ptr<Core> core;
  std::shared_ptr<fc::Event> done;
  bool captured = false;  // recorded into a CUDA graph (Note [Collectives in CUDA graphs])
  void wait() override {
    if (core->failed.load()) FLAME_FAIL("dist", core->snapshot_error());
    fc::Stream::current(core->device).wait(*done);
  }
  bool completed() const override {
    FLAME_CHECK(!captured, "dist::Work::is_completed", "the collective was captured into a CUDA graph: it runs at "
                "each replay and has no completion to query; wait() orders the stream after it");
    return core->failed.load() || done->query();
  }
  // The host waits (barrier), bounded by the watchdog's timeout.
  void host_wait() {
    while (!done->query()) {
      if (core->failed.load()) FLAME_FAIL("dist", core->snapshot_error());
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (core->failed.load()) FLAME_FAIL("dist", core->snapshot_error());
  }
};

void watchdog(std::shared_ptr<Core> core) {
  cudaSetDevice(core->device);
  const char* e = std::getenv("FLAME_DIST_EXIT_ON_FAILURE");
  const bool exit_on_failure = !(e && std::string(e) == "0");
  while (!core->stopping.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (core->failed.load()) continue;
    std::string problem;
    {
      std::lock_guard<std::mutex> lk(core->mu);
      if (!core->comm) continue;
      for (auto it = core->pending.begin(); it != core->pending.end();) {
        bool finished = false;
        try {
          finished = it->done->query();
        } catch (const std::exception& ex) {
          problem = "CUDA error while waiting for " + it->name + " #" + std::to_string(it->seq) + ": " +
                    ex.what();
          break;
        }
        if (finished) {
          it = core->pending.erase(it);
        } else {
          if (Clock::now() - it->start > core->timeout)
            problem = it->name + " #" + std::to_string(it->seq) + " did not finish within " +
                      std::to_string(core->timeout.count()) + " ms (a peer died, hung or called another collective)";
          break;  // later collectives queue behind this one
        }
      }
      ncclResult_t async = ncclSuccess;
      if (problem.empty() && ncclCommGetAsyncError(core->comm, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress)
        problem = std::string("NCCL asynchronous error: ") + ncclGetErrorString(async) + " (" +
                  ncclGetLastError(core->comm) + ")";
    }
    if (!problem.empty()) core->fail(problem, exit_on_failure);
  }
}

class NcclGroup final : public ProcessGroup {
 public:
  NcclGroup(std::shared_ptr<TCPStore> store, int rank, int world, int local_rank, Duration timeout)
      : core_(std::make_shared<Core>()) {
    store_ = store;
    rank_ = rank;
    size_ = world;
    const int count = cuda_device_count();
    FLAME_CHECK(count > 0, "dist::init_process_group", "backend \"nccl\" needs a CUDA device; none is visible on rank ",
                rank);
    core_->rank = rank;
    core_->device = local_rank % count;
    core_->timeout = timeout;
    core_->store = store;
    cudaSetDevice(core_->device);
    const std::string gen = std::to_string(store_->add("dist/nccl/generation/" + std::to_string(rank), 1));
    ncclUniqueId id;
    if (rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      FLAME_CHECK(r == ncclSuccess, "dist::init_process_group", "ncclGetUniqueId: ", ncclGetErrorString(r));
      store_->set("dist/nccl/id/" + gen, std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      const std::string s = store_->get("dist/nccl/id/" + gen);
      FLAME_CHECK(s.size() == sizeof id, "dist::init_process_group", "bad NCCL id in the store");
      std::memcpy(&id, s.data(), sizeof id);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      ncclResult_t r = ncclCommInitRankConfig(&core_->comm, world, id, rank, &config);
      r = core_->settle(r, Clock::now() + timeout);
      if (r != ncclSuccess) {
        const std::string dead = describe_dead_ranks(*store_);
        if (core_->comm) ncclCommAbort(core_->comm);
        core_->comm = nullptr;
        FLAME_FAIL("dist::init_process_group", "rank ", rank, ": NCCL communicator of ", world, " ranks on cuda:",
                   core_->device, " failed: ",
                   r == ncclInProgress ? std::string("not every rank joined within the timeout")
                                       : std::string(ncclGetErrorString(r)),
                   dead.empty() ? "" : " (the store reports " + dead + " dead)");
      }
    }
    comm_stream_.emplace(fc::Stream::create(core_->device, -1));
    watchdog_ = std::thread(watchdog, core_);
  }

  ~NcclGroup() override {
    core_->stopping = true;
    watchdog_.join();
    std::lock_guard<std::mutex> lk(core_->mu);
    if (!core_->comm) return;
    // Let queued collectives finish (bounded), then finalize; abort when that does not work.
    const auto deadline = Clock::now() + std::min<Duration>(core_->timeout, std::chrono::seconds(30));
    bool ok = true;
    for (auto& p : core_->pending) {
      while (ok && !p.done->query()) {
        if (Clock::now() > deadline) ok = false;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    if (ok) ok = core_->settle(ncclCommFinalize(core_->comm), deadline) == ncclSuccess;
    if (ok) ncclCommDestroy(core_->comm);
    else ncclCommAbort(core_->comm);
    core_->comm = nullptr;
  }

  std::string backend() const override { return "nccl"; }
  Device device() const override { return Device::cuda(core_->device); }

  Work all_reduce(Tensor& t, ReduceOp op, bool async) override {
    check_tensor(t, "dist::all_reduce");
    const ncclDataType_t dt = nccl_dtype(t.dtype(), "dist::all_reduce");
    FLAME_CHECK(op != ReduceOp::avg || is_floating(t.dtype()), "dist::all_reduce",
                "ReduceOp::avg needs a floating tensor, got ", dtype_name(t.dtype()));
    void* p = t.data_ptr();
    const std::size_t n = static_cast<std::size_t>(t.numel());
    bump_version(t);  // written in place (Note [Collectives write in place] in internal.h)
    return enqueue("all_reduce", {t}, async, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(p, p, n, dt, nccl_op(op), c, s);
    });
  }

  Work reduce_scatter(Tensor& output, const Tensor& input, ReduceOp op, bool async) override {
    check_tensor(output, "dist::reduce_scatter");
    check_tensor(input, "dist::reduce_scatter");
    FLAME_CHECK(input.numel() == output.numel() * size_ && input.dtype() == output.dtype(), "dist::reduce_scatter",
                "input of ", input.numel(), " ", dtype_name(input.dtype()), " elements must be world size (", size_,
                ") times the output's ", output.numel(), " ", dtype_name(output.dtype()));
    const ncclDataType_t dt = nccl_dtype(input.dtype(), "dist::reduce_scatter");
    const void* in = input.data_ptr();
    void* out = output.data_ptr();
    const std::size_t n = static_cast<std::size_t>(output.numel());
    bump_version(output);  // written in place (Note [Collectives write in place] in internal.h)
    return enqueue("reduce_scatter", {output, input}, async, [=](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(in, out, n, dt, nccl_op(op), c, s);
    });
  }

  Work all_gather(Tensor& output, const Tensor& input, bool async) override {
    check_tensor(output, "dist::all_gather");
    check_tensor(input, "dist::all_gather");
    FLAME_CHECK(output.numel() == input.numel() * size_ && input.dtype() == output.dtype(), "dist::all_gather",
                "output of ", output.numel(), " ", dtype_name(output.dtype()), " elements must be world size (", size_,
                ") times the input's ", input.numel(), " ", dtype_name(input.dtype()));
    const ncclDataType_t dt = nccl_dtype(input.dtype(), "dist::all_gather");
    const void* in = input.data_ptr();
    void* out = output.data_ptr();
    const std::size_t n = static_cast<std::size_t>(input.numel());
    bump_version(output);  // written in place (Note [Collectives write in place] in internal.h)
    return enqueue("all_gather", {output, input}, async, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(in, out, n, dt, c, s);
    });
  }

  Work broadcast(Tensor& t, int root, bool async) override {
    check_tensor(t, "dist::broadcast");
    FLAME_CHECK(root >= 0 && root < size_, "dist::broadcast", "root ", root, " is not a rank of a group of ", size_);
    const ncclDataType_t dt = nccl_dtype(t.dtype(), "dist::broadcast");
    void* p = t.data_ptr();
    const std::size_t n = static_cast<std::size_t>(t.numel());
    bump_version(t);  // written in place (Note [Collectives write in place] in internal.h)
    return enqueue("broadcast", {t}, async, [=](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(p, p, n, dt, root, c, s);
    });
  }

  void barrier() override {
    FLAME_CHECK(!fc::is_capturing(core_->device), "dist::barrier",
                "the host waits for every rank: not while a CUDA graph is being captured on cuda:", core_->device);
    Tensor t = Tensor::ones({1}, TensorOptions(DType::f32, device()));
    Work w = all_reduce(t, ReduceOp::sum, true);
    last_->host_wait();
    w.wait();
  }

  void abort(const std::string& reason) override { core_->fail("the group was aborted: " + reason, false); }

  void watch(const std::string& what) override {
    FLAME_CHECK(!fc::is_capturing(core_->device), "dist::ProcessGroup::watch",
                "call it after a replay, not while capturing on cuda:", core_->device);
    if (core_->failed.load()) FLAME_FAIL("dist::ProcessGroup::watch", core_->snapshot_error());
    auto done = std::make_shared<fc::Event>();
    done->record(fc::Stream::current(core_->device));
    std::lock_guard<std::mutex> lk(core_->mu);
    core_->pending.push_back(Pending{++core_->seq, what, done, Clock::now()});
  }

 private:
  Work enqueue(const char* name, std::initializer_list<Tensor> tensors, bool async,
               const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call) {
    if (core_->failed.load()) FLAME_FAIL((std::string("dist::") + name).c_str(), core_->snapshot_error());
    cudaSetDevice(core_->device);
    const bool captured = fc::is_capturing(core_->device);  // Note [Collectives in CUDA graphs]
    const fc::Stream compute = fc::Stream::current(core_->device);
    fc::Event ready;
    ready.record(compute);
    comm_stream_->wait(ready);
    auto done = std::make_shared<fc::Event>();
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      FLAME_CHECK(core_->comm, (std::string("dist::") + name).c_str(), core_->error);
      const uint64_t seq = ++core_->seq;
      ncclResult_t r = call(core_->comm, static_cast<cudaStream_t>(comm_stream_->handle()));
      r = core_->settle(r, Clock::now() + core_->timeout);
      FLAME_CHECK(r == ncclSuccess, (std::string("dist::") + name).c_str(), "rank ", rank_, ": NCCL ",
                  r == ncclInProgress ? "call did not return within the timeout" : ncclGetErrorString(r), " (",
                  ncclGetLastError(core_->comm), ")");
      done->record(*comm_stream_);
      if (!captured) core_->pending.push_back(Pending{seq, name, done, Clock::now()});
    }
    if (!captured)
      for (const Tensor& t : tensors) fc::record_stream(t, *comm_stream_);
    auto work = std::make_shared<NcclWork>();
    work->core = core_;
    work->done = done;
    work->captured = captured;
    last_ = work;
    Work w(work);
    if (!async) w.wait();
    return w;
  }

  std::shared_ptr<Core> core_;
  std::optional<fc::Stream> comm_stream_;  // set in the constructor (on this rank's device)
  std::shared_ptr<NcclWork> last_;
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<TCPStore> store, int rank, int world_size,
                                              int local_rank, Duration timeout) {
  return std::make_shared<NcclGroup>(std::move(store), rank, world_size, local_rank, timeout);
}

bool nccl_available() { return true; }

}  // namespace flame::dist

#else  // no NCCL in this build

namespace flame::dist {

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<TCPStore>, int rank, int, int, Duration) {
  FLAME_FAIL("dist::init_process_group", "rank ", rank,
             ": backend \"nccl\" is not available: FLAME was built without NCCL (FLAME_NCCL=OFF or no CUDA); use \"tcp\"");
}

bool nccl_available() { return false; }

}  // namespace flame::dist

#endif
