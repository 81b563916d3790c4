// The default process group, environment parsing and the shared pieces of the backends.
#include <cstdlib>
#include <mutex>

#include "flame/cuda.h"
#include "src/dist/internal.h"

namespace flame::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  FLAME_CHECK(end && *end == '\0', "dist::env_info", "environment variable ", name, "='", v, "' is not an integer");
  return static_cast<int>(x);
}

std::mutex g_mu;
std::shared_ptr<ProcessGroup> g_default;

}  // namespace

EnvInfo env_info() {
  EnvInfo e;
  if (env("RANK") || env("WORLD_SIZE")) {
    e.source = "torchrun";
    e.rank = env_int("RANK", 0);
    e.world_size = env_int("WORLD_SIZE", 1);
    e.local_rank = env_int("LOCAL_RANK", 0);
    e.local_world_size = env_int("LOCAL_WORLD_SIZE", e.world_size);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    e.source = "slurm";
    e.rank = env_int("SLURM_PROCID", 0);
    e.world_size = env_int("SLURM_NTASKS", 1);
    e.local_rank = env_int("SLURM_LOCALID", 0);
    e.local_world_size = env_int("SLURM_NTASKS_PER_NODE", env_int("SLURM_TASKS_PER_NODE", e.world_size));
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    e.source = "mpi";
    e.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    e.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    e.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size);
  } else {
    e.source = "none";
  }
  if (const char* a = env("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", 29500);
  FLAME_CHECK(e.world_size >= 1 && e.rank >= 0 && e.rank < e.world_size && e.local_rank >= 0, "dist::env_info",
              "inconsistent environment (", e.source, "): rank ", e.rank, ", world size ", e.world_size,
              ", local rank ", e.local_rank);
  FLAME_CHECK(e.master_port > 0 && e.master_port < 65536, "dist::env_info", "MASTER_PORT ", e.master_port,
              " is not a port");
  return e;
}

// ---- Work ----

void Work::wait() {
  if (state_) state_->wait();
}
bool Work::is_completed() const { return !state_ || state_->completed(); }

void HostWork::wait() {
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  if (!error.empty()) FLAME_FAIL("dist", error);
}
bool HostWork::completed() const {
  std::lock_guard<std::mutex> lk(mu);
  return done;
}
void HostWork::finish(std::string err) {
  {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
    error = std::move(err);
  }
  cv.notify_all();
}

std::string describe_dead_ranks(TCPStore& store) {
  try {
    const std::vector<int> dead = store.dead_ranks();
    if (dead.empty()) return "";
    std::string s = dead.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < dead.size(); ++i) s += (i ? ", " : "") + std::to_string(dead[i]);
    return s;
  } catch (const std::exception&) {
    return "rank 0 (the store it serves is unreachable)";
  }
}

void ProcessGroup::check_tensor(const Tensor& t, const char* what) const {
  FLAME_CHECK(t.defined(), what, "undefined tensor");
  FLAME_CHECK(t.device() == device(), what, "tensor on ", t.device().str(), ", but the \"", backend(),
              "\" group of rank ", rank_, " works on ", device().str());
  FLAME_CHECK(t.is_contiguous(), what, "tensor of shape ", t.sizes(), " is not contiguous");
}

std::shared_ptr<ProcessGroup> new_group(const std::string& backend, std::shared_ptr<TCPStore> store, int rank,
                                        int world_size, int local_rank, Duration timeout) {
  if (backend == "tcp") return make_tcp_group(std::move(store), rank, world_size, timeout);
  if (backend == "nccl") return make_nccl_group(std::move(store), rank, world_size, local_rank, timeout);
  FLAME_FAIL("dist::new_group", "unknown backend \"", backend, "\" (\"nccl\" or \"tcp\")");
}

void init_process_group(const ProcessGroupOptions& options) {
  std::lock_guard<std::mutex> lk(g_mu);
  FLAME_CHECK(!g_default, "dist::init_process_group", "the default process group is already initialised");
  const EnvInfo e = env_info();
  Duration timeout = options.timeout;
  if (const char* t = env("FLAME_DIST_TIMEOUT")) timeout = Duration(static_cast<int64_t>(std::atof(t) * 1000));
  FLAME_CHECK(timeout.count() > 0, "dist::init_process_group", "the timeout must be positive");
  std::string backend = options.backend;
  if (backend.empty()) backend = nccl_available() && cuda_is_available() ? "nccl" : "tcp";
  // A world of one without MASTER_PORT needs no agreed port: any free one.
  const int port = e.world_size == 1 && !env("MASTER_PORT") ? 0 : e.master_port;
  auto store = std::make_shared<TCPStore>(e.master_addr, port, e.rank, e.world_size, e.rank == 0, timeout);
  g_default = new_group(backend, std::move(store), e.rank, e.world_size, e.local_rank, timeout);
}

bool is_initialized() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_default != nullptr;
}

std::shared_ptr<ProcessGroup> default_group_ptr() {
  std::lock_guard<std::mutex> lk(g_mu);
  FLAME_CHECK(g_default, "dist::default_group", "no process group: call dist::init_process_group() first");
  return g_default;
}

ProcessGroup& default_group() { return *default_group_ptr(); }

void destroy_process_group() {
  std::shared_ptr<ProcessGroup> g;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g = std::move(g_default);
    g_default.reset();
  }
}

int get_rank() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_default ? g_default->rank() : 0;
}
int get_world_size() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_default ? g_default->size() : 1;
}
int get_local_rank() { return env_info().local_rank; }

}  // namespace flame::dist
