// flame::compile: signatures, plans of fused regions, replay with autograd, fallbacks.
//
// Note [Fused regions]
// A plan has one region per distinct value the function returns: the expression DAG that
// computes it from the graph's leaves (inputs, views of inputs, captured constants), cut at the
// leaves. Each region is one generated kernel (one CPU interpretation off the GPU); values inside
// it are never written to memory, and a value two outputs share is recomputed by both regions
// rather than stored (elementwise work is bandwidth-bound: a recompute is cheaper than a store and
// a load). A region whose inputs require grad is one autograd node ("FusedBackward") whose
// backward is another generated kernel (Note [Fused backward] in autodiff.cpp); the node saves
// only the region inputs that kernel reads.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

#include "flame/autograd.h"
#include "flame/compile.h"
#include "src/amp/autocast.h"
#include "src/autograd/record.h"
#include "src/compile/ir.h"
#include "src/compile/trace.h"
#include "src/core/tensor_impl.h"

namespace flame {
namespace compile_detail {

void forget_expr_kernels(const Expr* e);
extern std::atomic<int64_t> g_kernel_launches;

struct Region {
  Expr fwd;
  std::vector<int> leaves;  // graph node (an input or an eager op) feeding each input slot
  int fused_ops = 0;
  bool has_bwd = false;
  Expr bwd;                       // inputs: fwd slots in bwd_inputs, then the output's gradient
  std::vector<int> wanted;        // fwd slots whose gradient bwd computes (one output each)
  std::vector<int> bwd_inputs;    // fwd slots bwd reads
  std::vector<int> grad_index;    // per wanted slot: its bwd output, or -1: the output gradient itself
  std::vector<DType> slot_dtypes;
  std::string bwd_error;
  Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() {
    forget_expr_kernels(&fwd);
    forget_expr_kernels(&bwd);
  }
};

// Note [Plan steps]: regions and eager ops run in the order of their graph node ids (a
// topological order), each storing its result under its node id, so every step finds its operands
// there: inputs, earlier eager ops' results, earlier regions' roots.
struct Plan {
  std::vector<LeafSpec> leaves;
  std::vector<int> leaf_node;  // graph node of each leaf
  std::vector<EagerOp> eager_ops;
  std::vector<std::unique_ptr<Region>> regions;
  struct Step {
    int node = -1;    // where the result is stored
    int region = -1;  // a fused region, or
    int eager = -1;   // an eager op
  };
  std::vector<Step> steps;
  std::vector<int> outputs;  // graph node ids
  std::size_t num_nodes = 0;
  std::string fail;
  int64_t fused_ops = 0;
  int64_t saved_inputs = 0;
};

struct Counters {
  std::atomic<int64_t> launches{0}, backward{0};
};

namespace {

std::unique_ptr<Region> make_region(const Graph& g, int root, bool grad_mode) {
  auto r = std::make_unique<Region>();
  std::set<int> reach;
  std::vector<int> stack{root};
  while (!stack.empty()) {
    const int i = stack.back();
    stack.pop_back();
    if (!reach.insert(i).second) continue;
    const ExprNode& n = g.nodes[i];
    if (n.op == ExprOp::eager) continue;  // its result is an input of the region
    for (int o : {n.a, n.b, n.c}) {
      if (o >= 0) stack.push_back(o);
    }
  }
  std::vector<int> local(g.nodes.size(), -1);
  for (int i : reach) {  // ascending: operands before users
    ExprNode n = g.nodes[i];
    if (n.op == ExprOp::input || n.op == ExprOp::eager) {
      r->leaves.push_back(i);
      n = ExprNode{};
      n.op = ExprOp::input;
      n.dtype = g.nodes[i].dtype;
      n.shape = g.nodes[i].shape;
      n.slot = static_cast<int>(r->leaves.size()) - 1;
    } else {
      ++r->fused_ops;
    }
    if (n.a >= 0) n.a = local[n.a];
    if (n.b >= 0) n.b = local[n.b];
    if (n.c >= 0) n.c = local[n.c];
    local[i] = r->fwd.add(std::move(n));
  }
  r->fwd.num_inputs = static_cast<int>(r->leaves.size());
  r->fwd.outputs = {local[root]};
  r->fwd.shape = g.nodes[root].shape;
  if (!grad_mode || !is_floating(g.nodes[root].dtype)) return r;
  std::vector<DType> dtypes;
  for (int s = 0; s < r->fwd.num_inputs; ++s) {
    const DType dt = g.nodes[r->leaves[s]].dtype;
    dtypes.push_back(dt);
    if (is_floating(dt)) r->wanted.push_back(s);
  }
  try {
    std::vector<bool> reads;
    Expr d = derivative_expr(r->fwd, r->wanted, dtypes, &reads);
    // Compact the input slots to what the backward reads (Note [Fused backward]).
    std::vector<int> remap(d.num_inputs, -1);
    for (int s = 0; s < r->fwd.num_inputs; ++s) {
      if (reads[s]) {
        remap[s] = static_cast<int>(r->bwd_inputs.size());
        r->bwd_inputs.push_back(s);
      }
    }
    remap[r->fwd.num_inputs] = static_cast<int>(r->bwd_inputs.size());
    for (ExprNode& n : d.nodes) {
      if (n.op == ExprOp::input) n.slot = remap[n.slot];
    }
    d.num_inputs = static_cast<int>(r->bwd_inputs.size()) + 1;
    // One kernel output per distinct gradient value (x + b: x and b get the same one), none for a
    // gradient that is the output gradient itself (x + y: both).
    std::vector<int> distinct;
    for (std::size_t w = 0; w < r->wanted.size(); ++w) {
      const int node = d.outputs[w];
      const ExprNode& n = d.nodes[node];
      if (n.op == ExprOp::input && n.slot == d.num_inputs - 1) {
        r->grad_index.push_back(-1);
        continue;
      }
      auto it = std::find(distinct.begin(), distinct.end(), node);
      r->grad_index.push_back(static_cast<int>(it - distinct.begin()));
      if (it == distinct.end()) distinct.push_back(node);
    }
    d.outputs = std::move(distinct);
    r->slot_dtypes = dtypes;
    r->bwd = std::move(d);
    r->has_bwd = true;
  } catch (const Error& e) {
    r->bwd_error = e.what();
  }
  return r;
}

std::shared_ptr<Plan> make_plan(Graph g, bool grad_mode) {
  auto p = std::make_shared<Plan>();
  p->fail = g.fail;
  if (!p->fail.empty()) return p;
  // Live values (the outputs and what they are computed from; ops inside traced ops, such as the
  // views an op makes of its operands, are dead) and, among them, the values that must exist as
  // tensors: the outputs and the live eager ops' operands.
  const int count = static_cast<int>(g.nodes.size());
  std::vector<bool> live(g.nodes.size(), false), needed(g.nodes.size(), false);
  for (int o : g.outputs) live[o] = needed[o] = true;
  for (int i = count - 1; i >= 0; --i) {
    if (!live[i]) continue;
    const ExprNode& n = g.nodes[i];
    if (n.op == ExprOp::eager) {
      for (int in : g.eager_ops[n.slot].inputs) {
        if (in >= 0) live[in] = needed[in] = true;
      }
    } else {
      for (int o : {n.a, n.b, n.c}) {
        if (o >= 0) live[o] = true;
      }
    }
  }
  p->leaf_node.assign(g.leaves.size(), -1);
  for (int i = 0; i < count; ++i) {
    const ExprNode& n = g.nodes[i];
    if (n.op == ExprOp::input) {
      p->leaf_node[n.slot] = i;
      continue;
    }
    if (!live[i]) continue;
    if (n.op == ExprOp::eager) {
      Plan::Step st;
      st.node = i;
      st.eager = n.slot;
      p->steps.push_back(st);
      continue;
    }
    if (!needed[i]) continue;
    auto r = make_region(g, i, grad_mode);
    if (!r->bwd_error.empty()) {
      for (int s : r->wanted) {
        if (g.requires_grad[r->leaves[s]]) {
          p->fail = r->bwd_error;
          return p;
        }
      }
    }
    p->fused_ops += r->fused_ops;
    p->saved_inputs += static_cast<int64_t>(r->bwd_inputs.size());
    Plan::Step st;
    st.node = i;
    st.region = static_cast<int>(p->regions.size());
    p->steps.push_back(st);
    p->regions.push_back(std::move(r));
  }
  p->outputs = g.outputs;
  p->num_nodes = g.nodes.size();
  p->leaves = std::move(g.leaves);
  p->eager_ops = std::move(g.eager_ops);
  return p;
}

Tensor run_region(const std::shared_ptr<Plan>& plan, const Region& r, const TensorList& ins,
                  const std::shared_ptr<Counters>& counters, const std::string& tag) {
  bool need = false;
  if (grad_enabled()) {
    for (const Tensor& t : ins) need = need || t.requires_grad();
  }
  Tensor out;
  {
    NoGradGuard no_grad;
    out = run_expr(r.fwd, ins, tag)[0];
  }
  ++counters->launches;
  if (!need || !r.has_bwd) return out;
  std::vector<SavedTensor> saved;
  for (int s : r.bwd_inputs) saved.emplace_back(ins[s], "FusedBackward");
  std::vector<Shape> shapes;
  for (const Tensor& t : ins) shapes.push_back(t.sizes());
  const Region* rp = &r;
  const std::size_t n_in = ins.size();
  record(out, "FusedBackward", ins,
         [plan, rp, saved, shapes, n_in, counters, tag](const Tensor& g) {
           TensorList bins;
           for (const SavedTensor& s : saved) bins.push_back(s.get());
           bins.push_back(g);
           TensorList full;
           if (!rp->bwd.outputs.empty()) {
             NoGradGuard no_grad;
             full = run_expr(rp->bwd, bins, tag + "_backward");
             ++counters->backward;
           }
           TensorList grads(n_in);
           for (std::size_t w = 0; w < rp->wanted.size(); ++w) {
             const int s = rp->wanted[w];
             const int k = rp->grad_index[w];
             const DType dt = rp->slot_dtypes[s];
             const Tensor gw = k >= 0 ? full[k] : (g.dtype() == dt ? g : g.to(dt));
             grads[s] = sum_to(gw, shapes[s]);
           }
           return grads;
         });
  return out;
}

}  // namespace
}  // namespace compile_detail

using compile_detail::Plan;

struct CompiledFunction::Impl {
  Fn fn;
  CompileOptions options;
  std::shared_ptr<compile_detail::Counters> counters = std::make_shared<compile_detail::Counters>();
  mutable std::mutex mu;
  struct Entry {
    std::string key;
    std::shared_ptr<Plan> plan;
    uint64_t used = 0;
    bool logged = false;
  };
  std::vector<Entry> entries;
  uint64_t clock = 0;
  CompileStats stats;
  std::shared_ptr<Plan> last;
  std::vector<compile_detail::OperandLayout> last_inputs;  // for last_kernel_sources (no tensor held)
};

namespace {

std::string signature(const TensorList& inputs) {
  std::string k;
  k += grad_enabled() ? "g1" : "g0";
  const amp::detail::AutocastState ac = amp::detail::autocast_state();
  k += "|ac" + std::to_string(ac.mask) + "," + dtype_name(ac.dtype[0]) + "," + dtype_name(ac.dtype[1]);
  for (const Tensor& t : inputs) {
    k += '|';
    if (!t.defined()) {
      k += "undef";
      continue;
    }
    k += dtype_name(t.dtype());
    k += '@' + t.device().str();
    k += t.requires_grad() ? "+rg" : "";
    k += 's';
    for (int64_t s : t.sizes()) k += ',' + std::to_string(s);
    k += 't';
    for (int64_t s : t.strides()) k += ',' + std::to_string(s);
  }
  return k;
}

}  // namespace

CompiledFunction::CompiledFunction(Fn fn, CompileOptions options) : impl_(std::make_shared<Impl>()) {
  FLAME_CHECK(static_cast<bool>(fn), "compile", "got an empty function");
  FLAME_CHECK(options.max_signatures >= 1, "compile", "max_signatures must be at least 1");
  impl_->fn = std::move(fn);
  impl_->options = std::move(options);
}

CompiledFunction compile(CompiledFunction::Fn fn, CompileOptions options) {
  return CompiledFunction(std::move(fn), std::move(options));
}

TensorList CompiledFunction::operator()(const TensorList& inputs) const {
  FLAME_CHECK(impl_ != nullptr, "CompiledFunction", "called on a default-constructed CompiledFunction");
  Impl& im = *impl_;
  // Inside another trace: run the ops so that the outer trace records them.
  if (compile_detail::active_tracer() != nullptr) return im.fn(inputs);
  const std::string key = signature(inputs);
  std::shared_ptr<Plan> plan;
  Impl::Entry* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    for (auto& e : im.entries) {
      if (e.key == key) {
        e.used = ++im.clock;
        plan = e.plan;
        entry = &e;
      }
    }
  }
  if (!plan) {
    compile_detail::Tracer tracer(inputs, grad_enabled());
    TensorList outs;
    {
      compile_detail::TracerScope scope(&tracer);
      outs = im.fn(inputs);
    }
    tracer.finish(outs);
    plan = compile_detail::make_plan(std::move(tracer.graph), grad_enabled());
    std::lock_guard<std::mutex> lock(im.mu);
    if (im.entries.size() >= im.options.max_signatures) {
      auto oldest = std::min_element(im.entries.begin(), im.entries.end(),
                                     [](const Impl::Entry& a, const Impl::Entry& b) { return a.used < b.used; });
      im.entries.erase(oldest);
      ++im.stats.evictions;
    }
    im.entries.push_back(Impl::Entry{key, plan, ++im.clock, false});
    ++im.stats.traces;
    ++im.stats.eager_calls;
    im.last = plan;
    im.last_inputs = compile_detail::layouts_of(inputs);
    if (!plan->fail.empty() && im.options.log_fallbacks) {
      std::fprintf(stderr, "flame::compile: '%s' runs eagerly for this signature: %s\n", im.options.name.c_str(),
                   plan->fail.c_str());
    }
    return outs;
  }
  bool eager = !plan->fail.empty();
  TensorList leaves;
  if (!eager) {
    for (const compile_detail::LeafSpec& l : plan->leaves) {
      switch (l.kind) {
        case compile_detail::LeafSpec::Kind::arg: leaves.push_back(inputs[l.arg]); break;
        case compile_detail::LeafSpec::Kind::arg_view:
          leaves.push_back(make_view(inputs[l.arg], l.sizes, l.strides, inputs[l.arg].storage_offset() + l.offset,
                                     "compile"));
          break;
        case compile_detail::LeafSpec::Kind::constant:
          if (l.constant.sizes() != l.sizes || l.constant.strides() != l.strides || l.constant.dtype() != l.dtype) {
            // A captured tensor got new geometry (set_data): the trace is stale; trace again.
            {
              std::lock_guard<std::mutex> lock(im.mu);
              im.entries.erase(std::remove_if(im.entries.begin(), im.entries.end(),
                                              [&](const Impl::Entry& en) { return en.key == key; }),
                               im.entries.end());
            }
            return (*this)(inputs);
          }
          leaves.push_back(l.constant);
          break;
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(im.mu);
    im.last = plan;
    im.last_inputs = compile_detail::layouts_of(inputs);
    if (eager) ++im.stats.eager_calls;
    else ++im.stats.replays;
  }
  (void)entry;
  if (eager) return im.fn(inputs);
  // Note [Plan steps].
  std::vector<Tensor> val(plan->num_nodes);
  for (std::size_t k = 0; k < leaves.size(); ++k) {
    if (plan->leaf_node[k] >= 0) val[plan->leaf_node[k]] = leaves[k];
  }
  const bool grad = grad_enabled();
  try {
  for (const Plan::Step& st : plan->steps) {
    TensorList ins;
    if (st.eager >= 0) {
      const compile_detail::EagerOp& op = plan->eager_ops[st.eager];
      for (int id : op.inputs) ins.push_back(id >= 0 ? val[id] : Tensor());
      val[st.node] = op.run(ins);
      continue;
    }
    const compile_detail::Region& r = *plan->regions[st.region];
    for (int id : r.leaves) ins.push_back(val[id]);
    if (grad && !r.has_bwd) {
      // A gradient this region has no fused derivative for (requires_grad changed since the
      // trace): the call runs eagerly; nothing ran so far has a side effect.
      bool need = false;
      for (const Tensor& t : ins) need = need || t.requires_grad();
      if (need) return im.fn(inputs);
    }
    val[st.node] = compile_detail::run_region(plan, r, ins, im.counters, im.options.name);
  }
  } catch (const Error& e) {
    // A replay that fails (a generated kernel that does not compile, a kernel launch refused)
    // is a bug of the plan, or the user's error that the eager run will raise itself: this
    // signature runs eagerly from now on, with the reason. Replays have no side effects to undo.
    auto failed = std::make_shared<Plan>();
    failed->fail = std::string("the replay failed: ") + e.what();
    {
      std::lock_guard<std::mutex> lock(im.mu);
      for (auto& en : im.entries) {
        if (en.key == key) en.plan = failed;
      }
      im.last = failed;
    }
    if (im.options.log_fallbacks) {
      std::fprintf(stderr, "flame::compile: '%s' runs eagerly for this signature: %s\n", im.options.name.c_str(),
                   failed->fail.c_str());
    }
    return im.fn(inputs);
  }
  TensorList outs;
  for (int o : plan->outputs) outs.push_back(val[o]);
  return outs;
}

CompileStats CompiledFunction::stats() const {
  if (!impl_) return {};
  std::lock_guard<std::mutex> lock(impl_->mu);
  CompileStats s = impl_->stats;
  if (impl_->last && impl_->last->fail.empty()) {
    s.fused_kernels = static_cast<int64_t>(impl_->last->regions.size());
    s.fused_ops = impl_->last->fused_ops;
    s.eager_ops = static_cast<int64_t>(impl_->last->eager_ops.size());
    s.saved_inputs = impl_->last->saved_inputs;
  }
  s.kernel_launches = impl_->counters->launches.load();
  s.backward_kernels = impl_->counters->backward.load();
  return s;
}

std::string CompiledFunction::fallback_reason() const {
  if (!impl_) return "";
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last ? impl_->last->fail : std::string();
}

std::string CompiledFunction::last_kernel_sources() const {
  if (!impl_) return "";
  std::shared_ptr<Plan> plan;
  std::vector<compile_detail::OperandLayout> inputs;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    plan = impl_->last;
    inputs = impl_->last_inputs;
  }
  if (!plan || !plan->fail.empty()) return "";
  std::string out;
  for (const auto& r : plan->regions) {
    std::vector<compile_detail::OperandLayout> ins;
    for (int slot = 0; slot < r->fwd.num_inputs; ++slot) {
      const int node = r->leaves[slot];
      const auto leaf_it = std::find(plan->leaf_node.begin(), plan->leaf_node.end(), node);
      if (leaf_it == plan->leaf_node.end()) {  // an eager op's result: taken as contiguous here
        for (const compile_detail::ExprNode& n : r->fwd.nodes) {
          if (n.op == compile_detail::ExprOp::input && n.slot == slot) {
            ins.push_back({n.dtype, n.shape, contiguous_strides(n.shape)});
          }
        }
        continue;
      }
      const compile_detail::LeafSpec& l = plan->leaves[static_cast<std::size_t>(leaf_it - plan->leaf_node.begin())];
      if (l.kind == compile_detail::LeafSpec::Kind::constant) {
        ins.push_back({l.constant.dtype(), l.constant.sizes(), l.constant.strides()});
      } else if (l.kind == compile_detail::LeafSpec::Kind::arg) {
        ins.push_back(inputs[l.arg]);
      } else {
        ins.push_back({inputs[l.arg].dtype, l.sizes, l.strides});
      }
    }
    std::string name;
    out += compile_detail::generate_kernel_source(r->fwd, ins, &name);
    out += "\n// ---- end of " + name + " ----\n";
  }
  return out;
}

void CompiledFunction::clear_cache() const {
  if (!impl_) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->entries.clear();
  impl_->last.reset();
  impl_->last_inputs.clear();
}

}  // namespace flame
