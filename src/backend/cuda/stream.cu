// Public streams and events: flame::cuda::Stream, StreamGuard, Event, record_stream.
//
// Note [Recycled streams]
// A stream made by Stream::create is never destroyed: when its last Stream handle goes, it returns
// to a per-device free list (by priority and flags) and the next create of that kind reuses it.
// Blocks cached for a stream (Note [Block cache]) and matmul workspaces are keyed by the stream
// handle; a destroyed handle could be reused by CUDA for a new stream while the old one's work is
// still queued, making "same handle" no longer mean "same queue". Recycling keeps the meaning
// (PyTorch keeps a fixed pool of streams for the same reason).
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "flame/cuda.h"
#include "flame/tensor.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/core/tensor_impl.h"

namespace flame::cuda {

namespace bc = ::flame::backend::cuda;

namespace {

struct StreamKind {
  int device;
  int priority;
  unsigned int flags;
  bool operator<(const StreamKind& o) const {
    return std::tie(device, priority, flags) < std::tie(o.device, o.priority, o.flags);
  }
};

std::mutex g_free_streams_mutex;
std::map<StreamKind, std::vector<cudaStream_t>>& free_streams() {
  static auto* lists = new std::map<StreamKind, std::vector<cudaStream_t>>();  // never destroyed
  return *lists;
}

int current_device() {
  int d = 0;
  FLAME_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void check_no_capture_on_thread(int device, const char* op, const char* what) {
  FLAME_CHECK(!bc::thread_is_capturing(device), op, "cannot ", what,
              " while a CUDA graph is being captured on this thread (cuda:", device, ")");
}

}  // namespace

Stream Stream::default_stream(int device) {
  return Stream(bc::cuda_backend(device).default_stream(), device, nullptr);
}

Stream Stream::current(int device) { return Stream(bc::cuda_backend(device).stream(), device, nullptr); }

Stream Stream::create(int device, int priority, bool non_blocking) {
  bc::cuda_backend(device);  // validates the index
  bc::DeviceGuard guard(device);
  int least = 0, greatest = 0;
  FLAME_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // CUDA: numerically lower is higher priority; greatest <= least.
  const int p = priority < greatest ? greatest : (priority > least ? least : priority);
  const StreamKind kind{device, p, non_blocking ? unsigned{cudaStreamNonBlocking} : unsigned{cudaStreamDefault}};
  cudaStream_t s = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_free_streams_mutex);
    auto& list = free_streams()[kind];
    if (!list.empty()) {
      s = list.back();
      list.pop_back();
    }
  }
  if (s == nullptr) FLAME_CUDA_CHECK(cudaStreamCreateWithPriority(&s, kind.flags, p));
  // Note [Recycled streams]: the owner returns the handle to the free list instead of destroying it.
  std::shared_ptr<void> owner(static_cast<void*>(s), [kind](void* h) {
    try {
      std::lock_guard<std::mutex> lock(g_free_streams_mutex);
      free_streams()[kind].push_back(static_cast<cudaStream_t>(h));
    } catch (...) {  // no host memory: the stream is leaked, which is harmless
    }
  });
  return Stream(static_cast<void*>(s), device, std::move(owner));
}

Stream Stream::from_handle(void* cuda_stream, int device) {
  bc::cuda_backend(device);
  return Stream(cuda_stream, device, nullptr);
}

void* Stream::handle() const { return handle_; }

int Stream::priority() const {
  int p = 0;
  FLAME_CUDA_CHECK(cudaStreamGetPriority(static_cast<cudaStream_t>(handle_), &p));
  return p;
}

// The answer of cudaStreamQuery/cudaEventQuery: done, not yet (clearing the sticky "not ready"),
// or an error raised.
static bool finished(cudaError_t err) {
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  FLAME_CUDA_CHECK(err);
  return false;
}

bool Stream::query() const {
  bc::DeviceGuard guard(device_);
  return finished(cudaStreamQuery(static_cast<cudaStream_t>(handle_)));
}

void Stream::synchronize() const {
  bc::DeviceGuard guard(device_);
  const auto s = static_cast<cudaStream_t>(handle_);
  bc::check_not_capturing(s, "Stream::synchronize", "synchronize a stream");
  check_no_capture_on_thread(device_, "Stream::synchronize", "synchronize a stream");
  FLAME_CUDA_CHECK(cudaStreamSynchronize(s));
}

void Stream::wait(const Event& event) const { event.wait(*this); }

void Stream::wait(const Stream& other) const {
  if (other == *this) return;
  Event e;
  e.record(other);
  e.wait(*this);
}

void set_current_stream(const Stream& stream) {
  bc::cuda_backend(stream.device());
  const auto s = static_cast<cudaStream_t>(stream.handle());
  // The backend's default stream is stored as "no override" so both spellings compare equal.
  bc::set_current_stream_override(stream.device(),
                                  s == bc::cuda_backend(stream.device()).default_stream() ? nullptr : s);
}

StreamGuard::StreamGuard(const Stream& stream) : previous_(Stream::current(stream.device())), current_(stream) {
  set_current_stream(stream);
}

StreamGuard::~StreamGuard() {
  try {
    set_current_stream(previous_);
  } catch (...) {  // unreachable: the device was valid at construction
  }
}

// ---------------------------------------------------------------------------------------------
// Event
// ---------------------------------------------------------------------------------------------

Event::Event(bool enable_timing) : timing_(enable_timing) {}

Event::~Event() {
  if (event_ != nullptr) {
    int previous = -1;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) (void)cudaSetDevice(device_);
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
    (void)cudaGetLastError();
  }
}

Event::Event(Event&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), device_(o.device_), timing_(o.timing_), recorded_(o.recorded_) {}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    Event dying(std::move(*this));
    event_ = std::exchange(o.event_, nullptr);
    device_ = o.device_;
    timing_ = o.timing_;
    recorded_ = o.recorded_;
  }
  return *this;
}

void Event::record() { record(Stream::current(current_device())); }

void Event::record(const Stream& stream) {
  FLAME_CHECK(event_ == nullptr || device_ == stream.device(), "Event::record", "the event belongs to cuda:", device_,
              ", the stream to cuda:", stream.device());
  bc::DeviceGuard guard(stream.device());
  if (event_ == nullptr) {
    cudaEvent_t e = nullptr;
    FLAME_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing_ ? cudaEventDefault : cudaEventDisableTiming));
    event_ = e;
    device_ = stream.device();
  }
  FLAME_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream.handle())));
  recorded_ = true;
}

void Event::wait(const Stream& stream) const {
  if (!recorded_) return;  // like CUDA: waiting for a never-recorded event is a no-op
  bc::DeviceGuard guard(stream.device());
  FLAME_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.handle()), static_cast<cudaEvent_t>(event_), 0));
}

bool Event::query() const {
  if (!recorded_) return true;
  bc::DeviceGuard guard(device_);
  return finished(cudaEventQuery(static_cast<cudaEvent_t>(event_)));
}

void Event::synchronize() const {
  if (!recorded_) return;
  check_no_capture_on_thread(device_, "Event::synchronize", "wait for an event");
  bc::DeviceGuard guard(device_);
  FLAME_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
}

float Event::elapsed_time(const Event& end) const {
  FLAME_CHECK(timing_ && end.timing_, "Event::elapsed_time", "both events need enable_timing = true");
  FLAME_CHECK(recorded_ && end.recorded_, "Event::elapsed_time", "both events must be recorded first");
  FLAME_CHECK(device_ == end.device_, "Event::elapsed_time", "events on cuda:", device_, " and cuda:", end.device_);
  bc::DeviceGuard guard(device_);
  float ms = 0.0f;
  FLAME_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(event_), static_cast<cudaEvent_t>(end.event_)));
  return ms;
}

// ---------------------------------------------------------------------------------------------
// record_stream
// ---------------------------------------------------------------------------------------------

void record_stream(const Tensor& tensor, const Stream& stream) {
  FLAME_CHECK(tensor.defined(), "record_stream", "undefined tensor");
  FLAME_CHECK(tensor.device().is_cuda(), "record_stream", "expected a CUDA tensor, got one on ", tensor.device());
  FLAME_CHECK(tensor.device().index == stream.device(), "record_stream", "the tensor is on ", tensor.device(),
              ", the stream on cuda:", stream.device());
  void* base = tensor.impl()->storage->data.get();
  bc::cuda_backend(stream.device()).pool().record_stream(base, static_cast<cudaStream_t>(stream.handle()));
}

bool is_capturing(int device) { return bc::thread_is_capturing(device); }

}  // namespace flame::cuda
