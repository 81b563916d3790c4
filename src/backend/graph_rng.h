#pragma once
// The seam between random ops (src/ops/random.cpp) and CUDA graph capture (src/backend/cuda/graph.cu).
// Plain C++: random.cpp is built with or without CUDA. Declared in the backend, which implements it
// (a capturing cuda::Graph), and consulted from above by the random ops and autocast's kept copies.
//
// Note [Graph-safe RNG]
// A captured kernel replays with the arguments it was captured with, so a Philox offset passed by
// value would make every replay draw the same numbers. While a thread captures a cuda::Graph, the
// graph installs a GraphRng for that thread; random ops on the graph's device then hand their
// draw to it instead of to the backend. The graph keeps one device-resident (seed, offset) pair
// per generator used, and the captured kernel reads `pair.offset + relative` at run time, where
// `relative` is the draw's offset minus the generator's offset at its first draw in the capture.
// At capture_end the generator's offset is put back where the capture found it (the capture ran
// nothing); before each replay the host reserves as many offsets as the capture drew
// (Generator::next_offset(k)) and writes (seed, first offset) into the pair with a kernel on the
// replay stream. So replay r draws exactly what an eager run of the same ops would draw at that
// generator state, and every replay draws new numbers.
#include <cstdint>
#include <functional>

#include "flame/random.h"
#include "flame/tensor.h"
#include "src/backend/backend.h"

namespace flame::random_detail {

class GraphRng {
 public:
  virtual ~GraphRng() = default;
  virtual int device() const = 0;
  // Fills `dst` (contiguous, on device()) as the backend's random() would for the next offset of `g`.
  virtual void random(backend::RandomKind kind, const Tensor& dst, Generator& g, double a, double b) = 0;
  // Host work the graph runs before (on the replay stream) or after each replay's launch, once per
  // (when, key) (the first registration wins), in registration order; kept as long as the captured
  // graph. Kept low-precision weight copies are brought up to date before a replay, and a captured
  // optimizer step advances its parameters' versions after it, as an eager step would (Note [Kept
  // low-precision copies], src/amp/autocast.cpp).
  enum class When { before, after };
  virtual void add_replay_hook(When when, const void* key, std::function<void()> fn) = 0;
};

// The GraphRng capturing on this thread, or nullptr.
GraphRng*& current_graph_rng();

}  // namespace flame::random_detail
