#pragma once
// flame::dist: multi-process (multi-GPU, multi-node) training. See docs/distributed.md.
//
//   dist::init_process_group();                 // RANK/WORLD_SIZE/... from flame-run, torchrun,
//                                               // Slurm or mpirun; "nccl" on CUDA, else "tcp"
//   auto& pg = dist::default_group();
//   Tensor g = ...;  pg.all_reduce(g, dist::ReduceOp::avg);
//   dist::DistributedDataParallel ddp(model);   // flame/dist/ddp.h
//
// Process groups: "nccl" (CUDA tensors, one GPU per process, collectives on a communication
// stream ordered against the compute stream with events) and "tcp" (CPU tensors over sockets,
// through rank 0; what CI runs). Both bootstrap through a TCPStore served by rank 0 at
// MASTER_ADDR:MASTER_PORT. Every blocking wait has a timeout; a dead or hung peer makes the
// others raise flame::Error naming the rank (when it is known) instead of hanging.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flame/tensor.h"

namespace flame::dist {

using Duration = std::chrono::milliseconds;

enum class ReduceOp { sum, avg, max, min };
const char* reduce_op_name(ReduceOp op);

// ---- environment ----
// Who this process is, as the launchers describe it. Read in this order: RANK/WORLD_SIZE/
// LOCAL_RANK (flame-run, torchrun), SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun),
// OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK (Open MPI's mpirun). MASTER_ADDR/MASTER_PORT name
// rank 0's host and the store's port (default 127.0.0.1:29500 when absent).
struct EnvInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source;  // "torchrun", "slurm", "mpi" or "none"
};
EnvInfo env_info();

// ---- key-value store for the bootstrap ----
// Rank 0 serves it (a thread) on `port`; every rank (0 included) is a client. Values are bytes.
// get() and wait() block until the key exists or the timeout passes (flame::Error naming the
// key). The server notices a client whose connection closes without saying goodbye and records
// its rank under "dist/dead/<rank>", so that others can name a rank that died.
class TCPStore {
 public:
  TCPStore(const std::string& host, int port, int rank, int world_size, bool is_server, Duration timeout);
  ~TCPStore();
  TCPStore(const TCPStore&) = delete;
  TCPStore& operator=(const TCPStore&) = delete;

  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);                  // waits for the key
  std::optional<std::string> try_get(const std::string& key);  // never waits
  int64_t add(const std::string& key, int64_t delta);       // atomic; returns the new value
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Duration timeout);
  // Ranks whose connection to the store closed without a goodbye (dead processes).
  std::vector<int> dead_ranks();
  int port() const;  // the bound port (useful with port 0)
  Duration timeout() const { return timeout_; }

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  Duration timeout_;
};

// ---- asynchronous work ----
// A handle on a queued collective. wait(): on "nccl" the current stream of the tensor's device
// waits for it (the host does not, like PyTorch); on "tcp" the host waits. Either way an error of
// the collective (a dead peer, a timeout) is raised here.
class Work {
 public:
  struct State;
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void wait();
  // True when the collective has finished (or failed); never waits.
  bool is_completed() const;
  bool defined() const { return state_ != nullptr; }

 private:
  std::shared_ptr<State> state_;
};

// ---- process groups ----
struct ProcessGroupOptions {
  std::string backend;  // "nccl", "tcp" or "" (nccl when built with NCCL and a GPU is visible)
  // How long a collective or store wait may take before the group fails (FLAME_DIST_TIMEOUT
  // in seconds overrides the default).
  Duration timeout = std::chrono::seconds(300);
};

// Collectives on contiguous tensors, in place, as torch.distributed: every rank calls the same
// collectives in the same order with tensors of the same shape and dtype. async: returns at once
// (wait on the Work before reading or writing the tensors); otherwise the call waits as
// Work::wait does. On "nccl" the collectives (and DistributedDataParallel) may be captured into a
// CUDA graph (cuda::Graph, cuda::GraphedStep; Note [Collectives in CUDA graphs] in
// src/dist/nccl_group.cpp): run them eagerly once first, keep their tensors alive while the graph
// lives, wait() on every captured Work before the capture ends, and watch() after each replay.
// barrier() raises during a capture, and Work::is_completed() raises for a captured Work (it runs
// at every replay: there is no single completion to query).
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend() const = 0;
  // The device collective tensors must be on (cuda:local_rank for "nccl", cpu for "tcp").
  virtual Device device() const = 0;

  virtual Work all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum, bool async = false) = 0;
  // output: numel N; input: numel size() * N; rank r gets the reduction of input chunk r.
  virtual Work reduce_scatter(Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::sum,
                              bool async = false) = 0;
  // output: numel size() * N; input: numel N; chunk r of output is rank r's input.
  virtual Work all_gather(Tensor& output, const Tensor& input, bool async = false) = 0;
  virtual Work broadcast(Tensor& t, int root = 0, bool async = false) = 0;
  // Returns when every rank has reached it (the host waits).
  virtual void barrier() = 0;
  // Stops the group after a failure: later calls raise; peers see the connection close.
  virtual void abort(const std::string& reason) = 0;
  // Bounds the work queued so far on the current stream by the group's timeout, as if it were a
  // collective: "nccl" records an event there, and its watchdog fails the group (naming `what`)
  // when the event is not reached in time. For collectives the group cannot see: those replayed
  // from a CUDA graph (Note [Collectives in CUDA graphs]); call it after each replay. A no-op on
  // "tcp", whose collectives run on the host. Not during a capture.
  virtual void watch(const std::string& what) { (void)what; }

  TCPStore& store() { return *store_; }

 protected:
  // Checks shared by the backends; `what` names the collective in errors.
  void check_tensor(const Tensor& t, const char* what) const;
  int rank_ = 0;
  int size_ = 1;
  std::shared_ptr<TCPStore> store_;
};

// Builds a group over `store` (every rank calls it with the same backend).
std::shared_ptr<ProcessGroup> new_group(const std::string& backend, std::shared_ptr<TCPStore> store, int rank,
                                        int world_size, int local_rank, Duration timeout);

// The default group, built from the environment (env_info()). Raises when already initialised.
void init_process_group(const ProcessGroupOptions& options = {});
bool is_initialized();
ProcessGroup& default_group();  // raises when not initialised
std::shared_ptr<ProcessGroup> default_group_ptr();
void destroy_process_group();
int get_rank();        // 0 when not initialised
int get_world_size();  // 1 when not initialised
int get_local_rank();  // env_info().local_rank
bool nccl_available();  // built with NCCL

}  // namespace flame::dist

#include "flame/dist/ddp.h"
#include "flame/dist/zero.h"
