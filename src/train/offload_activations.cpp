// Activation offload: offload::OffloadActivations (include/flame/offload.h, docs/offload.md).
//
// Note [Activation offload]
// Built on saved-tensor hooks (Note [Saved tensor hooks]). Each packed tensor becomes a Record
// shared by the graph (through the hooks' packed value) and, weakly, by the guard's State, which
// lists records in pack order so that an unpack can prefetch the one saved before it.
//  - Pack (forward, CUDA tensor t): an event recorded on the current (compute) stream after t
//    was produced; the side stream waits for it, copies t into a pinned host tensor with one
//    cudaMemcpyAsync, and records `offloaded`. record_stream(t, side) keeps t's memory from being
//    reused before that copy ran, and nothing else holds t: its memory returns to the pool as soon
//    as the forward drops its last handle. The host never waits.
//  - Unpack (backward): if the record was prefetched, the compute stream waits for `fetched`
//    (recorded on the side stream after the upload) and takes the device copy (record_stream on
//    compute); else the compute stream waits for `offloaded` and uploads it itself. Then, with
//    prefetch on, the newest record saved before this one that is alive and not fetched yet is
//    uploaded on the side stream (the next node backward is most likely to need); with
//    prefetch_bytes, older ones too until that many bytes are on their way back. A record keeps
//    no device copy once unpacked, so each prefetched tensor is held on the device from its
//    prefetch to its use only.
//  - Writes to the pinned copy never happen after the pack's copy, so no host/device race; the
//    pinned block returns to its cache when the record dies, once its copies have run
//    (Note [Pinned host cache]).
//  - CPU tensors (tests without a GPU): cloned at pack and handed back at unpack.
//  - Kept as they are: tensors under min_bytes, and those whose storage is one of options.keep's
//    (Tensor::shares_storage's identity: a frozen weight, or a view of one, that a matmul saved).
#include <algorithm>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

#include "flame/cuda.h"
#include "flame/offload.h"
#include "src/core/tensor_impl.h"

namespace flame::offload {

namespace {
struct Record {
  Tensor host;      // pinned copy (CUDA) or clone (CPU)
  Tensor kept;      // a tensor below min_bytes, kept as it is
  Device device;    // where the saved tensor lived
  std::size_t index = 0;
  cuda::Event offloaded;  // on the side stream, after the download
  cuda::Event fetched;    // on the side stream, after a prefetch upload
  Tensor prefetched;      // the device copy made by a prefetch, until unpacked
  bool fetch_started = false;
};
}  // namespace

struct OffloadActivations::State {
  OffloadActivationsOptions options;
  std::vector<std::weak_ptr<Record>> records;  // in pack order
  std::vector<std::pair<int, cuda::Stream>> side;  // side stream per device
  int64_t packed = 0;
  std::size_t bytes = 0;
  int64_t prefetch_hits = 0;
  std::size_t ahead = 0;  // bytes prefetched and not unpacked yet

  cuda::Stream side_stream(int device) {
    for (auto& [d, s] : side) {
      if (d == device) return s;
    }
    side.emplace_back(device, cuda::Stream::create(device));
    return side.back().second;
  }

  // The storages of options.keep (what Tensor::shares_storage compares).
  std::unordered_set<const Storage*> keep;

  static const Storage* storage_of(const Tensor& t) { return t.impl()->storage.get(); }

  std::shared_ptr<Record> pack(const Tensor& t) {
    auto r = std::make_shared<Record>();
    r->device = t.device();
    if (t.nbytes() < options.min_bytes || t.numel() == 0 || keep.count(storage_of(t)) != 0) {
      r->kept = t;
      return r;
    }
    r->index = records.size();
    if (t.device().is_cpu()) {
      r->host = t.clone();
    } else {
      const int dev = t.device().index;
      const cuda::Stream compute = cuda::Stream::current(dev);
      const cuda::Stream copy = side_stream(dev);
      Tensor src = t.contiguous();  // on compute, like the op that produced t
      cuda::Event produced;
      produced.record(compute);
      copy.wait(produced);
      r->host = empty_pinned(src.sizes(), src.dtype());
      {
        cuda::StreamGuard guard(copy);
        r->host.copy_(src, /*non_blocking=*/true);
      }
      cuda::record_stream(src, copy);
      r->offloaded.record(copy);
    }
    ++packed;
    bytes += t.nbytes();
    records.push_back(r);
    return r;
  }

  // Starts the upload of `r` on its side stream (prefetch).
  void prefetch(Record& r) {
    const int dev = r.device.index;
    const cuda::Stream copy = side_stream(dev);
    {
      cuda::StreamGuard guard(copy);  // ordered after r's download on this same stream
      r.prefetched = r.host.to(r.device, /*non_blocking=*/true);
    }
    r.fetched.record(copy);
    r.fetch_started = true;
    ahead += r.prefetched.nbytes();
  }

  Tensor unpack(Record& r) {
    if (r.kept.defined()) return r.kept;
    if (r.device.is_cpu()) return r.host;
    const int dev = r.device.index;
    const cuda::Stream compute = cuda::Stream::current(dev);
    Tensor out;
    if (r.prefetched.defined()) {
      compute.wait(r.fetched);
      ahead -= std::min(ahead, r.prefetched.nbytes());
      out = std::move(r.prefetched);
      r.prefetched = Tensor();
      cuda::record_stream(out, compute);
      ++prefetch_hits;
    } else {
      compute.wait(r.offloaded);
      out = r.host.to(r.device, /*non_blocking=*/true);
    }
    r.fetch_started = true;
    if (options.prefetch) {
      // The records saved before this one, newest first, until one tensor (or prefetch_bytes) is on
      // its way back.
      bool one = false;
      for (std::size_t i = r.index; i-- > 0;) {
        if (one && ahead >= options.prefetch_bytes) break;
        std::shared_ptr<Record> prev = records[i].lock();
        if (!prev || prev->kept.defined() || prev->device.is_cpu()) continue;
        if (!prev->fetch_started) prefetch(*prev);
        one = true;
      }
    }
    return out;
  }
};

OffloadActivations::OffloadActivations(OffloadActivationsOptions options) : state_(std::make_shared<State>()) {
  state_->options = options;
  for (const Tensor& t : state_->options.keep) {
    if (t.defined()) state_->keep.insert(State::storage_of(t));
  }
  state_->options.keep.clear();  // the set is enough: holding them here would only extend their lives
  // The hooks hold the state: packed records outlive the guard and still unpack (and prefetch)
  // through it after the scope ended.
  std::shared_ptr<State> state = state_;
  hooks_ = std::make_unique<autograd::SavedTensorHooks>(
      [state](const Tensor& t) -> std::any { return state->pack(t); },
      [state](const std::any& v) -> Tensor { return state->unpack(*std::any_cast<std::shared_ptr<Record>>(v)); });
}

OffloadActivations::~OffloadActivations() = default;

int64_t OffloadActivations::packed_count() const { return state_->packed; }
std::size_t OffloadActivations::packed_bytes() const { return state_->bytes; }
int64_t OffloadActivations::prefetched_count() const { return state_->prefetch_hits; }

}  // namespace flame::offload
