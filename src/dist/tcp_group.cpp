// The "tcp" process group: collectives on CPU tensors over sockets, through rank 0.
//
// Note [TCP collectives]
// Rank 0 is connected to every other rank (they connect to MASTER_ADDR at the port rank 0
// publishes in the store). Every collective is a star: ranks send their input to rank 0, which
// reduces in rank order (so every rank gets bit-identical results) and sends each rank its
// result. Simple and slow (it is for CI and CPU runs, not for speed). Collectives run in order on
// one worker thread per group, so async calls overlap the caller's work. Every message carries
// the collective's sequence number and size: ranks calling different collectives fail with an
// error instead of exchanging garbage. Failures (Note [Socket deadlines]): a peer's connection
// closing names that rank; rank 0 then sends the others an abort message naming it before it
// fails itself (a rank whose send to rank 0 fails reads that message if it is waiting); a peer silent past the timeout names the rank rank 0 waited for (the others wait
// twice the timeout for rank 0, so its report reaches them first).
#include <cstring>
#include <deque>
#include <thread>

#include "flame/autograd.h"
#include "flame/ops.h"
#include "src/core/tensor_impl.h"
#include "src/dist/internal.h"
#include "src/dist/socket.h"

namespace flame::dist {

using net::Clock;
using net::Socket;
using net::SocketError;

namespace {

enum Tag : uint64_t { kData = 0xda7a, kAbort = 0xab07 };

// A failure with the rank it concerns (-1: unknown).
struct PeerFailure : std::runtime_error {
  PeerFailure(int r, const std::string& what) : std::runtime_error(what), rank(r) {}
  int rank;
};

class TcpGroup final : public ProcessGroup {
 public:
  TcpGroup(std::shared_ptr<TCPStore> store, int rank, int world, Duration timeout) : timeout_(timeout) {
    store_ = std::move(store);
    rank_ = rank;
    size_ = world;
    const std::string gen = std::to_string(store_->add("dist/tcp/generation/" + std::to_string(rank), 1));
    const auto deadline = Clock::now() + timeout_;
    try {
      if (rank_ == 0) {
        Socket listener = Socket::listen(0);
        store_->set("dist/tcp/port/" + gen, std::to_string(listener.local_port()));
        peers_.resize(static_cast<std::size_t>(size_));
        for (int k = 1; k < size_; ++k) {
          Socket s = listener.accept(deadline);
          const int r = static_cast<int>(s.recv_u64(deadline));
          FLAME_CHECK(r > 0 && r < size_ && !peers_[static_cast<std::size_t>(r)].valid(), "dist::tcp",
                      "bad hello from a peer (rank ", r, ")");
          peers_[static_cast<std::size_t>(r)] = std::move(s);
        }
      } else {
        const int port = std::stoi(store_->get("dist/tcp/port/" + gen));
        root_ = Socket::connect(env_info().master_addr, port, deadline);
        root_.send_u64(static_cast<uint64_t>(rank_), deadline);
      }
    } catch (const SocketError& e) {
      FLAME_FAIL("dist::init_process_group", "tcp group: rank ", rank_, " of ", size_,
                 " could not connect the ranks within ", timeout_.count(), " ms: ", e.what());
    }
    worker_ = std::thread([this] { run(); });
  }

  ~TcpGroup() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  std::string backend() const override { return "tcp"; }
  Device device() const override { return Device::cpu(); }

  Work all_reduce(Tensor& t, ReduceOp op, bool async) override {
    check_tensor(t, "dist::all_reduce");
    check_op(t.dtype(), op, "dist::all_reduce");
    bump_version(t);  // written in place (Note [Collectives write in place] in internal.h)
    Tensor tt = t;
    return submit("all_reduce", async, [this, tt, op](uint64_t seq) mutable {
      Tensor result = star_reduce(tt, op, seq);
      if (rank_ == 0) broadcast_from_root(result, seq);
      else recv_result(tt, seq);
      if (rank_ == 0) copy_into(tt, result);
    });
  }

  Work reduce_scatter(Tensor& output, const Tensor& input, ReduceOp op, bool async) override {
    check_tensor(output, "dist::reduce_scatter");
    check_tensor(input, "dist::reduce_scatter");
    FLAME_CHECK(input.numel() == output.numel() * size_ && input.dtype() == output.dtype(), "dist::reduce_scatter",
                "input of ", input.numel(), " ", dtype_name(input.dtype()), " elements must be world size (", size_,
                ") times the output's ", output.numel(), " ", dtype_name(output.dtype()));
    check_op(input.dtype(), op, "dist::reduce_scatter");
    bump_version(output);  // written in place (Note [Collectives write in place] in internal.h)
    Tensor out = output, in = input;
    return submit("reduce_scatter", async, [this, out, in, op](uint64_t seq) mutable {
      Tensor full = star_reduce(in, op, seq);
      const int64_t n = out.numel();
      if (rank_ == 0) {
        const auto d = Clock::now() + timeout_;
        for (int r = 1; r < size_; ++r) {
          Tensor chunk = full.reshape({-1}).narrow(0, r * n, n);
          send_data(peers_[static_cast<std::size_t>(r)], chunk, seq, d, r);
        }
        copy_into(out, full.reshape({-1}).narrow(0, 0, n));
      } else {
        recv_result(out, seq);
      }
    });
  }

  Work all_gather(Tensor& output, const Tensor& input, bool async) override {
    check_tensor(output, "dist::all_gather");
    check_tensor(input, "dist::all_gather");
    FLAME_CHECK(output.numel() == input.numel() * size_ && input.dtype() == output.dtype(), "dist::all_gather",
                "output of ", output.numel(), " ", dtype_name(output.dtype()), " elements must be world size (", size_,
                ") times the input's ", input.numel(), " ", dtype_name(input.dtype()));
    bump_version(output);  // written in place (Note [Collectives write in place] in internal.h)
    Tensor out = output, in = input;
    return submit("all_gather", async, [this, out, in](uint64_t seq) mutable {
      const int64_t n = in.numel();
      if (rank_ == 0) {
        Tensor flat = out.view({-1});
        copy_into(flat.narrow(0, 0, n), in);
        const auto d = Clock::now() + timeout_;
        for (int r = 1; r < size_; ++r) recv_data(peers_[static_cast<std::size_t>(r)], flat.narrow(0, r * n, n), seq, d, r);
        broadcast_from_root(out, seq);
      } else {
        send_data(root_, in, seq, Clock::now() + timeout_, 0);
        recv_result(out, seq);
      }
    });
  }

  Work broadcast(Tensor& t, int root, bool async) override {
    check_tensor(t, "dist::broadcast");
    FLAME_CHECK(root >= 0 && root < size_, "dist::broadcast", "root ", root, " is not a rank of a group of ", size_);
    bump_version(t);  // written in place (Note [Collectives write in place] in internal.h)
    Tensor tt = t;
    return submit("broadcast", async, [this, tt, root](uint64_t seq) mutable {
      const auto d = Clock::now() + timeout_;
      if (root != 0) {
        if (rank_ == root) send_data(root_, tt, seq, d, 0);
        if (rank_ == 0) recv_data(peers_[static_cast<std::size_t>(root)], tt, seq, d, root);
      }
      if (rank_ == 0) {
        for (int r = 1; r < size_; ++r)
          if (r != root) send_data(peers_[static_cast<std::size_t>(r)], tt, seq, d, r);
      } else if (rank_ != root) {
        recv_result(tt, seq);
      }
    });
  }

  void barrier() override {
    Tensor t = Tensor::ones({1});
    all_reduce(t, ReduceOp::sum, false);
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) failure_ = "the group was aborted: " + reason;
    for (auto& p : peers_) p.shutdown();
    root_.shutdown();
  }

 private:
  struct Item {
    const char* name;
    std::function<void(uint64_t)> fn;
    std::shared_ptr<HostWork> work;
  };

  static void check_op(DType dt, ReduceOp op, const char* what) {
    FLAME_CHECK(op != ReduceOp::avg || is_floating(dt), what, "ReduceOp::avg needs a floating tensor, got ",
                dtype_name(dt));
    FLAME_CHECK(dt != DType::boolean || op == ReduceOp::max || op == ReduceOp::min, what,
                "a bool tensor reduces only with max or min");
  }

  Work submit(const char* name, bool async, std::function<void(uint64_t)> fn) {
    auto w = std::make_shared<HostWork>();
    {
      std::lock_guard<std::mutex> lk(mu_);
      FLAME_CHECK(failure_.empty(), (std::string("dist::") + name).c_str(), "rank ", rank_, ": the group failed earlier: ",
                  failure_);
      queue_.push_back(Item{name, std::move(fn), w});
    }
    cv_.notify_all();
    Work work(w);
    if (!async) work.wait();
    return work;
  }

  void run() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      std::string error;
      {
        std::lock_guard<std::mutex> lk(mu_);
        error = failure_;
      }
      if (error.empty()) {
        const uint64_t seq = ++seq_;
        try {
          NoGradGuard no_grad;
          item.fn(seq);
        } catch (const PeerFailure& e) {
          error = describe(item.name, seq, e);
        } catch (const std::exception& e) {
          error = std::string("rank ") + std::to_string(rank_) + ": " + item.name + " #" + std::to_string(seq) +
                  " failed: " + e.what();
        }
        if (!error.empty()) {
          std::lock_guard<std::mutex> lk(mu_);
          failure_ = error;
        }
      }
      if (!error.empty() && rank_ == 0) abort_peers(error);
      item.work->finish(error);
    }
  }

  std::string describe(const char* name, uint64_t seq, const PeerFailure& e) {
    std::string s = "rank " + std::to_string(rank_) + ": " + name + " #" + std::to_string(seq) + " failed: " + e.what();
    if (e.rank == -1) {  // unknown peer (not rank 0's abort report, which names it)
      const std::string dead = describe_dead_ranks(*store_);
      if (!dead.empty()) s += " (the store reports " + dead + " dead)";
    }
    return s;
  }

  // Best effort: tell the other ranks why rank 0 stops, so their error names the failed rank.
  void abort_peers(const std::string& why) {
    const auto d = Clock::now() + std::chrono::seconds(2);
    for (std::size_t r = 1; r < peers_.size(); ++r) {
      try {
        peers_[r].send_u64(kAbort, d);
        peers_[r].send_str(why, d);
      } catch (const std::exception&) {
      }
    }
  }

  static void copy_into(const Tensor& dst, const Tensor& src) {
    if (dst.data_ptr() == src.data_ptr()) return;  // in place (an all-gather of a slice of its output)
    std::memcpy(dst.data_ptr(), src.contiguous().data_ptr(), dst.nbytes());
  }

  void send_data(const Socket& s, const Tensor& t, uint64_t seq, Clock::time_point d, int peer) {
    try {
      const Tensor c = t.contiguous();
      const uint64_t header[3] = {kData, seq, c.nbytes()};
      s.send_all(header, sizeof header, d);
      s.send_all(c.data_ptr(), c.nbytes(), d);
    } catch (const SocketError& e) {
      if (peer == 0) throw_pending_abort(s);
      throw failure(e, peer, "sending to");
    }
  }

  // A send to rank 0 that fails because rank 0 has gone: rank 0 may have sent its abort report
  // (abort_peers) before it exited, and the report, naming the rank that failed first, is still in
  // this socket's receive buffer. Raises it if so; returns when nothing of the kind is there.
  static void throw_pending_abort(const Socket& s) {
    std::string why;
    try {
      const auto d = Clock::now() + std::chrono::milliseconds(500);
      if (s.recv_u64(d) != kAbort) return;
      why = s.recv_str(d);
    } catch (const SocketError&) {
      return;
    }
    throw PeerFailure(-2, "rank 0 aborted the group: " + why);
  }

  void recv_data(const Socket& s, const Tensor& dst, uint64_t seq, Clock::time_point d, int peer) {
    try {
      const uint64_t tag = s.recv_u64(d);
      if (tag == kAbort) throw PeerFailure(-2, "rank 0 aborted the group: " + s.recv_str(d));
      uint64_t rest[2];
      s.recv_all(rest, sizeof rest, d);
      if (tag != kData || rest[0] != seq || rest[1] != dst.nbytes())
        throw PeerFailure(peer, "collective mismatch with rank " + std::to_string(peer) + ": it sent collective #" +
                                    std::to_string(rest[0]) + " of " + std::to_string(rest[1]) + " bytes, expected #" +
                                    std::to_string(seq) + " of " + std::to_string(dst.nbytes()) +
                                    " bytes (every rank must call the same collectives in the same order)");
      s.recv_all(dst.data_ptr(), dst.nbytes(), d);
    } catch (const SocketError& e) {
      throw failure(e, peer, "receiving from");
    }
  }

  PeerFailure failure(const SocketError& e, int peer, const char* doing) const {
    const std::string who = "rank " + std::to_string(peer);
    switch (e.kind) {
      case SocketError::Kind::closed:
        return PeerFailure(peer, who + " closed its connection (" + doing + " it: the process died or exited)");
      case SocketError::Kind::timeout:
        return PeerFailure(peer, "timed out after " + std::to_string(timeout_.count()) + " ms " + doing + " " + who +
                                     " (hung, or not calling the same collective)");
      default:
        return PeerFailure(peer, std::string(doing) + " " + who + ": " + e.what());
    }
  }

  // Rank 0: its input reduced with everyone's, in rank order. Others: send the input, return it.
  Tensor star_reduce(const Tensor& in, ReduceOp op, uint64_t seq) {
    if (rank_ != 0) {
      send_data(root_, in, seq, Clock::now() + timeout_, 0);
      return in;
    }
    Tensor acc = in.clone();
    Tensor tmp = Tensor::empty(in.sizes(), TensorOptions(in.dtype(), Device::cpu()));
    const auto d = Clock::now() + timeout_;
    for (int r = 1; r < size_; ++r) {
      recv_data(peers_[static_cast<std::size_t>(r)], tmp, seq, d, r);
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc.add_(tmp); break;
        case ReduceOp::max: acc = acc.maximum(tmp); break;
        case ReduceOp::min: acc = acc.minimum(tmp); break;
      }
    }
    if (op == ReduceOp::avg) acc.div_(Scalar(static_cast<double>(size_)));
    return acc;
  }

  void broadcast_from_root(const Tensor& t, uint64_t seq) {
    const auto d = Clock::now() + timeout_;
    for (int r = 1; r < size_; ++r) send_data(peers_[static_cast<std::size_t>(r)], t, seq, d, r);
  }

  // Rank 0 watches the others; a rank waiting for rank 0's answer gives it twice the timeout, so
  // that rank 0's report naming a silent rank arrives before this rank gives up on rank 0.
  void recv_result(const Tensor& dst, uint64_t seq) { recv_data(root_, dst, seq, Clock::now() + 2 * timeout_, 0); }

  Duration timeout_;
  std::vector<Socket> peers_;  // rank 0: one per rank (index 0 unused)
  Socket root_;                // others: the connection to rank 0
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::string failure_;
  uint64_t seq_ = 0;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_tcp_group(std::shared_ptr<TCPStore> store, int rank, int world_size,
                                             Duration timeout) {
  return std::make_shared<TcpGroup>(std::move(store), rank, world_size, timeout);
}

}  // namespace flame::dist
