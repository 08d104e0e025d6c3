#include "harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "models.h"

namespace fsdp_test {

std::map<std::string, WorkerFn>& worker_registry() {
  static std::map<std::string, WorkerFn> registry;
  return registry;
}

WorkerRegistrar::WorkerRegistrar(const std::string& name, WorkerFn fn) {
  if (!worker_registry().emplace(name, std::move(fn)).second) {
    std::fprintf(stderr, "fsdp_tests: two workers are named %s; rename one\n", name.c_str());
    std::abort();
  }
}

bool LaunchResult::all_ok() const {
  if (timed_out) return false;
  for (const auto& r : ranks)
    if (r.exit_code != 0) return false;
  return true;
}

std::string LaunchResult::report() const {
  std::ostringstream o;
  if (timed_out) o << "TIMED OUT\n";
  for (size_t i = 0; i < ranks.size(); ++i)
    o << "--- rank " << i << " exit " << ranks[i].exit_code << " ---\n" << ranks[i].output << "\n";
  return o.str();
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> unique;
  for (const auto& p : module.parameters())
    if (std::none_of(unique.begin(), unique.end(), [&](const at::Tensor& q) { return q.is_same(p); }))
      unique.push_back(p);
  return unique;
}

void expect_same_parameters(const torch::nn::Module& ref, fsdp::FullyShardedModule& sharded, double tol,
                            const std::string& what) {
  auto full = sharded.full_state_dict();
  for (const auto& kv : ref.named_parameters()) {
    const auto it = full.find(kv.key());
    WORKER_CHECK(it != full.end(), what, ": parameter ", kv.key(), " is missing from full_state_dict");
    WORKER_CHECK(it->second.scalar_type() == kv.value().scalar_type(), what, ": parameter ", kv.key(),
                 " comes back as ", it->second.scalar_type(), " from full_state_dict");
    const double d = rel_diff(it->second.detach().cpu(), kv.value().detach().cpu());
    WORKER_CHECK(d <= tol, what, ": parameter ", kv.key(), " differs by ", d);
  }
}

void expect_error(const std::function<void()>& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(std::string(e.what()).find(needle) != std::string::npos, what, ": error '", e.what(),
                 "' does not mention '", needle, "'");
    std::cout << what << ": " << e.what() << std::endl;
    return;
  }
  throw std::runtime_error(what + ": no error (expected one mentioning '" + needle + "')");
}

at::Tensor token_batch(int world, int step) {
  return at::randint(0, 32, {2 * world, 8}, at::detail::createCPUGenerator(40 + step));
}

void lm_step_side_by_side(TinyTransformer& ref, torch::optim::Optimizer& ref_opt, TinyTransformer& model,
                          torch::optim::Optimizer& opt, const WorkerContext& ctx, int step,
                          const std::function<void()>& after_forward, const std::function<void()>& after_backward) {
  const auto x = token_batch(ctx.world, step);
  ref_opt.zero_grad();
  loss_of(ref, x).backward();
  ref_opt.step();
  opt.zero_grad();
  auto loss = loss_of(model, x.narrow(0, ctx.rank * 2, 2));
  if (after_forward) after_forward();
  loss.backward();
  if (after_backward) after_backward();
  opt.step();
}

int64_t shard_bytes(fsdp::FullyShardedModule& sharded) {
  int64_t b = 0;
  for (const auto& u : sharded.units()) b += u.shard_bytes;
  return b;
}

fsdp::Options block_unit_options(const std::string& strategy) {
  auto o = fsdp::Options()
               .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
               .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>());
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  return o;
}

namespace {

std::string self_exe() { return read_link("/proc/self/exe"); }

std::string current_dir() {
  std::string buf(256, '\0');
  while (getcwd(buf.data(), buf.size()) == nullptr) {
    WORKER_CHECK(errno == ERANGE, "getcwd: ", std::strerror(errno));
    buf.resize(buf.size() * 2);
  }
  return buf.c_str();
}

// The first of $TMPDIR, $TMP, $TEMP, $TEMPDIR that is set and not empty, else "/tmp".
std::string temp_dir() {
  for (const char* name : {"TMPDIR", "TMP", "TEMP", "TEMPDIR"})
    if (const char* dir = std::getenv(name); dir != nullptr && *dir != '\0') return dir;
  return "/tmp";
}

int remove_entry(const char* path, const struct stat*, int, FTW*) {
  std::remove(path);  // unlink, or rmdir once its entries are gone (FTW_DEPTH)
  return 0;
}

// Removes `path` and everything under it, not following symlinks; failures are ignored.
void remove_tree(const std::string& path) { nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

}  // namespace

// docs/building.md, "Rank processes": a rank is forked from a zygote instead of exec'ing this
// binary, which would pay LibTorch's start-up once per rank.
namespace {

// Messages on the zygote's socket: a count, then that many length-prefixed strings.
bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = send(fd, c, n, MSG_NOSIGNAL);  // a gone peer is an error, not SIGPIPE
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool send_strings(int fd, const std::vector<std::string>& v) {
  const uint32_t count = static_cast<uint32_t>(v.size());
  if (!write_all(fd, &count, sizeof(count))) return false;
  for (const auto& s : v) {
    const uint32_t len = static_cast<uint32_t>(s.size());
    if (!write_all(fd, &len, sizeof(len)) || !write_all(fd, s.data(), len)) return false;
  }
  return true;
}

bool recv_strings(int fd, std::vector<std::string>& v) {
  uint32_t count = 0;
  if (!read_all(fd, &count, sizeof(count))) return false;
  v.assign(count, {});
  for (auto& s : v) {
    uint32_t len = 0;
    if (!read_all(fd, &len, sizeof(len))) return false;
    s.resize(len);
    if (len > 0 && !read_all(fd, s.data(), len)) return false;
  }
  return true;
}

int run_worker(const std::string& name, const std::vector<std::string>& args);

// In a fresh child: its standard output and error go to `log`.
void redirect_output(const std::string& log) {
  int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dup2(fd, 1);
  dup2(fd, 2);
  if (fd > 2) close(fd);
}

// In a fresh child: replaces it with argv[0] run with `argv` and exactly `env`.
[[noreturn]] void exec_with(std::vector<std::string> argv, std::vector<std::string> env) {
  std::vector<char*> a, e;
  for (auto& s : argv) a.push_back(s.data());
  a.push_back(nullptr);
  for (auto& s : env) e.push_back(s.data());
  e.push_back(nullptr);
  execve(a[0], a.data(), e.data());
  _exit(127);
}

// The zygote's loop: each request is {log, cwd, worker name, N, N args..., env...}; it answers with
// the rank's pid once that rank is a child of the test process (a subreaper: the zygote forks an
// intermediate that forks the rank and exits, so the rank is reparented to the test process).
[[noreturn]] void zygote_loop(int fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (;;) {
    std::vector<std::string> req;
    if (!recv_strings(fd, req)) _exit(0);  // the test process is gone
    int pid_channel[2];                    // the intermediate tells the zygote the rank's pid
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pid_channel) != 0) _exit(1);
    const pid_t mid = fork();
    if (mid == 0) {
      const pid_t rank = fork();
      if (rank == 0) {
        close(fd);
        close(pid_channel[0]);
        close(pid_channel[1]);
        prctl(PR_SET_PDEATHSIG, 0);
        const auto args = req.begin() + 4, env = args + std::stoll(req[3]);
        redirect_output(req[0]);
        clearenv();
        for (auto kv = env; kv != req.end(); ++kv) putenv(strdup(kv->c_str()));
        if (chdir(req[1].c_str()) != 0) _exit(126);
        _exit(run_worker(req[2], std::vector<std::string>(args, env)));
      }
      const int32_t pid = rank;
      write_all(pid_channel[1], &pid, sizeof(pid));
      _exit(0);
    }
    close(pid_channel[1]);
    int32_t pid = -1;
    if (mid < 0 || !read_all(pid_channel[0], &pid, sizeof(pid))) pid = -1;
    close(pid_channel[0]);
    if (mid > 0) waitpid(mid, nullptr, 0);  // the rank is reparented once its parent is reaped
    if (!write_all(fd, &pid, sizeof(pid))) _exit(0);
  }
}

std::vector<std::string> current_environment() {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  return env;
}

// Sets KEY=VALUE in env (replacing KEY), unless keep_existing and KEY is there.
void set_env(std::vector<std::string>& env, const std::string& kv, bool keep_existing = false) {
  const std::string key = kv.substr(0, kv.find('=') + 1);
  for (auto& e : env)
    if (e.compare(0, key.size(), key) == 0) {
      if (!keep_existing) e = kv;
      return;
    }
  env.push_back(kv);
}

// The number of threads of this process (/proc/self/task); 0 if it cannot be read.
int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Starts the zygote: with `fork_now`, a fork of this process as it is (the caller has checked that
// it is a rank's copy: one thread, OMP_NUM_THREADS=1 from its start); otherwise this binary exec'd
// as `--fsdp-zygote FD` with OMP_NUM_THREADS=1, so the libraries it loads (LibTorch's OpenMP,
// OpenBLAS) size their thread pools at load as an exec'd rank's do. Returns the test process's end
// of the zygote's socket, or -1 (ranks are then exec'd).
int start_zygote(bool fork_now) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return -1;
  fcntl(sv[0], F_SETFD, FD_CLOEXEC);
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    close(sv[0]);
    close(sv[1]);
    return -1;
  }
  std::vector<std::string> env, argv;  // made before fork(): the child of a threaded process must not allocate
  if (!fork_now) {
    env = current_environment();
    set_env(env, "OMP_NUM_THREADS=1");
    argv = {self_exe(), "--fsdp-zygote", std::to_string(sv[1])};
  }
  const pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    if (fork_now) zygote_loop(sv[1]);
    exec_with(argv, env);
  }
  close(sv[1]);
  if (pid < 0) {
    close(sv[0]);
    return -1;
  }
  return sv[0];
}

// The zygote main() forked (prefork_zygote), or -1.
int preforked_zygote = -1;

// FSDP_TEST_EXEC=1: every rank is exec'd, no zygote.
bool exec_ranks() {
  const char* exec = std::getenv("FSDP_TEST_EXEC");
  return exec && std::string(exec) == "1";
}

// The test process's end of the zygote's socket: the one main() forked, else one exec'd on first
// use. -1: exec ranks (FSDP_TEST_EXEC=1, or the zygote could not start).
int zygote() {
  static int fd = [] {
    if (preforked_zygote >= 0) return preforked_zygote;
    return exec_ranks() ? -1 : start_zygote(/*fork_now=*/false);
  }();
  return fd;
}

}  // namespace

std::vector<at::Tensor> full_tensors_by_name(fsdp::FullyShardedModule& sharded) {
  const auto full = sharded.full_state_dict();
  std::vector<std::string> names;
  for (const auto& kv : full) names.push_back(kv.first);
  std::sort(names.begin(), names.end());
  std::vector<at::Tensor> values;
  for (const auto& n : names) values.push_back(full.at(n).to(torch::kCPU).contiguous());
  return values;
}

LoopbackPort::LoopbackPort() {
  // Below the kernel's ephemeral range, which the connections of concurrent tests draw from.
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  if (low <= 27000) low = 32768;
  thread_local std::mt19937 pick(std::random_device{}());
  for (int attempt = 0; attempt < 1000 && fd_ < 0; ++attempt) {  // from 26000: the shell tests' free_port draws below
    const int port = 26000 + static_cast<int>(pick() % static_cast<unsigned>(low - 26000));
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    WORKER_CHECK(fd >= 0, "socket: ", std::strerror(errno));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    // Bound without SO_REUSEADDR, so no other holder shares it; marked reusable afterwards, so a
    // listener that sets SO_REUSEADDR can still take the port while this socket holds it.
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      const int on = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
      fd_ = fd;
      port_ = port;
    } else {
      close(fd);
    }
  }
  WORKER_CHECK(fd_ >= 0, "no free loopback port below ", low);
}

LoopbackPort::~LoopbackPort() { close(fd_); }

RunningRanks start(const std::string& name, int world, const std::vector<std::string>& args,
                   const std::vector<std::string>& extra_env) {
  RunningRanks running;
  running.master_port = std::make_shared<LoopbackPort>();
  const int port = running.master_port->port();
  const std::string exe = self_exe();
  const std::string cwd = current_dir();
  running.pids.resize(world);
  running.logs.resize(world);
  std::vector<std::string> base_env = current_environment();
  set_env(base_env, "WORLD_SIZE=" + std::to_string(world));
  set_env(base_env, "LOCAL_WORLD_SIZE=" + std::to_string(world));
  set_env(base_env, "MASTER_ADDR=127.0.0.1");
  set_env(base_env, "MASTER_PORT=" + std::to_string(port));
  set_env(base_env, "OMP_NUM_THREADS=1");
  set_env(base_env, "FSDP_TIMEOUT_S=60", /*keep_existing=*/true);
  for (int r = 0; r < world; ++r) {
    running.logs[r] =
        "/tmp/fsdp_test_" + std::to_string(getpid()) + "_" + std::to_string(port) + "_" + std::to_string(r) + ".log";
    std::vector<std::string> env = base_env;
    set_env(env, "RANK=" + std::to_string(r));
    set_env(env, "LOCAL_RANK=" + std::to_string(r));
    for (const auto& kv : extra_env) set_env(env, kv);  // the test's own variables win
    if (const int zygote_fd = zygote(); zygote_fd >= 0) {
      std::vector<std::string> req{running.logs[r], cwd, name, std::to_string(args.size())};
      req.insert(req.end(), args.begin(), args.end());
      req.insert(req.end(), env.begin(), env.end());
      int32_t pid = -1;
      static std::mutex zygote_mu;  // one request and its answer at a time
      std::lock_guard<std::mutex> one_at_a_time(zygote_mu);
      WORKER_CHECK(send_strings(zygote_fd, req) && read_all(zygote_fd, &pid, sizeof(pid)) && pid > 0,
                   "the test's zygote could not start rank ", r, " of ", name,
                   " (FSDP_TEST_EXEC=1 execs ranks instead)");
      running.pids[r] = pid;
      continue;
    }
    pid_t pid = fork();
    if (pid == 0) {
      redirect_output(running.logs[r]);
      std::vector<std::string> argv{exe, "--fsdp-worker", name};
      argv.insert(argv.end(), args.begin(), args.end());
      exec_with(argv, env);
    }
    running.pids[r] = pid;
  }
  return running;
}

LaunchResult wait_for(RunningRanks& running, int timeout_s) {
  const int world = static_cast<int>(running.pids.size());
  LaunchResult result;
  result.ranks.resize(world);
  auto& pids = running.pids;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int remaining = 0;
  for (int r = 0; r < world; ++r) remaining += pids[r] != 0;
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < world; ++r) {
      if (pids[r] == 0) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        result.ranks[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pids[r] = 0;
        --remaining;
        progressed = true;
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      for (int r = 0; r < world; ++r)
        if (pids[r]) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], nullptr, 0);
          pids[r] = 0;
        }
      break;
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(running.logs[r]);
    std::stringstream ss;
    ss << in.rdbuf();
    result.ranks[r].output = ss.str();
    unlink(running.logs[r].c_str());
  }
  running.master_port.reset();
  return result;
}

LaunchResult launch(const std::string& name, int world, const std::vector<std::string>& args, int timeout_s,
                    const std::vector<std::string>& extra_env) {
  RunningRanks running = start(name, world, args, extra_env);
  return wait_for(running, timeout_s);
}

TempDir::TempDir() {
  std::string tmpl = temp_dir();
  if (tmpl.back() != '/') tmpl += '/';
  tmpl += "fsdp_test.XXXXXX";
  WORKER_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp(", tmpl, "): ", std::strerror(errno));
  path = tmpl;
}

TempDir::~TempDir() { remove_tree(path); }

std::vector<std::string> list_dir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  WORKER_CHECK(d != nullptr, "opendir(", dir, "): ", std::strerror(errno));
  std::vector<std::string> names;
  while (const dirent* e = readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

std::string read_link(const std::string& path) {
  char buf[4096];
  const ssize_t n = readlink(path.c_str(), buf, sizeof(buf));
  return n > 0 && static_cast<size_t>(n) < sizeof(buf) ? std::string(buf, static_cast<size_t>(n)) : "";
}

std::string lines_starting_with(const std::string& prefix, const std::string& output) {
  std::istringstream in(output);
  std::string line, found;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) found += line + "\n";
  return found;
}

}  // namespace fsdp_test

namespace fsdp_test {
namespace {

// Leaves LibTorch's oneDNN kernels off for this process, and for the ranks it starts (through
// FSDP_TEST_NO_ONEDNN in their environment), when a convolution's gradients through them differ
// from LibTorch's own kernels' (Note [oneDNN convolutions in tests]).
void avoid_wrong_onednn_convolutions() {
  if (!at::globalContext().userEnabledMkldnn()) return;
  const auto gen = at::detail::createCPUGenerator(5);
  const at::Tensor x0 = at::randn({4, 6, 6}, gen), w0 = at::randn({5, 6, 3}, gen), g = at::randn({4, 5, 4}, gen);
  auto input_and_weight_grads = [&] {
    const at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    torch::conv1d(x, w).backward(g);
    return std::make_pair(x.grad(), w.grad());
  };
  const auto onednn = input_and_weight_grads();
  at::globalContext().setUserEnabledMkldnn(false);
  const auto native = input_and_weight_grads();
  if (at::allclose(onednn.first, native.first, 1e-4, 1e-5) && at::allclose(onednn.second, native.second, 1e-4, 1e-5)) {
    at::globalContext().setUserEnabledMkldnn(true);
    return;
  }
  setenv("FSDP_TEST_NO_ONEDNN", "1", 1);
  std::cerr << "fsdp_tests: this LibTorch's oneDNN convolution gradients differ from its own kernels' ("
            << at::isclose(onednn.first, native.first, 1e-4, 1e-5).logical_not().sum().item<int64_t>() << " of "
            << native.first.numel() << " input-gradient elements); the tests run with oneDNN disabled\n";
}

// Runs the registered worker `name` as this process's rank (RANK, WORLD_SIZE from the
// environment); returns the exit code. Output is flushed; destructors are skipped by the caller's
// _exit (peers may be gone and a clean shutdown could wait on them).
int run_worker(const std::string& name, const std::vector<std::string>& args) {
  auto& reg = worker_registry();
  auto it = reg.find(name);
  if (it == reg.end()) {
    std::cerr << "unknown worker " << name << "\n";
    return 2;
  }
  if (std::getenv("FSDP_TEST_NO_ONEDNN")) at::globalContext().setUserEnabledMkldnn(false);
  WorkerContext ctx;
  ctx.rank = std::atoi(std::getenv("RANK"));
  ctx.world = std::atoi(std::getenv("WORLD_SIZE"));
  ctx.args = args;
  torch::set_num_threads(1);
  int code = 0;
  try {
    it->second(ctx);
  } catch (const std::exception& e) {
    std::cerr << "rank " << ctx.rank << " failed: " << e.what() << "\n";
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  return code;
}

}  // namespace

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<std::string> leftover_segments(const std::vector<int>& pids) {
  std::vector<std::string> left;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      for (int pid : pids)
        if (name.rfind("fsdp-" + std::to_string(pid) + "-", 0) == 0) left.push_back(name);
    }
    closedir(d);
  }
  return left;
}

char process_state(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

bool names_dead_member(const std::string& out) {
  for (const char* part : {") died", "failed a collective", "Connection", "connection"})
    if (out.find(part) != std::string::npos) return true;
  return false;
}

namespace {

// docs/building.md, "Rank processes": when this process started as a rank does (OMP_NUM_THREADS=1)
// and is still single-threaded, the zygote is forked from it now, before any test runs, instead of
// exec'd later: one LibTorch start-up fewer per test process.
void prefork_zygote() {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (!omp || std::string(omp) != "1" || exec_ranks() || thread_count() != 1) return;
  preforked_zygote = start_zygote(/*fork_now=*/true);
}

}  // namespace

}  // namespace fsdp_test

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--fsdp-worker")
    _exit(fsdp_test::run_worker(argv[2], std::vector<std::string>(argv + 3, argv + argc)));
  if (argc == 3 && std::string(argv[1]) == "--fsdp-zygote") fsdp_test::zygote_loop(std::atoi(argv[2]));
  fsdp_test::prefork_zygote();  // before anything starts a thread
  fsdp_test::avoid_wrong_onednn_convolutions();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
