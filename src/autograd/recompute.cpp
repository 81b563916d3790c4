// Selective recompute of cheap saved tensors: autograd::RecomputeCheap (include/flame/recompute.h).
//
// Note [Recompute cheap]
// Activation memory of a training step is mostly tensors saved for the weight gradients of the
// next layer: the input of a linear layer is often the output of a normalisation that costs one
// pass over memory to redo. While RecomputeCheap is on, such an op (F::layer_norm_modulate,
// layer_norm, rms_norm, group_norm, the unary activations whose gradient reads only their
// input: gelu, silu, ..., recomputable_activation in rules/elementwise.cpp, where the unary node is
// recorded; rotary_embedding and cat where worth_a_recipe says so) marks its output, as one op
// (the ops of its composite path do not): Storage::recipe holds the op's inputs as SavedTensors
// and a function that reruns the op. The mark sits on the storage, not the tensor, because the
// consumer usually saves a view of the output it made itself (a reshape to [rows, in] under
// no-grad). Only an output that requires grad is marked: then the op's own node saves the
// inputs the recipe holds (x, and the weight of a norm), so the recipe costs no bytes beyond a
// norm's bias; an op that was not recorded would leave the recipe the only holder of its inputs.
//  - Save: SavedTensor's constructor sees the storage's recipe and, where saved-tensor hooks
//    would apply (not a tensor kept for its identity, as checkpoint's captures, and not a leaf
//    that requires grad), keeps a RecomputedSaved instead of the tensor when the recipe still
//    describes the bytes (neither the output nor an input written since the mark) and the saved
//    tensor is a view of all of them: offset 0, the element count, non-overlapping and dense (a
//    reshape, or a permutation such as attention's [B, H, S, D] view of a [B, S, H, D] output);
//    any other view (a slice) is saved as usual. The output itself may be any dense layout; the
//    recomputed one is brought to it before the saved view is taken again. Then nothing keeps
//    the output alive but its ordinary users, and it goes back to the pool when the forward no
//    longer needs it.
//  - Get: the output's storage, while still alive, must have the version the save saw (an
//    in-place write after the save raises as for an ordinary saved tensor); the recipe inputs
//    are version-checked by their own SavedTensor::get(). The recipe then runs with grad mode
//    off, autocast excluded (the op already received the dtypes it computed in) and marking
//    off, and its result must have the output's shape, dtype and device. Recipes rerun the same
//    kernels on the same inputs, so the recomputed values are the forward's bit for bit; one
//    exception: an adaLN that saved x-hat (Note [Saved x-hat] in src/ops/adaln.cpp) redoes its
//    output from the rounded x-hat, within one rounding of the forward's.
//  - Inputs are held detached (no graph is kept alive through a storage) as plain tensors, not
//    packed by saved-tensor hooks (they are mostly tensors the op's own node saves anyway;
//    offloading them twice would cost a second copy). autograd_saved_bytes() counts them.
//  - Chains: an input that is itself a marked output (its recipe still describing its bytes) is
//    not held: the recipe takes that input's recipe inputs instead and reruns both ops. The op's
//    own node saves such an input as a recipe too, so holding it here would be the one thing
//    keeping it alive. This is what makes autocast's widening casts worth marking: a norm under
//    autocast computes on an f32 copy of its bf16 input, its node saves the copy and its output's
//    recipe reads it; with the cast marked, both keep the bf16 input (half the bytes) and cast it
//    again in the backward (exact). A chain is at most kMaxRecipeDepth ops long (a longer one
//    holds its input), so no saved tensor costs more than a few cheap passes to redo.
//  - Lifetime: the recipe (RecipeBody) lives as long as the output's storage or a node that saved
//    it. A caller who keeps the output also keeps the recipe's inputs: mark only inside a training
//    forward. Nothing of the recipe refers to the storage's shared_ptr, not even weakly: a CPU
//    storage lives in its data block with its control block (Note [Storage in its block] in
//    src/backend/cpu/cpu_allocator.cpp), so a weak_ptr would hold the output's bytes until the
//    backward. The storage owns its mark (Storage::recipe) alone; the mark's destructor, which
//    runs as the storage goes, clears the body's storage pointer that the version check reads
//    under the body's mutex.
//  - The recipe launches ordinary ops on the current stream, so a backward under CUDA-graph
//    capture records them like any other rule's work.
#include "src/autograd/recompute.h"

#include <algorithm>
#include <string>
#include <vector>

#include "flame/recompute.h"
#include "src/amp/autocast.h"
#include "src/autograd/record.h"
#include "src/core/tensor_impl.h"

namespace flame {

namespace autograd_detail {
thread_local bool t_recompute_cheap = false;
}  // namespace autograd_detail

namespace autograd {
RecomputeCheap::RecomputeCheap(bool enabled) : previous_(autograd_detail::t_recompute_cheap) {
  autograd_detail::t_recompute_cheap = enabled;
}
RecomputeCheap::~RecomputeCheap() { autograd_detail::t_recompute_cheap = previous_; }
bool recompute_cheap_enabled() { return autograd_detail::t_recompute_cheap; }
}  // namespace autograd

namespace autograd_detail {

bool should_mark_recomputable() { return t_recompute_cheap && grad_enabled(); }

MarkingOff::MarkingOff() : previous_(t_recompute_cheap) { t_recompute_cheap = false; }
MarkingOff::~MarkingOff() { t_recompute_cheap = previous_; }

namespace {
constexpr int kMaxRecipeDepth = 4;  // Note [Recompute cheap], "Chains"

// The view (sizes, strides, offset 0) a node saved of a marked output, taken again of the
// recomputed output y, which must have the output's shape, dtype and device (`op`: the node that
// saved it, for the error). y is first brought to the output's own layout where the recipe returned
// another (the same kernels give the same layout, so this copies nothing in practice).
Tensor view_of_recomputed(const RecipeBody& r, Tensor y, const Shape& sizes, const Shape& strides, const char* op) {
  FLAME_CHECK(y.defined() && y.sizes() == r.sizes && y.dtype() == r.dtype && y.device() == r.device,
              "autograd::RecomputeCheap", "the recipe of ", r.op, " must return shape ", r.sizes, ", dtype ",
              dtype_name(r.dtype), " and device ", r.device.str(), "; got ",
              y.defined() ? shape_str(y.sizes()) + " " + dtype_name(y.dtype()) + " " + y.device().str()
                          : std::string("an undefined tensor"),
              " (saved for ", op, ")");
  bool same = true;
  for (std::size_t d = 0; d < r.sizes.size(); ++d) same = same && (r.sizes[d] == 1 || y.strides()[d] == r.strides[d]);
  if (!same || !is_non_overlapping_and_dense(y)) {
    Tensor laid = make_empty_strided(r.sizes, r.strides, y.dtype(), y.device(), "autograd::RecomputeCheap");
    laid.copy_(y);
    y = std::move(laid);
  }
  return make_view(y, sizes, strides, y.storage_offset(), "autograd::RecomputeCheap");
}

// The recipe of an input that is a marked output and can be folded into a new recipe, or null.
std::shared_ptr<const RecipeBody> foldable_recipe(const Tensor& t) {
  if (!t.defined() || !t.impl()->storage || !t.impl()->storage->recipe) return nullptr;
  const std::shared_ptr<const RecomputedSaved> s = recompute_saved(t);
  if (!s || s->recipe->depth >= kMaxRecipeDepth) return nullptr;
  return s->recipe;
}
}  // namespace

bool worth_a_recipe(const TensorList& inputs) {
  std::size_t held = 0, all = 0;
  for (const Tensor& t : inputs) {
    if (!t.defined()) continue;
    const std::size_t bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype());
    all += bytes;
    if (!foldable_recipe(t)) held += bytes;
  }
  return 2 * held < all;
}

void mark_recomputable(const Tensor& out, const char* op, const TensorList& given, RecipeFn given_fn) {
  // An output that needs no gradient had no node record its op, so nothing else holds the recipe's
  // inputs: keeping them instead of the output would gain nothing (or cost, for wider inputs).
  if (!out.defined() || out.numel() == 0 || !out.requires_grad()) return;
  const TensorImpl& impl = *out.impl();
  if (!impl.storage || impl.offset != 0 || !is_non_overlapping_and_dense(out) ||
      impl.storage->nbytes != static_cast<std::size_t>(out.numel()) * dtype_size(out.dtype()))
    return;  // not the sole content of its storage: nothing to gain, keep it saved as is
  // Chains: inputs that are marked outputs are replaced by their recipes' inputs.
  struct Fold {
    std::size_t index = 0, count = 0;  // the input folded, and how many recipe inputs replace it
    std::shared_ptr<const RecipeBody> body;
    Shape sizes, strides;  // the input's view of the whole output of `body`
  };
  std::vector<Fold> folds;
  TensorList inputs;
  int depth = 1;
  for (std::size_t i = 0; i < given.size(); ++i) {
    std::shared_ptr<const RecipeBody> inner = foldable_recipe(given[i]);
    if (!inner) {
      inputs.push_back(given[i]);
      continue;
    }
    folds.push_back({i, inner->inputs.size(), inner, given[i].sizes(), given[i].strides()});
    for (const SavedTensor& t : inner->inputs) inputs.push_back(t.raw());
    depth = std::max(depth, inner->depth + 1);
  }
  RecipeFn fn = std::move(given_fn);
  if (!folds.empty()) {
    fn = [folds = std::move(folds), n = given.size(), outer = std::move(fn)](const TensorList& in) {
      TensorList args;
      args.reserve(n);
      std::size_t k = 0, f = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (f < folds.size() && folds[f].index == i) {
          const TensorList sub(in.begin() + static_cast<std::ptrdiff_t>(k),
                               in.begin() + static_cast<std::ptrdiff_t>(k + folds[f].count));
          const Fold& fold = folds[f];
          args.push_back(
              view_of_recomputed(*fold.body, fold.body->fn(sub), fold.sizes, fold.strides, "a chained recipe"));
          k += folds[f].count;
          ++f;
        } else {
          args.push_back(in[k++]);
        }
      }
      return outer(args);
    };
  }
  auto r = std::make_shared<RecipeBody>();
  r->depth = depth;
  r->op = op;
  r->inputs.reserve(inputs.size());
  for (const Tensor& t : inputs) r->inputs.emplace_back(t, op, /*detach=*/true, /*allow_hooks=*/false);
  r->fn = std::move(fn);
  r->storage = impl.storage.get();
  r->version = impl.storage->version.load();
  r->sizes = out.sizes();
  r->strides = out.strides();
  r->dtype = out.dtype();
  r->device = out.device();
  auto mark = std::make_shared<Recipe>();
  mark->body = std::move(r);
  impl.storage->recipe = std::move(mark);
}

Recipe::~Recipe() {
  if (!body) return;
  std::lock_guard<std::mutex> lock(body->mutex);
  body->storage = nullptr;
}

std::shared_ptr<const RecomputedSaved> recompute_saved(const Tensor& t) {
  const TensorImpl& impl = *t.impl();
  const std::shared_ptr<const RecipeBody>& r = impl.storage->recipe->body;
  if (impl.storage->version.load() != r->version || impl.offset != 0 || t.dtype() != r->dtype ||
      t.numel() != shape_numel(r->sizes) || !is_non_overlapping_and_dense(t))
    return nullptr;
  for (const SavedTensor& in : r->inputs) {  // an input written since the op ran: the recipe is stale
    if (in.defined() && in.raw().version() != in.saved_version()) return nullptr;
  }
  auto s = std::make_shared<RecomputedSaved>();
  s->recipe = r;
  s->sizes = t.sizes();
  s->strides = t.strides();
  return s;
}

namespace {
// Grad mode off, autocast excluded and no marking while a recipe runs; restored on error.
class RecipeScope {
 public:
  RecipeScope() : previous_(t_recompute_cheap) { t_recompute_cheap = false; }
  ~RecipeScope() { t_recompute_cheap = previous_; }
  RecipeScope(const RecipeScope&) = delete;
  RecipeScope& operator=(const RecipeScope&) = delete;

 private:
  bool previous_;
  NoGradGuard no_grad_;
  amp::detail::AutocastOpScope no_autocast_;
};
}  // namespace

Tensor unpack_recomputed(const RecomputedSaved& s, uint64_t version, const char* op) {
  const RecipeBody& r = *s.recipe;
  uint64_t now = version;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.storage) now = r.storage->version.load();  // the output is still alive
  }
  FLAME_CHECK(now == version, "backward", "a tensor saved for the gradient of ", op, " (shape ", s.sizes,
              ", recomputable output of ", r.op, ") was modified by an in-place op: its version is ", now,
              ", expected ", version);
  TensorList in;
  in.reserve(r.inputs.size());
  for (const SavedTensor& t : r.inputs) {
    try {
      in.push_back(t.get());
    } catch (const Error& e) {  // say which saved tensor needed it: the user never saved this input
      std::string what = e.what();
      if (what.rfind("backward: ", 0) == 0) what.erase(0, 10);
      what = "backward: " + what + " (an input of the recipe that recomputes the output of " + r.op + ", saved for " +
             op + " under autograd::RecomputeCheap)";
      if (dynamic_cast<const OutOfMemoryError*>(&e) != nullptr) throw OutOfMemoryError(what);
      throw Error(what);
    }
  }
  Tensor y;
  {
    RecipeScope scope;
    y = r.fn(in);
  }
  return view_of_recomputed(r, std::move(y), s.sizes, s.strides, op);
}

}  // namespace autograd_detail

TensorList SavedTensor::recipe_inputs() const {
  TensorList out;
  if (!recomputed_) return out;
  for (const SavedTensor& t : recomputed_->recipe->inputs) {  // held as plain tensors (never recipes)
    if (t.defined()) out.push_back(t.raw());
  }
  return out;
}

}  // namespace flame
