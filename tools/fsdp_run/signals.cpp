#include "signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <initializer_list>

namespace fsdp_run {

int g_wake_pipe[2] = {-1, -1};
volatile sig_atomic_t g_got_sigint = 0;
volatile sig_atomic_t g_got_sigterm = 0;

namespace {

extern "C" void on_signal(int signo) {
  int saved_errno = errno;
  if (signo == SIGINT) g_got_sigint = 1;
  if (signo == SIGTERM) g_got_sigterm = 1;
  char byte = 0;
  // If the pipe is full a wake-up is already pending, which is all we need.
  (void)!::write(g_wake_pipe[1], &byte, 1);
  errno = saved_errno;
}

}  // namespace

bool install_signal_handlers() {
  if (::pipe2(g_wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int signo : {SIGINT, SIGTERM, SIGCHLD}) ::sigaction(signo, &sa, nullptr);
  // A closed stdout must not kill the launcher and orphan the ranks;
  // write_all() copes with EPIPE instead.
  ::signal(SIGPIPE, SIG_IGN);
  return true;
}

void restore_default_signals(const sigset_t& original_mask) {
  for (int signo : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) ::signal(signo, SIG_DFL);
  ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);
}

void drain_wake_pipe() {
  char buf[256];
  while (::read(g_wake_pipe[0], buf, sizeof buf) > 0) {
  }
}

}  // namespace fsdp_run
