#pragma once
// Grad mode: whether ops record the autograd graph on this thread (torch.no_grad's state). A
// core-level switch that every op consults; flame/autograd.h (which includes this header) has the
// rest of autograd. See docs/autograd.md.
namespace flame {

// Disables graph recording on this thread while alive (thread-local, nestable).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};
// Re-enables recording inside a NoGradGuard region.
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};
bool grad_enabled();

}  // namespace flame
