#pragma once
// Note [Error policy]
// Every invalid use raises flame::Error before any data is written. The message starts with the
// op's name and names the offending shapes, dtypes, devices or values, e.g.
//   "add: shapes [2, 3] and [4] are not broadcastable".
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace flame {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// An allocation the device (or host) could not serve, also under a memory limit
// (cuda::set_memory_limit), raised after the caches were released and the allocation retried
// (torch.OutOfMemoryError). The message names the request, what the pool holds and the limit; a
// caller can catch it to try a smaller layout (fewer resident blocks, more checkpointing).
class OutOfMemoryError : public Error {
 public:
  explicit OutOfMemoryError(const std::string& what) : Error(what) {}
};

std::string shape_str(const std::vector<int64_t>& shape);

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    os << shape_str(v);
  } else {
    os << v;
  }
  append(os, rest...);
}
template <class... Args>
[[noreturn]] void raise(const char* op, const Args&... args) {
  std::ostringstream os;
  os << op << ": ";
  append(os, args...);
  throw Error(os.str());
}
}  // namespace detail

}  // namespace flame

// FLAME_CHECK(cond, "op", parts...): raise flame::Error("op: parts...") unless cond holds.
// Shapes (std::vector<int64_t>) print as [a, b].
#define FLAME_CHECK(cond, op, ...)               \
  do {                                           \
    if (!(cond)) ::flame::detail::raise(op, __VA_ARGS__); \
  } while (0)
#define FLAME_FAIL(op, ...) ::flame::detail::raise(op, __VA_ARGS__)
