#pragma once
// Output relaying: the ranks' stdout and stderr, and the launcher's own messages, onto the
// launcher's stdout and stderr in whole lines, prefixed with "[rank R] ". Output is written with
// write(2) in whole lines, so lines of different ranks can never be cut into each other and
// nothing sits in a buffer.
#include <string>
#include <string_view>

namespace fsdp_run {

// One of a rank's output pipes (stdout or stderr) and where it is forwarded.
struct Stream {
  // Where the last forwarded piece left this stream's line on the terminal.
  enum class Line {
    kClosed,  // ended in '\n': the next piece starts a fresh line
    kOpen,    // ended in '\r' (progress bar): the cursor sits on our line
    kCut,     // ended in '\r', but another stream's output ended our line
  };
  int fd = -1;          // read end; -1 once the pipe is closed
  int dest = -1;        // STDOUT_FILENO or STDERR_FILENO
  std::string prefix;   // "[rank R] ", or "" with --no-prefix
  std::string pending;  // bytes after the last forwarded line terminator
  Line line = Line::kClosed;
};

// Puts the output of all ranks, and the launcher's own messages, onto the
// launcher's stdout and stderr, one whole line at a time.
class OutputMux {
 public:
  // Reads what the (non-blocking) pipe has and forwards the complete lines.
  // Reads once, or with `until_empty` until the pipe has nothing more.
  void pump(Stream& s, bool until_empty);

  // Forwards a last line that lacked its newline, ending it so the next
  // line starts on a line of its own, and closes the pipe.
  void close(Stream& s);

  // A message from the launcher itself, on stderr.
  void say(const std::string& message);

  // Ends a progress bar left on the last line, so the shell prompt does not
  // overwrite it.
  void finish();

 private:
  // Forwards every complete line in s.pending. '\r' counts as a line end so
  // progress bars redrawn in place show up at once.
  void forward_complete_lines(Stream& s);

  // Appends one piece of output, ending in '\n' or '\r', to `out`.
  static void format_piece(Stream& s, std::string_view piece, std::string& out);

  void deliver(Stream& s, const std::string& text);

  // Writes `text` to `fd`, first ending another stream's progress-bar line there.
  void deliver(Stream* from, int fd, const std::string& text);

  // Per launcher fd (1, 2): the stream whose '\r'-ended piece was written
  // there last, i.e. whose line the cursor is on. Streams from different fds
  // are not coordinated: the two may be different files.
  Stream* open_line_[3] = {nullptr, nullptr, nullptr};
};

}  // namespace fsdp_run
