#pragma once
// Gradient release from a post-accumulate hook (internal; ZeRO-2 in src/dist/zero.cpp).
//
// A hook registered with Tensor::register_post_accumulate_grad_hook that has taken what it needs
// from the accumulated gradient (copied it into a communication bucket) calls
// release_leaf_gradient(): once the leaf's hooks have run, the backward drops the leaf's entry from
// the Gradients store, so the full gradient is freed as soon as the backward is done with it and
// the store returned (or BackwardOptions::accumulate_into) has no entry for that leaf.
namespace flame::autograd_detail {

void release_leaf_gradient();

}  // namespace flame::autograd_detail
