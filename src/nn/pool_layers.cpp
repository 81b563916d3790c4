// Summaries of the pooling modules (include/flame/nn/pool_layers.h).
#include "flame/nn/pool_layers.h"

#include <sstream>

namespace flame::nn {
namespace {
std::string size2(const functional::Size2& s) {
  std::ostringstream o;
  if (s.h == s.w) o << s.h;
  else o << "(" << s.h << ", " << s.w << ")";
  return o.str();
}
const char* py_bool(bool b) { return b ? "True" : "False"; }
}  // namespace

std::string MaxPool1d::extra_repr() const {
  std::ostringstream s;
  s << "kernel_size=" << k_ << ", stride=" << (s_ > 0 ? s_ : k_) << ", padding=" << p_ << ", dilation=" << d_
    << ", ceil_mode=" << py_bool(ceil_);
  return s.str();
}
std::string MaxPool2d::extra_repr() const {
  std::ostringstream s;
  const functional::Size2 st = (s_.h == 0 && s_.w == 0) ? k_ : s_;
  s << "kernel_size=" << size2(k_) << ", stride=" << size2(st) << ", padding=" << size2(p_)
    << ", dilation=" << size2(d_) << ", ceil_mode=" << py_bool(ceil_);
  return s.str();
}
std::string AvgPool1d::extra_repr() const {
  std::ostringstream s;
  s << "kernel_size=(" << k_ << ",), stride=(" << (s_ > 0 ? s_ : k_) << ",), padding=(" << p_ << ",)";
  return s.str();
}
std::string AvgPool2d::extra_repr() const {
  std::ostringstream s;
  const functional::Size2 st = (s_.h == 0 && s_.w == 0) ? k_ : s_;
  s << "kernel_size=" << size2(k_) << ", stride=" << size2(st) << ", padding=" << size2(p_);
  return s.str();
}
std::string AdaptiveAvgPool2d::extra_repr() const {
  std::ostringstream s;
  s << "output_size=" << size2(out_);
  return s.str();
}
std::string AdaptiveMaxPool2d::extra_repr() const {
  std::ostringstream s;
  s << "output_size=" << size2(out_);
  return s.str();
}
std::string Upsample::extra_repr() const {
  std::ostringstream s;
  if (options_.size) s << "size=" << size2(*options_.size);
  else if (options_.scale_factor) s << "scale_factor=" << options_.scale_factor->first;
  s << ", mode='" << options_.mode << "'";
  return s.str();
}

}  // namespace flame::nn
