// fsdp-run: start one process per local rank with torchrun-style environment
// variables, forward their output line by line, and stop all of them as soon
// as one fails or the launcher itself is interrupted.
//
//   fsdp-run [options] PROGRAM [ARGS...]
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <utility>

#include "launcher.h"
#include "options.h"

namespace {

// If the launcher was started with fd 0, 1 or 2 closed, a new pipe could land
// on one of them and dup2() in the child would then be a no-op that leaves
// close-on-exec set. Occupying them with /dev/null rules that out.
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      int null_fd = ::open("/dev/null", O_RDWR);
      if (null_fd >= 0 && null_fd != fd) {
        ::dup2(null_fd, fd);
        ::close(null_fd);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  fsdp_run::Options options;
  if (std::optional<int> code = fsdp_run::parse_command_line(argc, argv, options)) return *code;
  ensure_standard_fds_open();
  return fsdp_run::launch(std::move(options));
}
