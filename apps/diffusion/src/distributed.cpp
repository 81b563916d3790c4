// Multi-process training helpers of flame-diffusion (distributed.h).
#include "distributed.h"

namespace flame_diffusion {

bool launched_distributed() { return flame::dist::env_info().world_size > 1; }

flame::Device init_distributed(flame::Device dev, std::chrono::seconds timeout) {
  if (!launched_distributed()) return dev;
  if (!flame::dist::is_initialized()) {
    flame::dist::ProcessGroupOptions o;
    o.backend = dev.is_cuda() ? "nccl" : "tcp";
    if (timeout.count() > 0) o.timeout = timeout;
    flame::dist::init_process_group(o);
  }
  return flame::dist::default_group().device();
}

int dist_rank() { return flame::dist::get_rank(); }
int dist_world() { return flame::dist::get_world_size(); }

void dist_barrier() {
  if (flame::dist::is_initialized()) flame::dist::default_group().barrier();
}

void finish_distributed() {
  if (flame::dist::is_initialized()) {
    flame::dist::default_group().barrier();
    flame::dist::destroy_process_group();
  }
}

}  // namespace flame_diffusion
