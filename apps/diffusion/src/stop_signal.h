#pragma once
// A graceful stop on SIGINT / SIGTERM (Note [Graceful stop] in stop_signal.cpp): the first signal
// only sets a flag, which the training loop reads after each step (it then saves a checkpoint, says
// where, and the program exits with 128 + the signal number, 130 for SIGINT and 143 for SIGTERM, as
// shells report a process killed by them); a second signal ends the process at once.
#include <stdexcept>
#include <string>

namespace flame_diffusion {

// Installs the handlers for SIGINT and SIGTERM (again: resets the flag).
void install_stop_handlers();
// Puts back the default actions (a multi-process run, whose ranks cannot agree on a stop step).
void restore_default_stop_handlers();
// 0, or the number of the first SIGINT / SIGTERM received since install_stop_handlers.
int stop_signal();
// "SIGINT", "SIGTERM" or "signal N".
std::string signal_name(int signal);

// Raised by the loop after it stopped for a signal (the checkpoint, if any, is saved): main prints
// what() and exits with exit_status().
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int signal, const std::string& message) : std::runtime_error(message), signal_(signal) {}
  int signal() const { return signal_; }
  int exit_status() const { return 128 + signal_; }

 private:
  int signal_;
};

// Raises Interrupted("<signal name> during <what>; <then>") when a stop signal arrived.
void throw_if_stopped(const std::string& what, const std::string& then);

}  // namespace flame_diffusion
