// TCP sockets with deadlines (Note [Socket deadlines] in socket.h).
#include "src/dist/socket.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace flame::dist::net {

namespace {

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

void wait_ready(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int left = ms_left(deadline);
    const int r = ::poll(&p, 1, left);
    if (r > 0) return;
    if (r == 0) throw SocketError(SocketError::Kind::timeout, std::string(what) + ": timed out");
    if (errno != EINTR) throw SocketError(SocketError::Kind::other, std::string(what) + ": poll: " + std::strerror(errno));
  }
}

}  // namespace

Socket::~Socket() { close(); }

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::shutdown() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Socket Socket::connect(const std::string& host, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last = "no attempt";
  for (int attempt = 0;; ++attempt) {
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
      last = std::string("getaddrinfo: ") + ::gai_strerror(gai);
    } else {
      for (addrinfo* a = res; a; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          ::freeaddrinfo(res);
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          return Socket(fd);
        }
        last = std::strerror(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (Clock::now() >= deadline)
      throw SocketError(SocketError::Kind::timeout,
                        "connect to " + host + ":" + std::to_string(port) + " timed out (" + last + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(10 * (attempt + 1), 200)));
  }
}

Socket Socket::listen(int port, int backlog) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  int zero = 0;
  int use = fd;
  bool v6 = fd >= 0;
  if (v6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  else use = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (use < 0) throw SocketError(SocketError::Kind::other, std::string("socket: ") + std::strerror(errno));
  ::setsockopt(use, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (v6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(use, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(use, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (rc != 0 || ::listen(use, backlog) != 0) {
    const std::string err = std::strerror(errno);
    ::close(use);
    throw SocketError(SocketError::Kind::other, "listen on port " + std::to_string(port) + ": " + err);
  }
  return Socket(use);
}

Socket Socket::accept(Clock::time_point deadline, bool forever) const {
  for (;;) {
    if (!forever) wait_ready(fd_, POLLIN, deadline, "accept");
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return Socket(fd);
    }
    if (errno == EINTR || errno == EAGAIN) continue;
    throw SocketError(SocketError::Kind::closed, std::string("accept: ") + std::strerror(errno));
  }
}

int Socket::local_port() const {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

void Socket::send_all(const void* data, std::size_t n, Clock::time_point deadline) const {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    wait_ready(fd_, POLLOUT, deadline, "send");
    const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == EPIPE || errno == ECONNRESET) throw SocketError(SocketError::Kind::closed, "send: connection closed by the peer");
      throw SocketError(SocketError::Kind::other, std::string("send: ") + std::strerror(errno));
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

void Socket::recv_all(void* data, std::size_t n, Clock::time_point deadline) const {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    wait_ready(fd_, POLLIN, deadline, "recv");
    const ssize_t k = ::recv(fd_, p, n, 0);
    if (k == 0) throw SocketError(SocketError::Kind::closed, "recv: connection closed by the peer");
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) throw SocketError(SocketError::Kind::closed, "recv: connection reset by the peer");
      throw SocketError(SocketError::Kind::other, std::string("recv: ") + std::strerror(errno));
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

void Socket::send_str(const std::string& s, Clock::time_point deadline) const {
  send_u64(s.size(), deadline);
  send_all(s.data(), s.size(), deadline);
}

std::string Socket::recv_str(Clock::time_point deadline) const {
  const uint64_t n = recv_u64(deadline);
  if (n > (uint64_t{1} << 40)) throw SocketError(SocketError::Kind::other, "recv: corrupt length");
  std::string s(n, '\0');
  recv_all(s.data(), n, deadline);
  return s;
}

}  // namespace flame::dist::net
