#include "stop_signal.h"

#include <atomic>
#include <csignal>
#include <cstring>

namespace flame_diffusion {
namespace {

// Note [Graceful stop]
// The handler may run on any thread (the loader's worker too) at any point of the program, so it
// touches nothing but a lock-free atomic (async-signal-safe) on the first signal. On a second one
// it restores the default action and re-raises the signal (both async-signal-safe), so the process
// dies by that signal at once, as a shell expects of a second Ctrl-C. The loop polls stop_signal()
// between steps: a step in flight finishes, its checkpoint is written atomically (Checkpoint::save),
// and the command exits with 128 + signal.
std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the stop flag must be async-signal-safe");

extern "C" void on_stop_signal(int sig) {
  if (g_signal.load(std::memory_order_relaxed) != 0) {
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
    return;
  }
  g_signal.store(sig, std::memory_order_relaxed);
}

void set_action(void (*handler)(int)) {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // reads and writes in flight go on; the loop looks at the flag
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace

void install_stop_handlers() {
  g_signal.store(0);
  set_action(on_stop_signal);
}

void restore_default_stop_handlers() { set_action(SIG_DFL); }

int stop_signal() { return g_signal.load(std::memory_order_relaxed); }

std::string signal_name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(signal);
}

void throw_if_stopped(const std::string& what, const std::string& then) {
  if (const int s = stop_signal()) throw Interrupted(s, signal_name(s) + " during " + what + "; " + then);
}

}  // namespace flame_diffusion
