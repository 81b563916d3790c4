#pragma once
// Blocking TCP sockets with deadlines for the store and the "tcp" process group.
// Note [Socket deadlines]: every read and write polls with the time left to its deadline and
// raises SocketError on timeout or on a closed connection, so no wait on a peer is unbounded.
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace flame::dist::net {

using Clock = std::chrono::steady_clock;

struct SocketError : std::runtime_error {
  enum class Kind { timeout, closed, other };
  SocketError(Kind k, const std::string& what) : std::runtime_error(what), kind(k) {}
  Kind kind;
};

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // Connects, retrying while the peer is not listening yet, until the deadline.
  static Socket connect(const std::string& host, int port, Clock::time_point deadline);
  // Listens on all interfaces at `port` (0: any free port).
  static Socket listen(int port, int backlog = 128);
  // Waits for a connection until the deadline (or forever when `forever`).
  Socket accept(Clock::time_point deadline, bool forever = false) const;
  int local_port() const;

  void send_all(const void* data, std::size_t n, Clock::time_point deadline) const;
  void recv_all(void* data, std::size_t n, Clock::time_point deadline) const;
  void send_u64(uint64_t v, Clock::time_point deadline) const { send_all(&v, sizeof v, deadline); }
  uint64_t recv_u64(Clock::time_point deadline) const {
    uint64_t v = 0;
    recv_all(&v, sizeof v, deadline);
    return v;
  }
  void send_str(const std::string& s, Clock::time_point deadline) const;
  std::string recv_str(Clock::time_point deadline) const;

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void shutdown() const;  // wakes a thread blocked on it
  void close();

 private:
  int fd_ = -1;
};

inline Clock::time_point deadline_after(std::chrono::milliseconds d) { return Clock::now() + d; }

}  // namespace flame::dist::net
