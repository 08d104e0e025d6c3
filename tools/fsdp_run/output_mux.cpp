#include "output_mux.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>

namespace fsdp_run {

namespace {

// A rank printing a very long line without a newline is forwarded in pieces of
// this size, so one chatty rank cannot make the launcher buffer without bound.
constexpr size_t kMaxPendingBytes = 64 * 1024;

// Writes all of `data`, retrying short writes. If the reader went away
// (EPIPE) the output is dropped: losing log lines must not stop the ranks'
// supervision.
void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      // Someone made our stdout non-blocking; wait until it drains.
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else if (errno != EINTR) {
      return;
    }
  }
}

}  // namespace

void OutputMux::pump(Stream& s, bool until_empty) {
  char buf[64 * 1024];
  while (s.fd >= 0) {
    ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      s.pending.append(buf, static_cast<size_t>(n));
      forward_complete_lines(s);
      if (!until_empty) return;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {  // EOF, or an error that leaves nothing more to read
      close(s);
    }
  }
}

void OutputMux::close(Stream& s) {
  if (!s.pending.empty()) {
    deliver(s, s.prefix + s.pending + "\n");
    s.pending.clear();
    s.line = Stream::Line::kClosed;
  }
  ::close(s.fd);
  s.fd = -1;
}

void OutputMux::say(const std::string& message) { deliver(nullptr, STDERR_FILENO, "fsdp-run: " + message + "\n"); }

void OutputMux::finish() {
  for (int fd : {STDOUT_FILENO, STDERR_FILENO})
    if (open_line_[fd] != nullptr) deliver(nullptr, fd, "\n");
}

void OutputMux::forward_complete_lines(Stream& s) {
  std::string out;
  size_t start = 0;
  for (size_t i = 0; i < s.pending.size(); ++i) {
    if (s.pending[i] == '\n' || s.pending[i] == '\r') {
      format_piece(s, std::string_view(s.pending).substr(start, i + 1 - start), out);
      start = i + 1;
    }
  }
  s.pending.erase(0, start);
  // Bound the memory a rank printing endlessly without a newline can take.
  if (s.pending.size() >= kMaxPendingBytes) {
    out += s.prefix + s.pending + "\n";
    s.pending.clear();
    s.line = Stream::Line::kClosed;
  }
  deliver(s, out);
}

void OutputMux::format_piece(Stream& s, std::string_view piece, std::string& out) {
  using Line = Stream::Line;
  // A lone '\r' right after a line end moves the cursor nowhere.
  if (piece == "\r") return;
  // "\r\n" (or a bar finished with '\n'): the text is already shown, only
  // end its line, unless another stream's output has done so already.
  if (piece == "\n" && s.line != Line::kClosed) {
    if (s.line == Line::kOpen) out += '\n';
    s.line = Line::kClosed;
    return;
  }
  out += s.prefix;
  out += piece;
  s.line = piece.back() == '\r' ? Line::kOpen : Line::kClosed;
}

void OutputMux::deliver(Stream& s, const std::string& text) { deliver(&s, s.dest, text); }

void OutputMux::deliver(Stream* from, int fd, const std::string& text) {
  if (text.empty()) return;
  // Another stream's progress bar is on the current line: end that line
  // first, or our text would overwrite part of it and leave a mix.
  Stream*& open = open_line_[fd];
  if (open != nullptr && open != from) {
    write_all(fd, "\n");
    if (open->line == Stream::Line::kOpen) open->line = Stream::Line::kCut;
    open = nullptr;
  }
  write_all(fd, text);
  open = from != nullptr && text.back() == '\r' ? from : nullptr;
}

}  // namespace fsdp_run
