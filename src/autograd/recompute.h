#pragma once
// Internal side of autograd::RecomputeCheap (include/flame/recompute.h): how an op marks its
// output, and how a saved tensor keeps and reruns the mark. Note [Recompute cheap] in
// recompute.cpp.
#include <functional>
#include <memory>
#include <mutex>

#include "src/autograd/node.h"
#include "src/ops/recompute_hooks.h"  // RecipeFn, should_mark_recomputable, mark_recomputable

namespace flame::autograd_detail {

extern thread_local bool t_recompute_cheap;

struct RecipeBody {
  const char* op = "";  // static: the op that wrote the output (for error messages)
  std::vector<SavedTensor> inputs;
  RecipeFn fn;
  // The output's storage as the version check sees it (Note [Recompute cheap], "Lifetime"): set
  // while the storage is alive, cleared under `mutex` by the storage's mark as the storage goes.
  mutable std::mutex mutex;
  mutable const Storage* storage = nullptr;
  uint64_t version = 0;                  // the output's storage version when marked
  Shape sizes, strides;  // the output's (non-overlapping and dense: it owns its storage whole)
  DType dtype = DType::f32;
  Device device;
  int depth = 1;  // recipes folded into this one, plus one (Note [Recompute cheap], "Chains")
};

// Storage::recipe: the mark, owned by the output's storage alone (nodes that save the output hold
// the body), so that it goes with the storage and clears the body's `storage`.
struct Recipe {
  std::shared_ptr<const RecipeBody> body;
  Recipe() = default;
  Recipe(const Recipe&) = delete;
  Recipe& operator=(const Recipe&) = delete;
  ~Recipe();
};

struct RecomputedSaved {
  std::shared_ptr<const RecipeBody> recipe;
  Shape sizes, strides;  // the saved tensor's view of the whole output (offset 0, dense)
};

// The recipe of t's storage when it still describes t's bytes (not written since the mark) and t
// is a dense view of all of them (offset 0: a reshape or a permutation); null otherwise (t is then
// saved as usual).
std::shared_ptr<const RecomputedSaved> recompute_saved(const Tensor& t);
// Reruns the recipe for a saved tensor; raises when the output or an input was written in place.
Tensor unpack_recomputed(const RecomputedSaved& r, uint64_t version, const char* op);

}  // namespace flame::autograd_detail
