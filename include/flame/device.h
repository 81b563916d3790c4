#pragma once
#include <cstdint>
#include <ostream>
#include <string>

namespace flame {

enum class DeviceType : uint8_t { cpu, cuda };

// Where a tensor's storage lives. A tensor lives on exactly one device; ops never move data
// between devices implicitly (mixing devices is an error naming both).
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}  // NOLINT: Device(DeviceType::cuda)
  // Parses "cpu", "cuda" (GPU 0), "cuda:N" or "cpu:0", as torch.device / libtorch's Device(string):
  // Device("cuda:1"), x.to("cuda"). Anything else raises flame::Error naming the string and the
  // accepted forms. Only the spelling is checked: whether the GPU exists is the allocator's question.
  Device(const std::string& spec);  // NOLINT: implicit, as libtorch's
  Device(const char* spec);         // NOLINT
  static Device cpu() { return Device{DeviceType::cpu, 0}; }
  static Device cuda(int i = 0) { return Device{DeviceType::cuda, i}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

std::ostream& operator<<(std::ostream& os, const Device& d);

// True when FLAME was built with CUDA and at least one GPU is visible.
bool cuda_is_available();
int cuda_device_count();

}  // namespace flame
