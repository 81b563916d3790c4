// Streams, events and graphs (include/flame/cuda.h) in a build without CUDA: every call that needs
// a GPU raises flame::Error; is_capturing is false. Builds with CUDA use src/backend/cuda/stream.cu
// and graph.cu instead.
#ifndef FLAME_WITH_CUDA

#include "flame/cuda.h"
#include "flame/error.h"
#include "flame/tensor.h"

namespace flame::cuda {

#define FLAME_NO_CUDA(what) FLAME_FAIL(what, "FLAME was built without CUDA")

Stream Stream::default_stream(int) { FLAME_NO_CUDA("cuda::Stream::default_stream"); }
Stream Stream::current(int) { FLAME_NO_CUDA("cuda::Stream::current"); }
Stream Stream::create(int, int, bool) { FLAME_NO_CUDA("cuda::Stream::create"); }
Stream Stream::from_handle(void*, int) { FLAME_NO_CUDA("cuda::Stream::from_handle"); }
void* Stream::handle() const { return handle_; }
int Stream::priority() const { FLAME_NO_CUDA("cuda::Stream::priority"); }
bool Stream::query() const { FLAME_NO_CUDA("cuda::Stream::query"); }
void Stream::synchronize() const { FLAME_NO_CUDA("cuda::Stream::synchronize"); }
void Stream::wait(const Event&) const { FLAME_NO_CUDA("cuda::Stream::wait"); }
void Stream::wait(const Stream&) const { FLAME_NO_CUDA("cuda::Stream::wait"); }
void set_current_stream(const Stream&) { FLAME_NO_CUDA("cuda::set_current_stream"); }
StreamGuard::StreamGuard(const Stream& stream) : previous_(stream), current_(stream) {
  FLAME_NO_CUDA("cuda::StreamGuard");
}
StreamGuard::~StreamGuard() = default;

Event::Event(bool enable_timing) : timing_(enable_timing) {}
Event::~Event() = default;
Event::Event(Event&& o) noexcept : event_(o.event_), device_(o.device_), timing_(o.timing_), recorded_(o.recorded_) {}
Event& Event::operator=(Event&& o) noexcept {
  event_ = o.event_;
  device_ = o.device_;
  timing_ = o.timing_;
  recorded_ = o.recorded_;
  return *this;
}
void Event::record() { FLAME_NO_CUDA("cuda::Event::record"); }
void Event::record(const Stream&) { FLAME_NO_CUDA("cuda::Event::record"); }
void Event::wait(const Stream&) const { FLAME_NO_CUDA("cuda::Event::wait"); }
bool Event::query() const { FLAME_NO_CUDA("cuda::Event::query"); }
void Event::synchronize() const { FLAME_NO_CUDA("cuda::Event::synchronize"); }
float Event::elapsed_time(const Event&) const { FLAME_NO_CUDA("cuda::Event::elapsed_time"); }

void record_stream(const Tensor&, const Stream&) { FLAME_NO_CUDA("cuda::record_stream"); }

struct Graph::Impl {};
Graph::Graph() : impl_(std::make_shared<Impl>()) {}
Graph::~Graph() = default;
void Graph::capture_begin(int) { FLAME_NO_CUDA("cuda::Graph::capture_begin"); }
void Graph::capture_end() { FLAME_NO_CUDA("cuda::Graph::capture_end"); }
void Graph::replay() { FLAME_NO_CUDA("cuda::Graph::replay"); }
void Graph::reset() {}
bool Graph::captured() const { return false; }
uint64_t Graph::random_offsets_per_replay() const { return 0; }
void capture(Graph&, const std::function<void()>&, int) { FLAME_NO_CUDA("cuda::capture"); }
bool is_capturing(int) { return false; }

#undef FLAME_NO_CUDA

}  // namespace flame::cuda

#endif  // FLAME_WITH_CUDA
