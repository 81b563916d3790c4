#pragma once
// Multi-process training of flame-diffusion (docs/distributed.md). Under flame-run (or torchrun,
// srun, mpirun: WORLD_SIZE > 1) every rank runs the same command; each trains on its share of
// every epoch (DistributedSampler) with a per-rank micro-batch of --batch / (--accum * world), the
// model wrapped in DistributedDataParallel, and rank 0 alone logs, samples and writes checkpoints
// (after a barrier). Without a launcher nothing changes.
#include <chrono>

#include <flame/dist.h>
#include <flame/flame.h>

namespace flame_diffusion {

// True when a launcher started more than one rank.
bool launched_distributed();
// Initialises the default process group once when launched_distributed(); returns the device
// this rank trains on: cuda:LOCAL_RANK (modulo the visible GPUs) when `dev` is a CUDA device.
// timeout: how long a collective (or a barrier) waits for the slowest rank before the group fails
// naming it (the process group's default, 300 s, when zero).
flame::Device init_distributed(flame::Device dev, std::chrono::seconds timeout = std::chrono::seconds(0));
int dist_rank();   // 0 without a group
int dist_world();  // 1 without a group
void dist_barrier();  // no-op without a group
void finish_distributed();

}  // namespace flame_diffusion
