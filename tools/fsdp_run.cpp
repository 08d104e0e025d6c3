// fsdp-run: start one process per local rank with torchrun-style environment
// variables, forward their output line by line, and stop all of them as soon
// as one fails or the launcher itself is interrupted.
//
//   fsdp-run [options] PROGRAM [ARGS...]
//
// Design notes
// - Every rank runs in its own process group, so signalling the group also
//   reaches anything the rank started (data loaders, shells, ...).
// - The launcher is single-threaded: one poll() loop watches every rank pipe
//   plus a self-pipe that the signal handlers write to. All real work
//   (reaping, stopping, printing) therefore happens outside signal context.
// - Output is written with write(2) in whole lines, so lines of different
//   ranks can never be cut into each other and nothing sits in a buffer.

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#ifdef __linux__
#include <sys/prctl.h>
#endif

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kExitUsage = 2;         // bad command line
constexpr int kExitInternal = 1;      // the launcher itself could not do its job
constexpr int kExitCannotExec = 127;  // same code a shell uses for "command not found"
// A rank printing a very long line without a newline is forwarded in pieces of
// this size, so one chatty rank cannot make the launcher buffer without bound.
constexpr size_t kMaxPendingBytes = 64 * 1024;
// After SIGKILL, how long to keep reading pipes that some escaped descendant
// (one that left the rank's process group) may still hold open.
constexpr auto kDrainAfterKill = std::chrono::seconds(2);

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

struct Options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool no_prefix = false;
  std::optional<int> threads_per_rank;
  double grace_seconds = 5.0;
  std::vector<std::string> command;  // PROGRAM ARGS...
};

std::string format_seconds(double seconds) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g s", seconds);
  return buf;
}

// Returns an explanation of the first invalid setting, or "" if all are fine.
std::string validate(const Options& o) {
  auto s = [](auto v) {
    return std::to_string(v);
  };
  if (o.nproc_per_node < 1)
    return "--nproc-per-node must be at least 1 (got " + s(o.nproc_per_node) +
           "); pass the number of ranks to start on this node, e.g. --nproc-per-node 2";
  if (o.nnodes < 1)
    return "--nnodes must be at least 1 (got " + s(o.nnodes) +
           "); pass the number of machines taking part, or leave it out for a single machine";
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    return "--node-rank must be between 0 and --nnodes - 1 = " + s(o.nnodes - 1) + " (got " + s(o.node_rank) +
           "); give every node a distinct rank below --nnodes";
  if (o.master_addr.empty()) return "--master-addr must not be empty; pass the host name or IP address of node 0";
  if (o.master_port < 1 || o.master_port > 65535)
    return "--master-port must be between 1 and 65535 (got " + s(o.master_port) +
           "); pick a free TCP port, e.g. --master-port 29500";
  if (o.threads_per_rank && *o.threads_per_rank < 1)
    return "--threads-per-rank must be at least 1 (got " + s(*o.threads_per_rank) +
           "); or leave it out to split the CPU cores evenly between the ranks";
  if (!std::isfinite(o.grace_seconds) || o.grace_seconds < 0)
    return "--grace-seconds must be a non-negative number of seconds (got " + format_seconds(o.grace_seconds) +
           "), e.g. --grace-seconds 5";
  if (o.command.empty())
    return "no program given; usage: fsdp-run [OPTIONS] PROGRAM [ARGS...], "
           "e.g. fsdp-run --nproc-per-node 2 ./train --epochs 1";
  return "";
}

void print_usage_error(const std::string& what) {
  std::fprintf(stderr, "fsdp-run: %s\nRun 'fsdp-run --help' for all options.\n", what.c_str());
}

// CLI11 knows nothing of PROGRAM (it is taken via prefix_command), so spell
// out the usage line ourselves.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

// Parses argv into `o`. Returns an exit code if the launcher should stop right
// away (help printed, or bad input), nothing if it should go on.
std::optional<int> parse_command_line(int argc, char** argv, Options& o) {
  CLI::App app{"Start PROGRAM once per local rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
               "GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS set, forward the\n"
               "ranks' output prefixed with '[rank R] ', and stop every rank as soon as one fails.\n",
               "fsdp-run"};
  // Everything from PROGRAM on belongs to the program, including its flags.
  app.prefix_command();
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer("Exit code: 0 if all ranks succeed, else the first failing rank's code\n"
             "(128+N for a rank killed by signal N), 130/143 if fsdp-run got SIGINT/SIGTERM,\n"
             "2 for bad options, 127 if PROGRAM cannot be executed.");

  app.add_option("--nproc-per-node", o.nproc_per_node, "Ranks to start on this node")->capture_default_str();
  app.add_option("--nnodes", o.nnodes, "Number of nodes taking part")->capture_default_str();
  app.add_option("--node-rank", o.node_rank, "Index of this node, 0..nnodes-1")->capture_default_str();
  app.add_option("--master-addr", o.master_addr, "Address of node 0 (MASTER_ADDR)")->capture_default_str();
  app.add_option("--master-port", o.master_port, "Port on node 0 (MASTER_PORT)")->capture_default_str();
  app.add_flag("--no-prefix", o.no_prefix, "Do not prefix output lines with '[rank R] '");
  app.add_option("--threads-per-rank", o.threads_per_rank,
                 "OMP_NUM_THREADS for each rank (default: keep an existing OMP_NUM_THREADS,\n"
                 "else CPU cores / nproc-per-node, at least 1)");
  app.add_option("--grace-seconds", o.grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    print_usage_error(e.what());
    return kExitUsage;
  }

  o.command = app.remaining();
  // "fsdp-run [options] -- PROGRAM ...": the separator is not part of the command.
  if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
  // With prefix_command() CLI11 hands unknown launcher options over as if they
  // were the program; a program name starting with '-' is almost surely a typo.
  if (!o.command.empty() && o.command.front().size() > 1 && o.command.front()[0] == '-') {
    print_usage_error("unknown option '" + o.command.front() +
                      "'; put launcher options before PROGRAM, see the list below --help");
    return kExitUsage;
  }
  if (std::string problem = validate(o); !problem.empty()) {
    print_usage_error(problem);
    return kExitUsage;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// Small POSIX helpers
// ---------------------------------------------------------------------------

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

std::string errno_text(int err) { return std::strerror(err); }

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

int usable_cpu_count() {
#ifdef __linux__
  // Honour taskset / cpuset limits, not just the number of cores installed.
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// ---------------------------------------------------------------------------
// Signals: the handlers only set a flag and wake the poll loop.
// ---------------------------------------------------------------------------

int g_wake_pipe[2] = {-1, -1};
volatile sig_atomic_t g_got_sigint = 0;
volatile sig_atomic_t g_got_sigterm = 0;

extern "C" void on_signal(int signo) {
  int saved_errno = errno;
  if (signo == SIGINT) g_got_sigint = 1;
  if (signo == SIGTERM) g_got_sigterm = 1;
  char byte = 0;
  // If the pipe is full a wake-up is already pending, which is all we need.
  (void)!::write(g_wake_pipe[1], &byte, 1);
  errno = saved_errno;
}

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

// In a freshly forked rank: undo everything the launcher changed, because
// ignored signals (SIGPIPE) would otherwise stay ignored across exec.
void restore_default_signals(const sigset_t& original_mask) {
  for (int signo : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) ::signal(signo, SIG_DFL);
  ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);
}

void drain_wake_pipe() {
  char buf[256];
  while (::read(g_wake_pipe[0], buf, sizeof buf) > 0) {
  }
}

// ---------------------------------------------------------------------------
// Output forwarding
// ---------------------------------------------------------------------------

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
  void pump(Stream& s, bool until_empty) {
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

  // Forwards a last line that lacked its newline, ending it so the next
  // line starts on a line of its own, and closes the pipe.
  void close(Stream& s) {
    if (!s.pending.empty()) {
      deliver(s, s.prefix + s.pending + "\n");
      s.pending.clear();
      s.line = Stream::Line::kClosed;
    }
    ::close(s.fd);
    s.fd = -1;
  }

  // A message from the launcher itself, on stderr.
  void say(const std::string& message) { deliver(nullptr, STDERR_FILENO, "fsdp-run: " + message + "\n"); }

  // Ends a progress bar left on the last line, so the shell prompt does not
  // overwrite it.
  void finish() {
    for (int fd : {STDOUT_FILENO, STDERR_FILENO})
      if (open_line_[fd] != nullptr) deliver(nullptr, fd, "\n");
  }

 private:
  // Forwards every complete line in s.pending. '\r' counts as a line end so
  // progress bars redrawn in place show up at once.
  void forward_complete_lines(Stream& s) {
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

  // Appends one piece of output, ending in '\n' or '\r', to `out`.
  static void format_piece(Stream& s, std::string_view piece, std::string& out) {
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

  void deliver(Stream& s, const std::string& text) { deliver(&s, s.dest, text); }

  void deliver(Stream* from, int fd, const std::string& text) {
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

  // Per launcher fd (1, 2): the stream whose '\r'-ended piece was written
  // there last, i.e. whose line the cursor is on. Streams from different fds
  // are not coordinated: the two may be different files.
  Stream* open_line_[3] = {nullptr, nullptr, nullptr};
};

// ---------------------------------------------------------------------------
// Ranks
// ---------------------------------------------------------------------------

struct Rank {
  int global_rank = 0;
  pid_t pid = -1;  // also the id of the rank's process group
  bool running = false;
  Stream out, err;
};

// The environment shared by all ranks: ours, minus the variables each rank
// gets its own value for.
std::vector<std::string> base_environment(bool set_omp_threads) {
  static const char* const kOverridden[] = {
      "RANK",      "WORLD_SIZE",  "LOCAL_RANK",  "LOCAL_WORLD_SIZE",       "GROUP_RANK",
      "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "FSDP_RUN_STDOUT_IS_TTY", "OMP_NUM_THREADS"};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view entry(*e);
    std::string_view name = entry.substr(0, entry.find('='));
    bool overridden =
        std::any_of(std::begin(kOverridden), std::end(kOverridden), [&](const char* v) { return name == v; });
    // An inherited OMP_NUM_THREADS is kept unless we set our own.
    if (name == "OMP_NUM_THREADS" && !set_omp_threads) overridden = false;
    if (!overridden) env.emplace_back(entry);
  }
  return env;
}

// OMP_NUM_THREADS for each rank, or nothing to leave the inherited value.
std::optional<int> omp_threads_per_rank(const Options& o) {
  if (o.threads_per_rank) return *o.threads_per_rank;
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return std::nullopt;
  // Without a limit every rank's thread pool would use all cores and the
  // ranks would fight over them.
  return std::max(1, usable_cpu_count() / o.nproc_per_node);
}

std::vector<std::string> rank_environment(const Options& o, int local_rank, const std::vector<std::string>& base,
                                          std::optional<int> omp_threads, bool stdout_is_tty) {
  auto s = [](long long v) {
    return std::to_string(v);
  };
  std::vector<std::string> env = base;
  const long long n = o.nproc_per_node;
  env.push_back("RANK=" + s(o.node_rank * n + local_rank));
  env.push_back("WORLD_SIZE=" + s(o.nnodes * n));
  env.push_back("LOCAL_RANK=" + s(local_rank));
  env.push_back("LOCAL_WORLD_SIZE=" + s(n));
  env.push_back("GROUP_RANK=" + s(o.node_rank));
  env.push_back("NODE_RANK=" + s(o.node_rank));
  env.push_back("MASTER_ADDR=" + o.master_addr);
  env.push_back("MASTER_PORT=" + s(o.master_port));
  if (omp_threads) env.push_back("OMP_NUM_THREADS=" + s(*omp_threads));
  // The rank's own stdout is a pipe, so it cannot tell by itself whether a
  // progress bar would end up on a terminal.
  if (stdout_is_tty) env.push_back("FSDP_RUN_STDOUT_IS_TTY=1");
  return env;
}

std::vector<char*> as_c_array(std::vector<std::string>& strings) {
  std::vector<char*> ptrs;
  for (std::string& str : strings) ptrs.push_back(str.data());
  ptrs.push_back(nullptr);
  return ptrs;
}

// Runs in the child between fork and exec; never returns. Only
// async-signal-safe calls here (the launcher is single-threaded, but keep
// the habit).
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

// Maps a wait status to a shell-style exit code.
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

std::string count_ranks(int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

// ---------------------------------------------------------------------------
// The launcher
// ---------------------------------------------------------------------------

class Launcher {
 public:
  explicit Launcher(Options options) : opt_(std::move(options)) {}

  int run() {
    if (!install_signal_handlers()) {
      mux_.say("cannot create a pipe: " + errno_text(errno));
      return kExitInternal;
    }
    start_ranks();
    supervise();
    return result_.value_or(0);
  }

 private:
  // --- starting ------------------------------------------------------------

  void start_ranks() {
    const bool tty = ::isatty(STDOUT_FILENO) == 1;
    const std::optional<int> omp = omp_threads_per_rank(opt_);
    const std::vector<std::string> base = base_environment(omp.has_value());
    std::vector<std::string> args = opt_.command;
    std::vector<char*> argv = as_c_array(args);

    ranks_.resize(static_cast<size_t>(opt_.nproc_per_node));
    for (int local = 0; local < opt_.nproc_per_node; ++local) {
      // Stop starting ranks once one could not be started or we were told to stop.
      if (result_ || g_got_sigint || g_got_sigterm) break;
      Rank& r = ranks_[static_cast<size_t>(local)];
      r.global_rank = opt_.node_rank * opt_.nproc_per_node + local;
      std::vector<std::string> env = rank_environment(opt_, local, base, omp, tty);
      std::vector<char*> envp = as_c_array(env);
      start_rank(r, argv.data(), envp.data());
    }
  }

  // Forks and execs one rank, wiring its stdout/stderr to pipes. On failure
  // sets result_ and starts stopping the ranks already running.
  void start_rank(Rank& r, char** argv, char** envp) {
    int out_pipe[2], err_pipe[2], status_pipe[2];
    if (!make_pipe(out_pipe)) return;
    if (!make_pipe(err_pipe)) {
      close_pair(out_pipe);
      return;
    }
    if (!make_pipe(status_pipe)) {
      close_pair(out_pipe);
      close_pair(err_pipe);
      return;
    }

    // Block signals across fork so the child cannot run our handlers (which
    // would write to the launcher's wake pipe) before it resets them.
    sigset_t all, original;
    sigfillset(&all);
    ::sigprocmask(SIG_BLOCK, &all, &original);
    const pid_t launcher_pid = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) become_rank(argv, envp, out_pipe[1], err_pipe[1], status_pipe[1], launcher_pid, original);
    const int fork_errno = errno;
    ::sigprocmask(SIG_SETMASK, &original, nullptr);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    ::close(status_pipe[1]);

    if (pid < 0) {
      for (int fd : {out_pipe[0], err_pipe[0], status_pipe[0]}) ::close(fd);
      fail("cannot start rank " + std::to_string(r.global_rank) + ": fork: " + errno_text(fork_errno), kExitInternal);
      return;
    }
    // Also set the group from this side: whichever of parent and child runs
    // first, the group exists before anyone signals it.
    ::setpgid(pid, pid);
    r.pid = pid;
    r.running = true;
    const std::string prefix = opt_.no_prefix ? "" : "[rank " + std::to_string(r.global_rank) + "] ";
    r.out.fd = out_pipe[0];
    r.out.dest = STDOUT_FILENO;
    r.err.fd = err_pipe[0];
    r.err.dest = STDERR_FILENO;
    r.out.prefix = r.err.prefix = prefix;
    ::fcntl(r.out.fd, F_SETFL, O_NONBLOCK);
    ::fcntl(r.err.fd, F_SETFL, O_NONBLOCK);

    // The status pipe closes on a successful exec (close-on-exec) or carries
    // the errno of a failed one.
    int exec_errno = 0;
    ssize_t n;
    do n = ::read(status_pipe[0], &exec_errno, sizeof exec_errno);
    while (n < 0 && errno == EINTR);
    ::close(status_pipe[0]);
    if (n == static_cast<ssize_t>(sizeof exec_errno)) {
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      r.running = false;
      fail("cannot execute '" + opt_.command.front() + "': " + errno_text(exec_errno), kExitCannotExec);
    }
  }

  bool make_pipe(int fds[2]) {
    if (::pipe2(fds, O_CLOEXEC) == 0) return true;
    fail("cannot create a pipe: " + errno_text(errno) +
             (errno == EMFILE ? " (too many ranks for the open-file limit; see ulimit -n)" : ""),
         kExitInternal);
    return false;
  }
  static void close_pair(int fds[2]) {
    ::close(fds[0]);
    ::close(fds[1]);
  }

  // --- supervising ---------------------------------------------------------

  // Runs until every rank has been reaped and all their output forwarded.
  void supervise() {
    while (any_running() || any_stream_open()) {
      // All ranks are gone but something they started still holds a pipe:
      // clean up their process groups instead of waiting forever.
      if (!any_running() && !stopping_) begin_stopping();
      wait_for_events();
      handle_launcher_signals();
      reap_ranks();
      enforce_deadlines();
    }
    mux_.finish();
  }

  void wait_for_events() {
    std::vector<pollfd> fds{{g_wake_pipe[0], POLLIN, 0}};
    std::vector<Stream*> streams{nullptr};
    for (Rank& r : ranks_)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }

    int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms());
    if (ready <= 0) return;  // timeout, or EINTR from a signal: the loop handles both
    if (fds[0].revents != 0) drain_wake_pipe();
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents != 0) mux_.pump(*streams[i], /*until_empty=*/false);
  }

  // Until the next stop deadline, or forever when nothing is scheduled.
  int poll_timeout_ms() const {
    std::optional<Clock::time_point> deadline;
    if (stopping_ && !killed_) deadline = kill_at_;
    // Past give_up_at_ only unreaped ranks keep us here, and their SIGCHLD
    // will wake the poll.
    if (killed_ && Clock::now() < give_up_at_) deadline = give_up_at_;
    if (!deadline) return -1;
    auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(left, 0, 60'000));
  }

  void handle_launcher_signals() {
    int signo = g_got_sigint ? SIGINT : g_got_sigterm ? SIGTERM : 0;
    if (signo == 0) return;
    g_got_sigint = g_got_sigterm = 0;
    const char* name = signo == SIGINT ? "SIGINT" : "SIGTERM";
    if (!result_) result_ = 128 + signo;
    if (!stopping_) {
      mux_.say(std::string("received ") + name + "; stopping " + count_ranks(running_count()) + " (SIGKILL after " +
               grace_text() + "; signal again to kill now)");
      begin_stopping();
    } else if (!killed_) {
      mux_.say(std::string("received ") + name + " while stopping; killing the ranks now");
      kill_all();
    }
  }

  void reap_ranks() {
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      pid_t p = ::waitpid(r.pid, &status, WNOHANG);
      if (p == 0 || (p < 0 && errno == EINTR)) continue;
      r.running = false;
      if (p == r.pid) on_rank_exit(r, status);
    }
  }

  void on_rank_exit(Rank& r, int status) {
    const int code = exit_code_of(status);
    // Ranks ending while we stop them are expected; only the first real
    // failure is reported and decides the exit code.
    if (code == 0 || stopping_) return;
    // Show the rank's last words (usually its error) before our verdict.
    mux_.pump(r.out, /*until_empty=*/true);
    mux_.pump(r.err, /*until_empty=*/true);
    std::string msg =
        "rank " + std::to_string(r.global_rank) + " (pid " + std::to_string(r.pid) + ") " + describe_exit(status);
    if (int others = running_count(); others > 0) msg += "; stopping the other " + count_ranks(others);
    fail(msg, code);
  }

  // Records the first failure and starts stopping everything.
  void fail(const std::string& message, int code) {
    mux_.say(message);
    if (!result_) result_ = code;
    begin_stopping();
  }

  // SIGTERM to every rank's process group; SIGKILL follows after the grace
  // period (see enforce_deadlines).
  void begin_stopping() {
    if (stopping_) return;
    stopping_ = true;
    signal_all_groups(SIGTERM);
    signal_all_groups(SIGCONT);  // a stopped (SIGSTOP) rank must wake up to see SIGTERM
    kill_at_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt_.grace_seconds));
  }

  void kill_all() {
    stopping_ = killed_ = true;
    signal_all_groups(SIGKILL);
    give_up_at_ = Clock::now() + kDrainAfterKill;
  }

  void enforce_deadlines() {
    const auto now = Clock::now();
    if (stopping_ && !killed_ && now >= kill_at_) {
      if (int n = running_count(); n > 0)
        mux_.say("killing " + count_ranks(n) + " still running after " + grace_text());
      kill_all();
    } else if (killed_ && now >= give_up_at_ && !any_running()) {
      // Only processes that left the ranks' process groups can still hold
      // the pipes now; stop waiting for them.
      for (Rank& r : ranks_)
        for (Stream* s : {&r.out, &r.err})
          if (s->fd >= 0) mux_.close(*s);
    }
  }

  // Signals groups of exited ranks too: what a rank started may outlive it.
  void signal_all_groups(int signo) {
    for (const Rank& r : ranks_)
      if (r.pid > 0) ::kill(-r.pid, signo);
  }

  // --- bookkeeping -----------------------------------------------------------

  bool any_running() const { return running_count() > 0; }
  int running_count() const {
    return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; }));
  }
  bool any_stream_open() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.out.fd >= 0 || r.err.fd >= 0; });
  }
  std::string grace_text() const { return format_seconds(opt_.grace_seconds); }

  Options opt_;
  OutputMux mux_;
  std::vector<Rank> ranks_;    // sized once: OutputMux keeps pointers to the streams
  std::optional<int> result_;  // exit code of the first failure, if any
  bool stopping_ = false;      // SIGTERM sent
  bool killed_ = false;        // SIGKILL sent
  Clock::time_point kill_at_;
  Clock::time_point give_up_at_;
};

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (std::optional<int> code = parse_command_line(argc, argv, options)) return *code;
  ensure_standard_fds_open();
  return Launcher(std::move(options)).run();
}
