#pragma once
// fsdp-run's exit codes: its own, and those it passes on from a rank's wait status.
#include <string>

namespace fsdp_run {

constexpr int kExitUsage = 2;         // bad command line
constexpr int kExitInternal = 1;      // the launcher itself could not do its job
constexpr int kExitCannotExec = 127;  // same code a shell uses for "command not found"

// Maps a wait status to a shell-style exit code.
int exit_code_of(int status);

// "exited with code N", or "was killed by signal N (NAME), exit code 128+N", for a wait status.
std::string describe_exit(int status);

}  // namespace fsdp_run
