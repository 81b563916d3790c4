#pragma once
// Anomaly-mode hooks of the recording path and the engine (Note [Anomaly mode] in anomaly.cpp).
#include "src/autograd/record.h"

namespace flame::anomaly_detail {

// record() calls this for a freshly recorded node when anomaly mode or a memory profiler is on:
// stamps the node's origin and, in forward-checking anomaly mode, checks `out`.
void on_record(const Tensor& out, Node& node);

// The engine calls this after `node`'s rule returned `grads` for `grad_output` (anomaly mode on).
void check_backward(const Node& node, const Tensor& grad_output, const TensorList& grads);

// "IndexSelectBackward" -> "index_select": the forward op a node name stands for.
std::string forward_op_name(const char* node_name);

}  // namespace flame::anomaly_detail
