// TCPStore: the key-value store the ranks bootstrap through (flame/dist.h).
//
// Note [Store protocol]
// One request at a time per connection: u64 command, key string, arguments; one reply. GET is
// answered when the key exists or when the waiting time the client sent has passed, so a server
// thread never waits longer than its client. A client says HELLO with its rank first and BYE
// before it disconnects; a connection that closes without BYE marks its rank dead
// ("dist/dead/<rank>"), which is how a rank that waits in vain can name the one that died.
// The server (rank 0) lingers at destruction until the other ranks have said BYE (bounded), so
// that rank 0 finishing first does not fail the others' last store calls.
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "flame/dist.h"
#include "src/dist/socket.h"

namespace flame::dist {

using net::Clock;
using net::Socket;
using net::SocketError;

namespace {

enum Cmd : uint64_t { kSet = 1, kGet, kTryGet, kAdd, kHello, kBye, kDead };
constexpr auto kForever = std::chrono::hours(24 * 365);

class StoreServer {
 public:
  explicit StoreServer(int port) : listener_(Socket::listen(port)) {
    port_ = listener_.local_port();
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  ~StoreServer() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    listener_.shutdown();
    accept_thread_.join();
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& c : clients_) c->shutdown();
      threads = std::move(threads_);
    }
    for (auto& t : threads) t.join();
  }
  int port() const { return port_; }

  // Waits (bounded) until every client other than `self_rank` has said goodbye or gone.
  void linger(int self_rank, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_until(lk, deadline, [&] {
      for (const auto& [rank, open] : open_ranks_)
        if (open && rank != self_rank) return false;
      return true;
    });
  }

 private:
  void accept_loop() {
    for (;;) {
      Socket s;
      try {
        s = listener_.accept(Clock::now(), /*forever=*/true);
      } catch (const SocketError&) {
        return;  // shut down
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      auto sock = std::make_shared<Socket>(std::move(s));
      clients_.push_back(sock);
      threads_.emplace_back([this, sock] { serve(*sock); });
    }
  }

  void serve(const Socket& s) {
    int rank = -1;
    bool said_bye = false;
    try {
      for (;;) {
        const auto far = Clock::now() + kForever;
        const uint64_t cmd = s.recv_u64(far);
        const std::string key = s.recv_str(far);
        const auto reply_by = Clock::now() + std::chrono::seconds(60);
        switch (cmd) {
          case kSet: {
            std::string v = s.recv_str(far);
            {
              std::lock_guard<std::mutex> lk(mu_);
              data_[key] = std::move(v);
            }
            cv_.notify_all();
            s.send_u64(0, reply_by);
            break;
          }
          case kGet:
          case kTryGet: {
            const uint64_t wait_ms = cmd == kGet ? s.recv_u64(far) : 0;
            std::string v;
            bool found;
            {
              std::unique_lock<std::mutex> lk(mu_);
              found = cv_.wait_for(lk, std::chrono::milliseconds(wait_ms),
                                   [&] { return stopping_ || data_.count(key) != 0; }) &&
                      data_.count(key) != 0;
              if (found) v = data_[key];
            }
            s.send_u64(found ? 0 : 1, Clock::now() + std::chrono::seconds(60));
            s.send_str(v, Clock::now() + std::chrono::seconds(60));
            break;
          }
          case kAdd: {
            const int64_t delta = static_cast<int64_t>(s.recv_u64(far));
            int64_t now;
            {
              std::lock_guard<std::mutex> lk(mu_);
              std::string& v = data_[key];
              now = (v.empty() ? 0 : std::stoll(v)) + delta;
              v = std::to_string(now);
            }
            cv_.notify_all();
            s.send_u64(static_cast<uint64_t>(now), reply_by);
            break;
          }
          case kHello: {
            rank = static_cast<int>(s.recv_u64(far));
            {
              std::lock_guard<std::mutex> lk(mu_);
              open_ranks_[rank] = true;
            }
            s.send_u64(0, reply_by);
            break;
          }
          case kBye:
            said_bye = true;
            s.send_u64(0, reply_by);
            throw SocketError(SocketError::Kind::closed, "bye");
          case kDead: {
            std::string list;
            {
              std::lock_guard<std::mutex> lk(mu_);
              for (int r : dead_) list += std::to_string(r) + ",";
            }
            s.send_str(list, reply_by);
            break;
          }
          default:
            throw SocketError(SocketError::Kind::other, "bad command");
        }
      }
    } catch (const std::exception&) {
      // connection over (goodbye, death, or shutdown)
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (rank >= 0) {
        open_ranks_[rank] = false;
        if (!said_bye && !stopping_) {
          dead_.insert(rank);
          data_["dist/dead/" + std::to_string(rank)] = "1";
        }
      }
    }
    cv_.notify_all();
  }

  Socket listener_;
  int port_ = 0;
  std::thread accept_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, std::string> data_;
  std::map<int, bool> open_ranks_;
  std::set<int> dead_;
  std::vector<std::shared_ptr<Socket>> clients_;
  std::vector<std::thread> threads_;
};

}  // namespace

struct TCPStore::Impl {
  std::unique_ptr<StoreServer> server;
  Socket sock;
  std::mutex mu;  // one request at a time on the connection
  std::string where;
  int rank = 0;
  bool broken = false;
};

TCPStore::TCPStore(const std::string& host, int port, int rank, int world_size, bool is_server, Duration timeout)
    : impl_(std::make_unique<Impl>()), timeout_(timeout) {
  impl_->rank = rank;
  try {
    if (is_server) {
      impl_->server = std::make_unique<StoreServer>(port);
      port = impl_->server->port();
    }
    impl_->where = host + ":" + std::to_string(port);
    impl_->sock = Socket::connect(is_server ? "127.0.0.1" : host, port, Clock::now() + timeout);
    const auto d = Clock::now() + timeout;
    impl_->sock.send_u64(kHello, d);
    impl_->sock.send_str("", d);
    impl_->sock.send_u64(static_cast<uint64_t>(rank), d);
    (void)impl_->sock.recv_u64(d);
  } catch (const SocketError& e) {
    FLAME_FAIL("dist::TCPStore", "rank ", rank, " of ", world_size, " could not reach the store ",
               (is_server ? "it serves" : "served by rank 0"), " at ", host, ":", port, ": ", e.what(),
               " (check MASTER_ADDR/MASTER_PORT and that rank 0 is running)");
  }
}

TCPStore::~TCPStore() {
  try {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (!impl_->broken && impl_->sock.valid()) {
      const auto d = Clock::now() + std::chrono::seconds(5);
      impl_->sock.send_u64(kBye, d);
      impl_->sock.send_str("", d);
      (void)impl_->sock.recv_u64(d);
    }
  } catch (const std::exception&) {
  }
  impl_->sock.close();
  if (impl_->server) impl_->server->linger(impl_->rank, Clock::now() + std::min<Duration>(timeout_, std::chrono::seconds(30)));
}

namespace {
template <class F>
auto store_call(TCPStore::Impl& impl, const char* what, const std::string& key, F&& f) {
  std::lock_guard<std::mutex> lk(impl.mu);
  FLAME_CHECK(!impl.broken, "dist::TCPStore", what, "(\"", key, "\"): the connection to the store at ", impl.where,
              " failed earlier");
  try {
    return f(impl.sock);
  } catch (const SocketError& e) {
    impl.broken = true;
    FLAME_FAIL("dist::TCPStore", what, "(\"", key, "\") on rank ", impl.rank, ": the store at ", impl.where,
               " (served by rank 0) failed: ", e.what(),
               e.kind == SocketError::Kind::closed ? " (rank 0 has exited or died)" : "");
  }
}
}  // namespace

void TCPStore::set(const std::string& key, const std::string& value) {
  store_call(*impl_, "set", key, [&](const Socket& s) {
    const auto d = Clock::now() + timeout_;
    s.send_u64(kSet, d);
    s.send_str(key, d);
    s.send_str(value, d);
    return s.recv_u64(d);
  });
}

std::string TCPStore::get(const std::string& key) {
  auto [found, value] = store_call(*impl_, "get", key, [&](const Socket& s) {
    const auto d = Clock::now() + timeout_ + std::chrono::seconds(10);
    s.send_u64(kGet, d);
    s.send_str(key, d);
    s.send_u64(static_cast<uint64_t>(timeout_.count()), d);
    const bool f = s.recv_u64(d) == 0;
    return std::make_pair(f, s.recv_str(d));
  });
  FLAME_CHECK(found, "dist::TCPStore", "get(\"", key, "\") on rank ", impl_->rank, " timed out after ",
              timeout_.count(), " ms");
  return value;
}

std::optional<std::string> TCPStore::try_get(const std::string& key) {
  auto [found, value] = store_call(*impl_, "try_get", key, [&](const Socket& s) {
    const auto d = Clock::now() + timeout_;
    s.send_u64(kTryGet, d);
    s.send_str(key, d);
    const bool f = s.recv_u64(d) == 0;
    return std::make_pair(f, s.recv_str(d));
  });
  if (!found) return std::nullopt;
  return value;
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  return store_call(*impl_, "add", key, [&](const Socket& s) {
    const auto d = Clock::now() + timeout_;
    s.send_u64(kAdd, d);
    s.send_str(key, d);
    s.send_u64(static_cast<uint64_t>(delta), d);
    return static_cast<int64_t>(s.recv_u64(d));
  });
}

void TCPStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TCPStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const auto end = Clock::now() + timeout;
  for (const std::string& key : keys) {
    const auto left = std::chrono::duration_cast<Duration>(end - Clock::now());
    auto [found, value] = store_call(*impl_, "wait", key, [&](const Socket& s) {
      const auto d = Clock::now() + std::max(left, Duration(0)) + std::chrono::seconds(10);
      s.send_u64(kGet, d);
      s.send_str(key, d);
      s.send_u64(static_cast<uint64_t>(std::max<int64_t>(left.count(), 0)), d);
      const bool f = s.recv_u64(d) == 0;
      return std::make_pair(f, s.recv_str(d));
    });
    (void)value;
    FLAME_CHECK(found, "dist::TCPStore", "wait(\"", key, "\") on rank ", impl_->rank, " timed out after ",
                timeout.count(), " ms");
  }
}

std::vector<int> TCPStore::dead_ranks() {
  const std::string list = store_call(*impl_, "dead_ranks", "", [&](const Socket& s) {
    const auto d = Clock::now() + timeout_;
    s.send_u64(kDead, d);
    s.send_str("", d);
    return s.recv_str(d);
  });
  std::vector<int> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(std::stoi(item));
  return out;
}

int TCPStore::port() const { return impl_->server ? impl_->server->port() : -1; }

}  // namespace flame::dist
