// Design notes
// - Every rank runs in its own process group, so signalling the group also
//   reaches anything the rank started (data loaders, shells, ...).
// - The launcher is single-threaded: one poll() loop watches every rank pipe
//   plus a self-pipe that the signal handlers write to. All real work
//   (reaping, stopping, printing) therefore happens outside signal context.
#include "launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "elastic.h"
#include "exit_codes.h"
#include "output_mux.h"
#include "rank_environment.h"
#include "rank_process.h"
#include "signals.h"

namespace fsdp_run {

namespace {

using Clock = std::chrono::steady_clock;

// After SIGKILL, how long to keep reading pipes that some escaped descendant
// (one that left the rank's process group) may still hold open.
constexpr auto kDrainAfterKill = std::chrono::seconds(2);

std::string errno_text(int err) { return std::strerror(err); }

// One rank started by this launcher: its process and its two output pipes.
struct Rank {
  int global_rank = 0;
  pid_t pid = -1;  // also the id of the rank's process group
  bool running = false;
  Stream out, err;
};

std::string count_ranks(int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

class Launcher {
 public:
  Launcher(Options options, int restart, const StartHooks& hooks)
      : opt_(std::move(options)), restart_(restart), hooks_(hooks) {}

  Attempt run() {
    start_ranks();
    supervise();
    return {result_.value_or(0), lost_, interrupted_};
  }

 private:
  // --- starting ------------------------------------------------------------

  void start_ranks() {
    const bool tty = ::isatty(STDOUT_FILENO) == 1;
    const std::optional<int> omp = omp_threads_per_rank(opt_);
    std::vector<std::string> base = base_environment(omp.has_value());
    if (std::optional<std::string> token = job_token_entry(opt_)) base.push_back(std::move(*token));
    base.push_back("FSDP_RESTART_COUNT=" + std::to_string(restart_));
    std::vector<std::string> args = opt_.command;
    std::vector<char*> argv = as_c_array(args);

    ranks_.resize(static_cast<size_t>(opt_.nproc_per_node));
    for (int local = 0; local < opt_.nproc_per_node; ++local) {
      // Stop starting ranks once one could not be started or we were told to stop.
      if (result_ || g_got_sigint || g_got_sigterm) break;
      Rank& r = ranks_[static_cast<size_t>(local)];
      r.global_rank = opt_.first_rank + local;
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
      handle_stop_request();
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
    interrupted_ = true;
    if (hooks_.on_failure) hooks_.on_failure(std::string("its fsdp-run received ") + name);
    if (!stopping_) {
      mux_.say(std::string("received ") + name + "; stopping " + count_ranks(running_count()) + " (SIGKILL after " +
               grace_text() + "; signal again to kill now)");
      begin_stopping();
    } else if (!killed_) {
      mux_.say(std::string("received ") + name + " while stopping; killing the ranks now");
      kill_all();
    }
  }

  // Another node's failure (StartHooks::stop_reason) stops this node's ranks too.
  void handle_stop_request() {
    if (stopping_ || !hooks_.stop_reason) return;
    const std::optional<std::string> why = hooks_.stop_reason();
    if (!why) return;
    mux_.say(*why + "; stopping " + count_ranks(running_count()));
    if (!result_) result_ = kExitInternal;
    begin_stopping();
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
    if (WIFSIGNALED(status)) lost_ = 1;
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
    if (!result_) {
      result_ = code;
      if (hooks_.on_failure && !stopping_) hooks_.on_failure(message);
    }
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
  int restart_ = 0;
  const StartHooks& hooks_;
  int lost_ = 0;
  bool interrupted_ = false;
  OutputMux mux_;
  std::vector<Rank> ranks_;    // sized once: OutputMux keeps pointers to the streams
  std::optional<int> result_;  // exit code of the first failure, if any
  bool stopping_ = false;      // SIGTERM sent
  bool killed_ = false;        // SIGKILL sent
  Clock::time_point kill_at_;
  Clock::time_point give_up_at_;
};

}  // namespace

Attempt run_ranks(const Options& options, int restart, const StartHooks& hooks) {
  return Launcher(options, restart, hooks).run();
}

int launch(Options options) {
  if (!install_signal_handlers()) {
    OutputMux().say("cannot create a pipe: " + errno_text(errno));
    return kExitInternal;
  }
  if (options.elastic_nodes) return launch_elastic(options);
  for (int restart = 0;; ++restart) {
    options.first_rank = options.node_rank * options.nproc_per_node;
    options.world_size = options.nnodes * options.nproc_per_node;
    const Attempt attempt = run_ranks(options, restart, StartHooks{});
    if (attempt.code == 0 || attempt.interrupted || restart >= options.max_restarts) return attempt.code;
    const int next = options.nproc_per_node - attempt.lost;
    if (next < options.nproc_min) {
      OutputMux().say("not restarting: " + count_ranks(next) + " left, fewer than the " +
                      std::to_string(options.nproc_min) + " --nproc-per-node allows");
      return attempt.code;
    }
    OutputMux().say("restarting with " + count_ranks(next) + " (restart " + std::to_string(restart + 1) + " of " +
                    std::to_string(options.max_restarts) + ")");
    options.nproc_per_node = next;
  }
}

}  // namespace fsdp_run
