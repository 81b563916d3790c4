// DistributedDataParallel (flame/dist/ddp.h).
//
// Note [DDP buckets]
// At construction the parameters that require grad are packed, in reverse registration order,
// into flat buckets of one dtype of at most bucket_cap_mb each (allocated once). A
// post-accumulate hook on every parameter copies the parameter's gradient, once backward has
// accumulated it into the store, into its slot of the bucket; when a bucket's last slot arrives
// the bucket is all-reduced (average) asynchronously, while backward goes on. Buckets are
// launched strictly in index order on every rank (a ready bucket waits for the ones before it),
// because NCCL needs every rank to issue the same collectives in the same order.
// finish_gradients() launches what is left (slots of parameters without a gradient on this rank
// are zeroed: a parameter some rank did not use still reduces consistently), waits, and copies
// each bucket slot back into the store, so every rank's store holds the same averaged gradient
// for every parameter. A parameter whose gradient arrives again after its bucket was launched
// (two backward passes without no_sync) is an error naming it. With DDPOptions::reduce_dtype the
// buckets of floating gradients hold that dtype: the copy in rounds each gradient to it, the
// all-reduce averages in it, and the copy back converts to the gradient's dtype.
//
// A synchronised step may be captured into a CUDA graph (the trainer's --compile): the hooks and
// finish_gradients() run as host code at the capture, recording the bucket copies, the
// all-reduces (Note [Collectives in CUDA graphs] in nccl_group.cpp) and the copies back; every
// replay runs them in that order. The graph fixes which parameters get gradients, as any replayed
// step does; the buckets are allocated here, so they outlive the graph.
#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>

#include "flame/dist.h"

namespace flame::dist {

namespace {

struct Slot {
  Tensor param;
  std::string name;
  std::size_t bucket = 0;
  int64_t offset = 0;
  bool arrived = false;
};

struct Bucket {
  Tensor flat;
  std::vector<std::size_t> slots;
  std::size_t pending = 0;
  bool launched = false;
  Work work;
};

}  // namespace

struct DistributedDataParallel::State {
  std::shared_ptr<ProcessGroup> group;
  std::vector<Slot> slots;
  std::vector<Bucket> buckets;
  std::size_t next_launch = 0;
  bool require_sync = true;
  bool active = false;  // a synchronised backward has delivered gradients since the last finish
  std::vector<double> launch_times, last_launch_times;
  bool record_events = false;
  std::vector<std::shared_ptr<cuda::Event>> launch_events, last_launch_events;

  void begin_iteration() {
    active = true;
    next_launch = 0;
    launch_times.clear();
    launch_events.clear();
    for (Slot& s : slots) s.arrived = false;
    for (Bucket& b : buckets) {
      b.pending = b.slots.size();
      b.launched = false;
      b.work = Work();
    }
  }

  void launch(Bucket& b) {
    // A timing event cannot be recorded into a CUDA graph: captured steps record none.
    if (record_events && !cuda::is_capturing(b.flat.device().index)) {
      auto e = std::make_shared<cuda::Event>(/*enable_timing=*/true);
      e->record(cuda::Stream::current(b.flat.device().index));
      launch_events.push_back(std::move(e));
    }
    b.work = group->all_reduce(b.flat, ReduceOp::avg, /*async=*/true);
    b.launched = true;
    launch_times.push_back(DistributedDataParallel::now_seconds());
  }

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(buckets[next_launch++]);
  }

  void on_grad(std::size_t i, const Tensor& grad) {
    if (!active) begin_iteration();
    Slot& s = slots[i];
    Bucket& b = buckets[s.bucket];
    FLAME_CHECK(!b.launched, "DistributedDataParallel", "parameter '", s.name,
                "' received a gradient again after its bucket was reduced: run every backward but the last of an "
                "accumulation inside no_sync(), and call finish_gradients() after the last");
    b.flat.narrow(0, s.offset, s.param.numel()).view(s.param.sizes()).copy_(grad);
    if (!s.arrived) {
      s.arrived = true;
      --b.pending;
      if (b.pending == 0) launch_ready();
    }
  }
};

double DistributedDataParallel::now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module, DDPOptions options,
                                                 std::shared_ptr<ProcessGroup> group)
    : module_(std::move(module)), state_(std::make_shared<State>()) {
  FLAME_CHECK(module_ != nullptr, "DistributedDataParallel", "null module");
  FLAME_CHECK(options.bucket_cap_mb > 0, "DistributedDataParallel", "bucket_cap_mb must be positive, got ",
              options.bucket_cap_mb);
  FLAME_CHECK(!options.reduce_dtype || *options.reduce_dtype == DType::bf16 || *options.reduce_dtype == DType::f16 ||
                  *options.reduce_dtype == DType::f32,
              "DistributedDataParallel", "reduce_dtype must be bf16, f16 or f32, got ",
              dtype_name(*options.reduce_dtype));
  state_->group = group ? std::move(group) : default_group_ptr();
  state_->record_events = options.record_launch_events && state_->group->device().is_cuda();
  ProcessGroup& pg = *state_->group;
  const Device dev = pg.device();

  // Everyone starts from rank 0's values.
  {
    NoGradGuard no_grad;
    auto sync = [&](const std::string& name, const Tensor& t) {
      FLAME_CHECK(t.device() == dev, "DistributedDataParallel", "'", name, "' is on ", t.device().str(), ", the \"",
                  pg.backend(), "\" group of rank ", pg.rank(), " works on ", dev.str(), ": move the module first");
      if (t.numel() == 0) return;
      Tensor c = t.is_contiguous() ? t.detach() : t.contiguous();
      pg.broadcast(c, 0);
      if (!t.is_contiguous()) Tensor(t.detach()).copy_(c);
    };
    for (const auto& [name, p] : module_->named_parameters()) sync(name, p);
    if (options.broadcast_buffers)
      for (const auto& [name, b] : module_->named_buffers()) sync(name, b);
  }

  // Buckets (Note [DDP buckets]).
  auto named = module_->named_parameters();
  std::reverse(named.begin(), named.end());
  const double cap = options.bucket_cap_mb * 1024.0 * 1024.0;
  std::vector<std::pair<DType, std::size_t>> open;  // dtype -> bucket being filled
  std::vector<int64_t> sizes;
  for (auto& [name, p] : named) {
    if (!p.requires_grad() || p.numel() == 0) continue;
    std::size_t bi = SIZE_MAX;
    for (auto& [dt, b] : open)
      if (dt == p.dtype()) bi = b;
    const double bytes = static_cast<double>(p.numel() * static_cast<int64_t>(p.element_size()));
    if (bi == SIZE_MAX || (sizes[bi] > 0 && static_cast<double>(sizes[bi]) * static_cast<double>(p.element_size()) + bytes > cap)) {
      bi = state_->buckets.size();
      state_->buckets.emplace_back();
      sizes.push_back(0);
      bool replaced = false;
      for (auto& [dt, b] : open)
        if (dt == p.dtype()) {
          b = bi;
          replaced = true;
        }
      if (!replaced) open.emplace_back(p.dtype(), bi);
    }
    Slot s;
    s.param = p;
    s.name = name;
    s.bucket = bi;
    s.offset = sizes[bi];
    sizes[bi] += p.numel();
    state_->buckets[bi].slots.push_back(state_->slots.size());
    state_->slots.push_back(std::move(s));
  }
  for (std::size_t b = 0; b < state_->buckets.size(); ++b) {
    const DType dt = state_->slots[state_->buckets[b].slots.front()].param.dtype();
    // Floating gradients travel in reduce_dtype when one is set (the copies in and out convert).
    const DType wire = options.reduce_dtype && is_floating(dt) ? *options.reduce_dtype : dt;
    state_->buckets[b].flat = Tensor::zeros({sizes[b]}, TensorOptions(wire, dev));
  }

  std::weak_ptr<State> weak = state_;
  for (std::size_t i = 0; i < state_->slots.size(); ++i) {
    state_->slots[i].param.register_post_accumulate_grad_hook([weak, i](const Tensor& grad) {
      auto s = weak.lock();
      if (!s || !s->require_sync) return;
      s->on_grad(i, grad);
    });
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // Reductions still in flight keep their buffers alive (the group holds them); just wait.
  for (Bucket& b : state_->buckets) {
    try {
      if (b.launched) b.work.wait();
    } catch (const std::exception&) {
    }
  }
}

Tensor DistributedDataParallel::forward(const Tensor& x) { return module_->forward(x); }

void DistributedDataParallel::finish_gradients(Gradients& grads) {
  State& s = *state_;
  if (!s.require_sync || !s.active) return;
  {
    NoGradGuard no_grad;
    for (std::size_t b = s.next_launch; b < s.buckets.size(); ++b) {
      Bucket& bk = s.buckets[b];
      for (std::size_t i : bk.slots) {
        Slot& sl = s.slots[i];
        if (!sl.arrived) bk.flat.narrow(0, sl.offset, sl.param.numel()).zero_();
      }
      bk.pending = 0;
    }
    s.launch_ready();
    for (Bucket& bk : s.buckets) {
      bk.work.wait();
      for (std::size_t i : bk.slots) {
        const Slot& sl = s.slots[i];
        Tensor avg = bk.flat.narrow(0, sl.offset, sl.param.numel()).view(sl.param.sizes());
        if (grads.contains(sl.param)) grads.at(sl.param).copy_(avg);
        else grads.set(sl.param, avg.dtype() == sl.param.dtype() ? avg : avg.to(sl.param.dtype()));
      }
    }
  }
  s.active = false;
  s.last_launch_times = std::move(s.launch_times);
  s.launch_times.clear();
  s.last_launch_events = std::move(s.launch_events);
  s.launch_events.clear();
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.state_->require_sync) {
  ddp_.state_->require_sync = false;
}
DistributedDataParallel::NoSync::~NoSync() { ddp_.state_->require_sync = previous_; }

std::size_t DistributedDataParallel::num_buckets() const { return state_->buckets.size(); }

std::vector<std::size_t> DistributedDataParallel::bucket_bytes() const {
  std::vector<std::size_t> out;
  for (const Bucket& b : state_->buckets) out.push_back(b.flat.nbytes());
  return out;
}

std::vector<double> DistributedDataParallel::last_launch_times() const { return state_->last_launch_times; }

std::vector<std::shared_ptr<cuda::Event>> DistributedDataParallel::last_launch_events() const {
  return state_->last_launch_events;
}

}  // namespace flame::dist
