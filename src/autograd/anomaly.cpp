// Anomaly mode (flame/anomaly.h).
//
// Note [Anomaly mode]
// Two hooks, each behind a thread-local flag test so that the normal path pays one load and a
// branch:
//  - Forward: record() (node.cpp) is the one place every differentiable op passes after its
//    output is computed; with anomaly mode on it numbers the node (Node::anomaly_seq, the count of
//    recorded ops since the mode was turned on on this thread), keeps the module path it ran in,
//    and checks the output. Ops whose inputs need no gradient record nothing and are not checked
//    (there is no other place every op passes after its kernel ran; an allocation hook would see
//    the output before it is written).
//  - Backward: the engine (backward.cpp) checks what each node's rule returned, before anything
//    is summed or delivered, and names the node and the forward op that created it.
// A check reads two flags back to the host (NaN, then Inf), so on CUDA every checked op waits
// for the GPU. The checks run with recording, the checkpoint collector and anomaly mode itself
// off, so they neither enter the graph nor recurse.
#include <cctype>
#include <sstream>

#include "flame/anomaly.h"
#include "flame/ops.h"
#include "src/autograd/anomaly.h"
#include "src/core/profiler_context.h"

namespace flame {

using autograd_detail::t_state;

namespace {

// Backward checks of anomaly mode (t_state.anomaly says whether the mode is on at all; the engine
// tests only that flag).
thread_local bool t_check_backward = true;

// Turns recording, the checkpoint collector and anomaly mode off while a check runs.
class QuietScope {
 public:
  QuietScope() : saved_(t_state) {
    t_state.grad_enabled = false;
    t_state.collector = nullptr;
    t_state.anomaly = false;
    t_state.anomaly_forward = false;
  }
  ~QuietScope() {
    t_state.grad_enabled = saved_.grad_enabled;
    t_state.collector = saved_.collector;
    t_state.anomaly = saved_.anomaly;
    t_state.anomaly_forward = saved_.anomaly_forward;
  }

 private:
  autograd_detail::ThreadState saved_;
};

// nullptr when t is finite (or not floating, or empty); else "NaN" or "Inf".
const char* nonfinite_kind(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype()) || t.numel() == 0) return nullptr;
  QuietScope quiet;
  profiler_detail::set_current_op("detect_anomaly");
  if (isnan(t).any().item<bool>()) return "NaN";
  if (isinf(t).any().item<bool>()) return "Inf";
  return nullptr;
}

std::string describe(const Shape& shape, DType dtype) {
  std::ostringstream os;
  os << shape_str(shape) << " " << dtype_name(dtype);
  return os.str();
}

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return describe(t.sizes(), t.dtype()) + " on " + t.device().str();
}

std::string inputs_of(const Node& node) {
  std::ostringstream os;
  bool first = true;
  for (const Node::Edge& e : node.edges()) {
    if (!first) os << ", ";
    first = false;
    os << describe(e.shape.vec(), e.dtype);
  }
  return first ? "none" : os.str();
}

std::string origin_of(const Node& node) {
  std::ostringstream os;
  os << "forward op " << anomaly_detail::forward_op_name(node.name());
  if (node.anomaly_seq > 0) {
    os << " (op #" << node.anomaly_seq << " since anomaly mode began";
  } else {
    os << " (recorded before anomaly mode was on";
  }
  if (node.module_path) os << ", in module '" << node.module_path << "'";
  os << ")";
  return os.str();
}

}  // namespace

DetectAnomalyGuard::DetectAnomalyGuard(bool check_forward, bool check_backward)
    : prev_on_(t_state.anomaly), prev_forward_(t_state.anomaly_forward), prev_backward_(t_check_backward) {
  set_detect_anomaly(true, check_forward, check_backward);
}

DetectAnomalyGuard::~DetectAnomalyGuard() {
  t_state.anomaly = prev_on_;
  t_state.anomaly_forward = prev_on_ && prev_forward_;
  t_check_backward = prev_backward_;
}

void set_detect_anomaly(bool on, bool check_forward, bool check_backward) {
  if (on && !t_state.anomaly) t_state.anomaly_seq = 0;  // the count starts with the outermost mode
  t_state.anomaly = on;
  t_state.anomaly_forward = on && check_forward;
  t_check_backward = !on || check_backward;
}

bool is_anomaly_enabled() { return t_state.anomaly; }
bool is_anomaly_check_forward_enabled() { return t_state.anomaly_forward; }
bool is_anomaly_check_backward_enabled() { return t_state.anomaly && t_check_backward; }

void check_finite(const Tensor& t, const std::string& what) {
  if (const char* kind = nonfinite_kind(t)) {
    FLAME_FAIL(what.c_str(), "the tensor of ", describe(t), " holds ", kind, " values");
  }
}

namespace anomaly_detail {

std::string forward_op_name(const char* node_name) {
  std::string s = node_name ? node_name : "";
  if (s.size() > 8 && s.compare(s.size() - 8, 8, "Backward") == 0) s.resize(s.size() - 8);
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (std::isupper(c)) {
      if (i > 0) out += '_';
      out += static_cast<char>(std::tolower(c));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

void on_record(const Tensor& out, Node& node) {
  node.module_path = profiler_detail::current_module_path();
  if (!t_state.anomaly) return;  // a memory profiler only wants the module path
  node.anomaly_seq = ++t_state.anomaly_seq;
  if (!t_state.anomaly_forward) return;
  if (const char* kind = nonfinite_kind(out)) {
    std::ostringstream os;
    os << "op " << forward_op_name(node.name()) << " (op #" << node.anomaly_seq
       << " since anomaly mode began, grad_fn " << node.name() << ")";
    if (node.module_path) os << " in module '" << node.module_path << "'";
    os << " produced " << kind << " in its output of " << describe(out) << "; inputs: " << inputs_of(node);
    FLAME_FAIL("detect_anomaly", os.str());
  }
}

void check_backward(const Node& node, const Tensor& grad_output, const TensorList& grads) {
  if (!t_check_backward) return;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const char* kind = nonfinite_kind(grads[i]);
    if (!kind) continue;
    std::ostringstream os;
    os << "backward node " << node.name() << " returned " << kind << " in the gradient of its input " << i
       << " (" << describe(grads[i]) << ") for a grad_output of " << describe(grad_output) << "; the node was created by "
       << origin_of(node) << " with inputs " << inputs_of(node);
    FLAME_FAIL("detect_anomaly", os.str());
  }
}

}  // namespace anomaly_detail

}  // namespace flame
