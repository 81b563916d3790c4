// Process helpers of the flame::dist tests (test_dist_util.h).
#include "test_dist_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#ifndef FLAME_RUN_PATH
#define FLAME_RUN_PATH "flame-run"
#endif

namespace flame::test::dist_test {

namespace {

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "flame_tests";
  buf[n] = '\0';
  return buf;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// fork + execve with everything prepared before the fork (only async-signal-safe calls after it).
pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& out_path) {
  std::map<std::string, std::string> all;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) all[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) all[k] = v;
  std::vector<std::string> envs;
  for (const auto& [k, v] : all) envs.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : envs) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  if (fd >= 0) ::close(fd);
  return pid;
}

}  // namespace

bool using_nccl() {
  const char* d = std::getenv("FLAME_TEST_DEVICE");
  return d && std::string(d) == "cuda";
}

int max_ranks() {
  if (!using_nccl()) return 4;
  if (!dist::nccl_available() || !cuda_is_available()) return 0;
  return cuda_device_count();
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 29500;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) ::close(fd);
  return port;
}

bool RanksResult::all_ok() const {
  for (int s : status)
    if (!WIFEXITED(s) || WEXITSTATUS(s) != 0) return false;
  return !status.empty();
}

std::string RanksResult::report() const {
  std::string r;
  for (std::size_t k = 0; k < status.size(); ++k) {
    const int s = status[k];
    r += "---- rank " + std::to_string(k) + ": " +
         (WIFEXITED(s) ? "exit " + std::to_string(WEXITSTATUS(s))
                       : WIFSIGNALED(s) ? "signal " + std::to_string(WTERMSIG(s)) : "?") +
         "\n";
    const std::string& o = output[k];
    r += o.size() > 4000 ? "..." + o.substr(o.size() - 4000) : o;
  }
  return r;
}

RanksResult run_ranks(const std::string& worker, int world, const std::map<std::string, std::string>& env,
                      double timeout_s, int kill_after) {
  TempDir logs;
  const int port = free_port();
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::string> e = env;
    e["FLAME_DIST_WORKER"] = worker;
    e["FLAME_DIST_TEST_BACKEND"] = using_nccl() ? "nccl" : "tcp";
    e["RANK"] = std::to_string(r);
    e["WORLD_SIZE"] = std::to_string(world);
    e["LOCAL_RANK"] = std::to_string(r);
    e["LOCAL_WORLD_SIZE"] = std::to_string(world);
    e["MASTER_ADDR"] = "127.0.0.1";
    e["MASTER_PORT"] = std::to_string(port);
    e["NCCL_NVLS_ENABLE"] = "0";
    outs.push_back(logs.path + "/rank" + std::to_string(r) + ".log");
    pids.push_back(spawn({self_exe()}, e, outs.back()));
  }
  RanksResult res;
  res.status.assign(static_cast<std::size_t>(world), -1);
  std::vector<bool> done(static_cast<std::size_t>(world), false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  int finished = 0;
  bool killed = false;
  while (finished < world) {
    for (int r = 0; r < world; ++r) {
      if (done[static_cast<std::size_t>(r)]) continue;
      int st = 0;
      if (waitpid(pids[static_cast<std::size_t>(r)], &st, WNOHANG) == pids[static_cast<std::size_t>(r)]) {
        done[static_cast<std::size_t>(r)] = true;
        res.status[static_cast<std::size_t>(r)] = st;
        ++finished;
      }
    }
    if (!killed && ((kill_after > 0 && finished >= kill_after) || std::chrono::steady_clock::now() > deadline)) {
      killed = true;
      for (int r = 0; r < world; ++r)
        if (!done[static_cast<std::size_t>(r)]) kill(-pids[static_cast<std::size_t>(r)], SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (const auto& o : outs) res.output.push_back(read_file(o));
  return res;
}

LauncherResult run_launcher(const std::vector<std::string>& args, const std::string& worker,
                            const std::map<std::string, std::string>& env, double timeout_s, double sigterm_after_s) {
  TempDir logs;
  std::vector<std::string> argv = {FLAME_RUN_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back(self_exe());
  std::map<std::string, std::string> e = env;
  e["FLAME_DIST_WORKER"] = worker;
  e["FLAME_DIST_TEST_BACKEND"] = using_nccl() ? "nccl" : "tcp";
  const std::string out = logs.path + "/launcher.log";
  const pid_t pid = spawn(argv, e, out);
  LauncherResult res;
  const auto start = std::chrono::steady_clock::now();
  bool termed = false, killed = false;
  for (;;) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      res.status = st;
      break;
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (sigterm_after_s >= 0 && !termed && t > sigterm_after_s) {
      termed = true;
      kill(pid, SIGTERM);
    }
    if (!killed && t > timeout_s) {
      killed = true;
      kill(-pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  res.output = read_file(out);
  return res;
}

EnvGuard::EnvGuard(std::vector<std::string> names) {
  for (auto& n : names) {
    const char* v = std::getenv(n.c_str());
    saved.emplace_back(n, v ? std::optional<std::string>(v) : std::nullopt);
    unsetenv(n.c_str());
  }
}
EnvGuard::~EnvGuard() {
  for (auto& [n, v] : saved) {
    if (v) setenv(n.c_str(), v->c_str(), 1);
    else unsetenv(n.c_str());
  }
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "flame_dist_XXXXXX").string();
  path = mkdtemp(tmpl.data()) ? tmpl : std::string("/tmp");
}
TempDir::~TempDir() {
  std::error_code ec;
  if (path != "/tmp") std::filesystem::remove_all(path, ec);
}

}  // namespace flame::test::dist_test
