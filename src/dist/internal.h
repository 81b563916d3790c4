#pragma once
// Internals shared by the process-group backends (src/dist/).
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "flame/dist.h"

namespace flame::dist {

// Note [Collectives write in place]
// all_reduce and broadcast write their tensor, all_gather and reduce_scatter their output: like
// any in-place op they bump its version when they are queued, so that what is keyed on the version
// (saved tensors' checks, a Linear weight's kept low-precision copy: docs/amp.md) sees the new
// values, e.g. the parameters DistributedDataParallel broadcasts from rank 0.

// A queued collective. Backends derive from it.
struct Work::State {
  virtual ~State() = default;
  virtual void wait() = 0;
  virtual bool completed() const = 0;
};

// A collective the host completes (the "tcp" backend's worker thread): done or failed.
struct HostWork : Work::State {
  void wait() override;
  bool completed() const override;
  void finish(std::string error);  // "" = success

  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
};

std::shared_ptr<ProcessGroup> make_tcp_group(std::shared_ptr<TCPStore> store, int rank, int world_size,
                                             Duration timeout);
// Defined only when built with NCCL (nccl_group.cpp); raises otherwise.
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<TCPStore> store, int rank, int world_size,
                                              int local_rank, Duration timeout);

// "rank 3" / "ranks 1, 2" / "" from the store's record of dead ranks (best effort).
std::string describe_dead_ranks(TCPStore& store);

}  // namespace flame::dist
