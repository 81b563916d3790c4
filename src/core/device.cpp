#include "flame/device.h"

#include "flame/version.h"

namespace flame {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

const char* version() { return "0.1.0"; }

}  // namespace flame
