// flame-run: the launcher of FLAME's multi-process jobs (docs/distributed.md).
//
//   flame-run --nproc-per-node N [--nnodes M --node-rank R --master ADDR:PORT] [--grace S]
//             program args...
//
// Note [Launcher]
// Starts N processes of `program` with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT; NCCL_NVLS_ENABLE=0 unless set), each in
// its own process group and with a parent-death signal, so that a rank's children go with it and
// nothing outlives the launcher. SIGINT/SIGTERM/SIGHUP are forwarded to every rank. When a rank
// exits non-zero or is killed, the launcher names it ("rank 3 (local 1, pid 1234) was killed by
// signal 9 (SIGKILL)"), sends SIGTERM to the others, SIGKILL after the grace period, and exits
// with that rank's status (128 + signal for a signal). Several "nodes" on one host are several
// launchers with the same --master and --nnodes; they do not talk to each other: the ranks find
// each other through the store rank 0 serves at --master.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;
  double grace = 5.0;
  std::vector<std::string> argv;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "flame-run: %s\n"
               "usage: flame-run --nproc-per-node N [--nnodes M --node-rank R --master ADDR:PORT] [--grace SECONDS]\n"
               "                 program [args...]\n",
               why.c_str());
  std::exit(2);
}

int parse_int(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end != '\0') usage(flag + " needs an integer, got '" + v + "'");
  return static_cast<int>(x);
}

Options parse(int argc, char** argv) {
  Options o;
  bool master_given = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) break;
    if (a == "--") {
      ++i;
      break;
    }
    std::string value;
    const auto eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= argc) usage(a + " needs a value");
      value = argv[++i];
    }
    for (char& c : a)
      if (c == '_') c = '-';
    if (a == "--nproc-per-node") o.nproc = parse_int(a, value.c_str());
    else if (a == "--nnodes") o.nnodes = parse_int(a, value.c_str());
    else if (a == "--node-rank") o.node_rank = parse_int(a, value.c_str());
    else if (a == "--grace") o.grace = std::atof(value.c_str());
    else if (a == "--master") {
      const auto colon = value.rfind(':');
      if (colon == std::string::npos) usage("--master needs ADDR:PORT, got '" + value + "'");
      o.master_addr = value.substr(0, colon);
      o.master_port = parse_int("--master port", value.substr(colon + 1).c_str());
      master_given = true;
    } else {
      usage("unknown option " + a);
    }
  }
  for (; i < argc; ++i) o.argv.emplace_back(argv[i]);
  if (o.argv.empty()) usage("no program given");
  if (o.nproc < 1) usage("--nproc-per-node must be >= 1");
  if (o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) usage("--node-rank must be in [0, --nnodes)");
  if (o.nnodes > 1 && !master_given) usage("--nnodes > 1 needs --master ADDR:PORT (rank 0's host)");
  return o;
}

// A free port for a one-node job without --master (bind to port 0, read it back).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 29500;
  }
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

struct Child {
  pid_t pid = -1;
  int rank = 0;
  int local_rank = 0;
  bool running = false;
  int status = 0;
};

std::string describe(const Child& c) {
  char buf[256];
  if (WIFSIGNALED(c.status)) {
    const int sig = WTERMSIG(c.status);
    std::snprintf(buf, sizeof buf, "rank %d (local rank %d, pid %d) was killed by signal %d (SIG%s)", c.rank,
                  c.local_rank, static_cast<int>(c.pid), sig, sigabbrev_np(sig) ? sigabbrev_np(sig) : "?");
  } else {
    std::snprintf(buf, sizeof buf, "rank %d (local rank %d, pid %d) exited with status %d", c.rank, c.local_rank,
                  static_cast<int>(c.pid), WEXITSTATUS(c.status));
  }
  return buf;
}

bool failed(int status) { return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0); }

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  if (o.master_port < 0) o.master_port = free_port();
  const int world = o.nproc * o.nnodes;

  sigset_t handled;
  sigemptyset(&handled);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&handled, s);
  sigprocmask(SIG_BLOCK, &handled, nullptr);
  const pid_t launcher = getpid();

  std::vector<Child> children(static_cast<std::size_t>(o.nproc));
  for (int l = 0; l < o.nproc; ++l) {
    Child& c = children[static_cast<std::size_t>(l)];
    c.local_rank = l;
    c.rank = o.node_rank * o.nproc + l;
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("flame-run: fork");
      return 1;
    }
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(1);  // the launcher died before prctl
      sigprocmask(SIG_UNBLOCK, &handled, nullptr);
      auto set = [](const char* k, const std::string& v) { setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(c.rank));
      set("WORLD_SIZE", std::to_string(world));
      set("LOCAL_RANK", std::to_string(l));
      set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
      set("NODE_RANK", std::to_string(o.node_rank));
      set("GROUP_RANK", std::to_string(o.node_rank));
      set("MASTER_ADDR", o.master_addr);
      set("MASTER_PORT", std::to_string(o.master_port));
      setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off unless asked for
      std::vector<char*> args;
      for (auto& a : o.argv) args.push_back(a.data());
      args.push_back(nullptr);
      execvp(args[0], args.data());
      std::fprintf(stderr, "flame-run: cannot run %s: %s\n", args[0], std::strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);
    c.pid = pid;
    c.running = true;
  }
  std::fprintf(stderr, "flame-run: started %d rank(s) %d..%d of %d (node %d of %d), master %s:%d\n", o.nproc,
               o.node_rank * o.nproc, o.node_rank * o.nproc + o.nproc - 1, world, o.node_rank, o.nnodes,
               o.master_addr.c_str(), o.master_port);

  using Clock = std::chrono::steady_clock;
  int exit_code = 0;
  bool tearing_down = false;
  Clock::time_point kill_at{};
  auto signal_all = [&](int sig) {
    for (const Child& c : children)
      if (c.running) kill(-c.pid, sig);
  };
  auto start_teardown = [&](int sig) {
    if (tearing_down) return;
    tearing_down = true;
    signal_all(sig);
    kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace * 1000));
  };

  // Reaps what has exited; returns the children reaped, in order.
  auto reap = [&]() {
    std::vector<Child*> out;
    for (;;) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (Child& c : children) {
        if (c.pid != pid || !c.running) continue;
        c.running = false;
        c.status = status;
        out.push_back(&c);
      }
    }
    return out;
  };
  for (;;) {
    std::vector<Child*> exited = reap();
    bool new_failure = false;
    for (Child* c : exited) new_failure = new_failure || failed(c->status);
    if (new_failure && !tearing_down && exit_code == 0) {
      // The first failure often takes peers down within milliseconds (they see it die): collect
      // those too, and blame a rank killed by a signal before one that exited with an error.
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      for (Child* c : reap()) exited.push_back(c);
      Child* root = nullptr;
      for (Child* c : exited)
        if (failed(c->status) && WIFSIGNALED(c->status) && !root) root = c;
      for (Child* c : exited)
        if (failed(c->status) && !root) root = c;
      std::fprintf(stderr, "flame-run: %s; stopping the other ranks\n", describe(*root).c_str());
      exit_code = WIFSIGNALED(root->status) ? 128 + WTERMSIG(root->status) : WEXITSTATUS(root->status);
      for (Child* c : exited)
        if (c != root && failed(c->status)) std::fprintf(stderr, "flame-run: %s\n", describe(*c).c_str());
      start_teardown(SIGTERM);
    } else {
      for (Child* c : exited)
        if (failed(c->status)) std::fprintf(stderr, "flame-run: %s\n", describe(*c).c_str());
    }
    bool any = false;
    for (const Child& c : children) any = any || c.running;
    if (!any) break;
    if (tearing_down && Clock::now() >= kill_at) {
      std::fprintf(stderr, "flame-run: grace period over; killing the ranks still running\n");
      signal_all(SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(1);
    }
    timespec ts{0, 50 * 1000 * 1000};
    siginfo_t info;
    const int sig = sigtimedwait(&handled, &info, &ts);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      std::fprintf(stderr, "flame-run: got signal %d (SIG%s); forwarding it to the ranks\n", sig, sigabbrev_np(sig));
      if (exit_code == 0) exit_code = 128 + sig;
      start_teardown(sig);
    }
  }
  if (exit_code != 0) std::fprintf(stderr, "flame-run: exit status %d\n", exit_code);
  return exit_code;
}
