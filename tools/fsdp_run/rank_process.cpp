#include "rank_process.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <string>
#include <vector>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "exit_codes.h"
#include "signals.h"

extern char** environ;

namespace fsdp_run {

std::vector<char*> as_c_array(std::vector<std::string>& strings) {
  std::vector<char*> ptrs;
  for (std::string& str : strings) ptrs.push_back(str.data());
  ptrs.push_back(nullptr);
  return ptrs;
}

[[noreturn]] void become_rank(char** argv, char** envp, int out_w, int err_w, int status_w, pid_t launcher_pid,
                              const sigset_t& original_mask) {
  // Own process group: SIGTERM to the group also reaches the rank's children,
  // and a Ctrl-C in the terminal reaches only the launcher, which then stops
  // the ranks in order.
  ::setpgid(0, 0);
#ifdef __linux__
  // Safety net: if the launcher is SIGKILLed it cannot clean up, so have the
  // kernel kill the rank instead of leaving it orphaned.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher_pid) ::_exit(kExitInternal);  // launcher already gone
#else
  (void)launcher_pid;
#endif
  restore_default_signals(original_mask);
  // Ranks run outside the terminal's foreground group, where reading the
  // terminal would stop them with SIGTTIN; give them an empty stdin.
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
  ::dup2(out_w, STDOUT_FILENO);
  ::dup2(err_w, STDERR_FILENO);
  environ = envp;  // execvp() searches PATH and passes `environ` on
  ::execvp(argv[0], argv);
  int err = errno;
  (void)!::write(status_w, &err, sizeof err);  // tell the launcher why
  ::_exit(kExitCannotExec);
}

}  // namespace fsdp_run
