#include "exit_codes.h"

#include <sys/wait.h>

#include <cstring>
#include <string>

namespace fsdp_run {

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kExitInternal;
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + "), exit code " +
           std::to_string(128 + sig);
  }
  return "exited with code " + std::to_string(exit_code_of(status));
}

}  // namespace fsdp_run
