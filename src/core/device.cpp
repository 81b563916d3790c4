#include "flame/device.h"

#include <algorithm>

#include "flame/error.h"

#include "flame/version.h"

namespace flame {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

Device::Device(const char* spec) : Device(std::string(spec ? spec : "(null)")) {}

Device::Device(const std::string& spec) {
  auto bad = [&spec](const char* why) {
    FLAME_FAIL("Device", "cannot parse \"", spec, "\": ", why,
               "; expected \"cpu\", \"cuda\" or \"cuda:N\" with N a GPU index >= 0 (e.g. \"cuda:0\")");
  };
  const std::size_t colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  if (kind == "cpu") {
    type = DeviceType::cpu;
  } else if (kind == "cuda") {
    type = DeviceType::cuda;
  } else {
    bad(kind.empty() ? "no device type" : "unknown device type");
  }
  index = 0;
  if (colon == std::string::npos) return;
  const std::string digits = spec.substr(colon + 1);
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    bad("the index is not a non-negative integer");
  }
  index = std::stoi(digits);
  if (type == DeviceType::cpu && index != 0) bad("the CPU has only index 0");
}

const char* version() { return "0.1.0"; }

}  // namespace flame
