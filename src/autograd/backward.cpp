// The backward pass: reverse topological walk of the graph behind a tensor, plus the saved-bytes
// accounting of a graph.
//
// Note [Backward order]
// Vertices are tensors taking part in autograd. A vertex is processed once every consumer of it in
// the reachable graph has delivered its contribution (dependency counts), so gradients of tensors
// used more than once are summed before hooks run or they reach the store or their node.
// Non-leaf vertices keep their count and pending sum in their node (Node::Scratch, tagged with the
// run id), leaves in a vector indexed through the edge's slot: the walk allocates nothing per
// vertex beyond the gradients themselves. A pending sum this pass made is added to in place; one
// that is still some rule's output (a pass-through such as add) is never written.
// Among the nodes whose gradients are complete, the one recorded LAST runs first (Node::seq, a
// max-heap, as PyTorch's sequence numbers): the backward walks the forward in reverse, so a
// branch that joins the main chain late (a DiT block's adaLN projection of the conditioning, an
// autocast cast of a weight) runs as soon as its layer is done, not after a depth-first descent
// to the bottom of the network. Parameters' gradients thus complete layer by layer, which is
// what post-accumulate hooks (DDP's buckets) need to overlap communication with the backward.
//
// Note [Accumulate base]
// A tensor used twice (the residual stream x of a DiT block feeds the gated residual and the
// adaLN norm) has its gradient summed here: the first contribution waits in pending, the second
// rule writes its own gradient, and add_into adds the two, one more pass over the tensor. A rule
// can take that add into its own kernel: recorded with Node::accept_accumulate_base(i), it is
// handed, just before it runs, the pending sum of input i (Node::accumulate_base(i)) and then
// returns base + its own gradient for that input, which replaces the pending sum instead of being
// added to it. The contract:
//  - Only a non-leaf vertex's pending sum of the edge's shape, dtype and device is handed (leaves
//    and the tensors of BackwardOptions::inputs are summed as before), at most one input per node,
//    and never while anomaly mode checks each rule's own gradient. The vertex's hooks still run
//    once, on the complete sum, when its last contribution arrives.
//  - The rule writes into the base only when Node::accumulate_base_owned() (this pass made that
//    buffer); otherwise it is some rule's pass-through that may be held elsewhere, and the rule
//    returns a fresh tensor. Its result for that input is the base itself (owned, written in place)
//    or a buffer nothing else holds: the pass owns it afterwards. Returning no gradient for that
//    input gives the base back unchanged. Whatever layout the base has, the rule may fall back to
//    composing base + gradient: the result is the same, only the fused add is lost.
// Note [Prepared gradients]
// A fused kernel may compute more than its own node's gradients: the adaLN backward of a DiT
// block holds the complete gradient of the residual h it normalised (Note [Fused residual
// backward] in src/ops/adaln.cpp), which is all the gated residual that produced h needs. The
// rule checks Node::completes_input(i) (its contribution is the last that vertex awaits and no
// other sum is pending there, so the tensor it returns becomes the vertex's gradient as is:
// the pending sum, if any, was handed to it as its base) and hands the producer's gradients over
// with Node::prepare(grads, returned), which holds `returned` itself (an address and a version
// alone could match a later tensor at a reused address). Hooks still run on the vertex's gradient before the
// producer's rule, so that rule validates with take_prepared(grad): the prepared gradients are
// used only when grad is the same tensor at the same version (a hook that returned another tensor
// or wrote this one in place, or a further contribution, makes it compute as usual). The stash
// lives in the producer's scratch: a new pass clears it, taking it empties it.
#include <atomic>
#include <cstdlib>
#include <queue>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "flame/ops.h"
#include "src/amp/autocast.h"
#include "src/autograd/anomaly.h"
#include "src/autograd/grad_release.h"
#include "src/autograd/record.h"
#include "src/core/profiler_context.h"

namespace flame {

namespace autograd_detail {
namespace {
thread_local bool t_release_leaf = false;  // Note [Gradient release]
}  // namespace
void release_leaf_gradient() { t_release_leaf = true; }
}  // namespace autograd_detail
using autograd_detail::t_release_leaf;

namespace {

// A node's scratch for backward `run`, discovered through vertex `meta`; the rest at its defaults.
Node::Scratch fresh_scratch(uint64_t run, AutogradMeta* meta) {
  Node::Scratch s;
  s.run = run;
  s.meta = meta;
  return s;
}

std::atomic<uint64_t> g_next_run{1};

struct LeafState {
  AutogradMeta* meta = nullptr;
  Tensor handle;  // the store's key
  Tensor pending;
  bool owned = false;
  bool stored = true;  // false: a leaf outside BackwardOptions::inputs (walked, not stored)
  int32_t deps = 0;
};

// pending += g: in place into a buffer this pass made, otherwise out of place.
// g is taken by value and moved in, so a rule's fresh result reaches the store with no other
// holder and is adopted without a copy (Note [Gradient ownership]).
void add_into(Tensor& pending, bool& owned, Tensor g) {
  if (!g.defined()) return;
  if (!pending.defined()) {
    pending = std::move(g);
    owned = false;
  } else if (owned && pending.sizes() == g.sizes() && pending.dtype() == g.dtype()) {
    pending.add_(g);
  } else {
    pending = pending + g;
    owned = true;
  }
}

// Note [Accumulate base]: read once from the environment, switched by tests.
std::atomic<bool>& accumulate_base_flag() {
  static std::atomic<bool> on = [] {
    const char* v = std::getenv("FLAME_FUSED_GRAD_ACCUMULATION");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

std::atomic<uint64_t> g_bases_handed{0}, g_bases_owned{0};

// Note [Accumulate base]: moves the pending sum of one input of `node` into node.scratch.base when
// its rule accepts one; returns the edge's index, or -1 when nothing was handed.
int hand_accumulate_base(Node& node) {
  if (!node.accepts_accumulate_base() || autograd_detail::t_state.anomaly ||
      !accumulate_base_flag().load(std::memory_order_relaxed))
    return -1;
  const std::span<const Node::Edge> edges = node.edges();
  for (std::size_t i = 0; i < edges.size(); ++i) {
    const Node::Edge& e = edges[i];
    if (!node.accepts_accumulate_base(i) || !e.meta || e.slot >= 0) continue;  // leaves: as before
    Node::Scratch& c = e.meta->grad_fn->scratch;
    Tensor& p = c.pending;
    if (!p.defined() || p.device() != e.device || p.dtype() != e.dtype || !(e.shape == p.sizes())) continue;
    node.scratch.base = std::move(p);
    p = Tensor();
    node.scratch.base_input = static_cast<int32_t>(i);
    node.scratch.base_owned = c.owned;
    g_bases_handed.fetch_add(1, std::memory_order_relaxed);
    if (c.owned) g_bases_owned.fetch_add(1, std::memory_order_relaxed);
    return static_cast<int>(i);
  }
  return -1;
}

Tensor run_hooks(AutogradMeta* m, Tensor g) {
  for (std::size_t i = 0; i < m->hooks.size(); ++i) {
    Tensor replaced = m->hooks[i](g);
    if (replaced.defined()) {
      FLAME_CHECK(replaced.sizes() == g.sizes(), "backward", "a hook returned a gradient of shape ", replaced.sizes(),
                  " for a tensor of shape ", g.sizes());
      FLAME_CHECK(!replaced.requires_grad(), "backward",
                  "a hook returned a gradient that requires grad: higher-order gradients are not supported");
      g = std::move(replaced);
    }
  }
  return g;
}

// Marks the thread as running gradient rules (see record(): nodes recorded meanwhile raise).
struct BackwardDepthGuard {
  BackwardDepthGuard() { ++autograd_detail::t_state.backward_depth; }
  ~BackwardDepthGuard() { --autograd_detail::t_state.backward_depth; }
};

}  // namespace

namespace autograd_detail {
bool accumulate_base_enabled() { return accumulate_base_flag().load(std::memory_order_relaxed); }
bool set_accumulate_base_enabled(bool on) { return accumulate_base_flag().exchange(on); }
AccumulateBaseCounts accumulate_base_counts() {
  return {g_bases_handed.load(std::memory_order_relaxed), g_bases_owned.load(std::memory_order_relaxed)};
}
}  // namespace autograd_detail

Gradients Tensor::backward() const { return backward(BackwardOptions{}); }

Gradients Tensor::backward(const BackwardOptions& options) const {
  FLAME_CHECK(requires_grad(), "backward", "the tensor (shape ", sizes(),
              ") does not require grad and has no grad_fn");
  Tensor seed = options.grad_output;
  if (seed.defined()) {
    FLAME_CHECK(seed.sizes() == sizes() && seed.device() == device(), "backward", "grad_output of shape ",
                seed.sizes(), " on ", seed.device().str(), " does not match the output's shape ", sizes(), " on ",
                device().str());
    FLAME_CHECK(!seed.requires_grad(), "backward",
                "grad_output requires grad: higher-order gradients are not supported (detach it)");
    if (seed.dtype() != dtype()) seed = seed.to(dtype());
  } else {
    FLAME_CHECK(numel() == 1, "backward", "grad can be implicitly created only for scalar outputs (shape ",
                sizes(), "); pass BackwardOptions::grad_output");
    seed = ones_like(*this);
  }

  // Tensors the caller wants gradients for (the walk stops there); empty: every leaf.
  std::unordered_map<AutogradMeta*, Tensor> stops;
  for (const Tensor& t : options.inputs) {
    FLAME_CHECK(t.defined() && t.requires_grad(), "backward",
                "BackwardOptions::inputs holds a tensor that does not require grad (shape ",
                t.defined() ? t.sizes() : Shape{}, ")");
    stops.emplace(t.impl()->autograd.get(), t);
  }
  const bool only_inputs = !options.inputs.empty();

  const uint64_t run = g_next_run.fetch_add(1, std::memory_order_relaxed);
  std::vector<LeafState> leaves;
  std::unordered_map<AutogradMeta*, int32_t> leaf_index;
  auto leaf_slot = [&](AutogradMeta* m, const Tensor& handle) {
    auto [it, inserted] = leaf_index.try_emplace(m, static_cast<int32_t>(leaves.size()));
    if (inserted) {
      LeafState& l = leaves.emplace_back();
      l.meta = m;
      auto s = stops.find(m);
      l.handle = s != stops.end() ? s->second : handle;
      l.stored = !only_inputs || s != stops.end();
    }
    return it->second;
  };
  auto is_stop = [&](AutogradMeta* m) { return only_inputs && stops.count(m) != 0; };

  // Discover the reachable graph and count the consumers of each vertex.
  AutogradMeta* root = impl_->autograd.get();
  std::vector<Node*> discovered;
  int32_t root_leaf = -1;
  if (!root->grad_fn || is_stop(root)) {
    root_leaf = leaf_slot(root, *this);
  } else {
    Node* n = root->grad_fn.get();
    FLAME_CHECK(!n->released(), "backward", "trying to backward through the graph a second time (op ", n->name(),
                "): pass retain_graph = true to the first backward");
    n->scratch = fresh_scratch(run, root);
    discovered.push_back(n);
    for (std::size_t k = 0; k < discovered.size(); ++k) {
      for (const Node::Edge& e : discovered[k]->edges()) {
        AutogradMeta* m = e.meta.get();
        if (!m) continue;
        if (!m->grad_fn || is_stop(m)) {
          e.slot = leaf_slot(m, e.leaf);
          ++leaves[static_cast<std::size_t>(e.slot)].deps;
          continue;
        }
        e.slot = -1;
        Node* c = m->grad_fn.get();
        if (c->scratch.run != run) {
          FLAME_CHECK(!c->released(), "backward", "trying to backward through the graph a second time (op ",
                      c->name(), "): pass retain_graph = true to the first backward");
          c->scratch = fresh_scratch(run, m);
          discovered.push_back(c);
        }
        ++c->scratch.deps;
      }
    }
  }

  Gradients local;
  Gradients& store = options.accumulate_into ? *options.accumulate_into : local;
  NoGradGuard no_grad;  // gradient rules are not recorded (no higher-order gradients)
  amp::detail::AutocastOffGuard no_autocast;  // rules and hooks run in the dtypes they are given

  auto finish_leaf = [&](LeafState& l) {
    Tensor g = std::move(l.pending);
    l.pending = Tensor();
    if (!g.defined()) return;
    g = run_hooks(l.meta, std::move(g));
    if (!l.stored) return;
    // The store keeps it in the leaf's layout (Note [Gradient layout] in engine.cpp): adopted
    // when it already is and nothing else holds it, copied otherwise.
    store.accumulate(l.handle, std::move(g));
    if (!l.meta->post_accumulate_hooks.empty()) {
      t_release_leaf = false;
      {
        const Tensor accumulated = store.get(l.handle);
        for (const auto& hook : l.meta->post_accumulate_hooks) hook(accumulated);
      }
      // Note [Gradient release] (grad_release.h): a hook took the gradient.
      if (t_release_leaf) store.erase(l.handle);
      t_release_leaf = false;
    }
  };

  auto later_first = [](const Node* a, const Node* b) { return a->seq < b->seq; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  auto deliver = [&](const Node::Edge& e, Tensor gi) {
    if (e.slot >= 0) {
      LeafState& l = leaves[static_cast<std::size_t>(e.slot)];
      add_into(l.pending, l.owned, std::move(gi));
      if (--l.deps == 0) finish_leaf(l);
      return;
    }
    Node* c = e.meta->grad_fn.get();
    add_into(c->scratch.pending, c->scratch.owned, std::move(gi));
    if (--c->scratch.deps == 0) ready.push(c);
  };
  // Note [Accumulate base]: the rule's base + gradient replaces the pending sum it was taken from
  // (another edge of the same node may have delivered to that vertex meanwhile: then it is added).
  auto deliver_based = [&](const Node::Edge& e, Tensor gi, bool owned) {
    Node* c = e.meta->grad_fn.get();
    if (c->scratch.pending.defined()) {
      add_into(c->scratch.pending, c->scratch.owned, std::move(gi));
    } else {
      c->scratch.pending = std::move(gi);
      c->scratch.owned = owned;
    }
    if (--c->scratch.deps == 0) ready.push(c);
  };

  try {
    if (root_leaf >= 0) {
      leaves[static_cast<std::size_t>(root_leaf)].pending = seed;
      finish_leaf(leaves[static_cast<std::size_t>(root_leaf)]);
    } else {
      discovered.front()->scratch.pending = seed;
      ready.push(discovered.front());
    }
    while (!ready.empty()) {
      Node& node = *ready.top();
      ready.pop();
      // Memory the node's rule, hooks and deliveries allocate is charged to the node
      // (Note [Allocation context] in src/profiler/memory_profiler.cpp).
      profiler_detail::BackwardNodeScope attribution(node.name(), node.module_path);
      Tensor g = std::move(node.scratch.pending);
      node.scratch.pending = Tensor();
      AutogradMeta* m = node.scratch.meta;
      if (g.defined()) g = run_hooks(m, std::move(g));
      if (!options.retain_graph && !m->hooks.empty()) {
        // The graph is freed: so are the hooks of its non-leaf tensors (a hook capturing its own
        // tensor would otherwise keep it alive through its own autograd state).
        std::vector<GradHook> dropped = std::move(m->hooks);
        m->hooks.clear();
      }
      const std::span<const Node::Edge> edges = node.edges();
      if (!g.defined()) {
        // Nothing arrived: pass "nothing" on, so that the counts of the inputs still reach zero
        // and their other contributions are not lost.
        for (const Node::Edge& e : edges) {
          if (e.meta) deliver(e, Tensor());
        }
      } else {
        TensorList grads;
        const int based = hand_accumulate_base(node);
        {
          BackwardDepthGuard depth;
          grads = node.apply(g);
        }
        Tensor base;
        bool base_owned = false;
        if (based >= 0) {
          base = std::move(node.scratch.base);
          node.scratch.base = Tensor();
          node.scratch.base_input = -1;
          base_owned = node.scratch.base_owned;
        }
        // Note [Anomaly mode] (anomaly.cpp): check what the rule returned before it is summed.
        if (autograd_detail::t_state.anomaly) [[unlikely]] anomaly_detail::check_backward(node, g, grads);
        g = Tensor();
        FLAME_CHECK(grads.size() == edges.size(), "backward", "gradient rule of ", node.name(), " returned ",
                    grads.size(), " gradients for ", edges.size(), " inputs");
        for (std::size_t i = 0; i < grads.size(); ++i) {
          const Node::Edge& e = edges[i];
          if (!e.meta) continue;
          Tensor& gi = grads[i];
          if (gi.defined()) {
            FLAME_CHECK(gi.sizes() == e.shape, "backward", "gradient rule of ", node.name(), " produced shape ",
                        gi.sizes(), " for input ", i, " of shape ", e.shape);
            if (gi.dtype() != e.dtype) gi = gi.to(e.dtype);
          }
          if (static_cast<int>(i) == based) {
            // The sum the rule returned is the base written in place or a buffer of its own.
            if (!gi.defined()) {
              deliver_based(e, std::move(base), base_owned);
            } else {
              const bool same = gi.impl()->storage == base.impl()->storage;
              base = Tensor();
              deliver_based(e, std::move(gi), same ? base_owned : true);
            }
            continue;
          }
          deliver(e, std::move(gi));
        }
      }
      if (!options.retain_graph) node.release();
    }
  } catch (...) {
    // Leave no gradient behind in the nodes of a graph that may live on.
    for (Node* n : discovered) {
      n->scratch.pending = Tensor();
      n->scratch.base = Tensor();
      n->scratch.base_input = -1;
      n->scratch.prepared = TensorList();  // Note [Prepared gradients]
      n->scratch.prepared_for = Tensor();
    }
    throw;
  }
  if (options.accumulate_into) return Gradients();
  return local;
}

std::size_t autograd_saved_bytes(const Tensor& root) {
  FLAME_CHECK(root.defined(), "autograd_saved_bytes", "undefined tensor");
  const AutogradMeta* m = root.impl()->autograd.get();
  if (!m || !m->grad_fn) return 0;
  std::unordered_set<const Node*> seen = {m->grad_fn.get()};
  std::vector<const Node*> stack = {m->grad_fn.get()};
  std::unordered_set<const Storage*> storages;
  std::size_t bytes = 0;
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    for (const SavedTensor& s : n->saved_tensors()) {
      if (s.recomputed()) {  // Note [Recompute cheap]: what its recipe holds
        for (const Tensor& t : s.recipe_inputs()) {
          if (storages.insert(t.impl()->storage.get()).second) bytes += t.impl()->storage->nbytes;
        }
      }
      if (!s.defined()) continue;
      const Storage* st = s.raw().impl()->storage.get();
      if (storages.insert(st).second) bytes += st->nbytes;
    }
    for (const Node::Edge& e : n->edges()) {
      if (e.meta && e.meta->grad_fn && seen.insert(e.meta->grad_fn.get()).second) stack.push_back(e.meta->grad_fn.get());
    }
  }
  return bytes;
}

}  // namespace flame
