#pragma once
// A rank's side of the fork: from the forked launcher to the exec'ed program.
#include <sys/types.h>

#include <csignal>
#include <string>
#include <vector>

namespace fsdp_run {

// Pointers to `strings` followed by nullptr, for execvp's argv and envp.
std::vector<char*> as_c_array(std::vector<std::string>& strings);

// Runs in the child between fork and exec; never returns. Only
// async-signal-safe calls here (the launcher is single-threaded, but keep
// the habit). Its stdout and stderr go to `out_w` and `err_w`; a failed exec
// writes its errno to `status_w`.
[[noreturn]] void become_rank(char** argv, char** envp, int out_w, int err_w, int status_w, pid_t launcher_pid,
                              const sigset_t& original_mask);

}  // namespace fsdp_run
