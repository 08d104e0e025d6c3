#include "harness.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace fsdp_test {

std::map<std::string, WorkerFn>& worker_registry() {
  static std::map<std::string, WorkerFn> registry;
  return registry;
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
    const double d = rel_diff(it->second, kv.value().detach());
    WORKER_CHECK(d <= tol, what, ": parameter ", kv.key(), " differs by ", d);
  }
}

namespace {

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = 0;
  return buf;
}

}  // namespace

RunningRanks start(const std::string& name, int world, const std::vector<std::string>& args,
                   const std::vector<std::string>& extra_env) {
  RunningRanks running;
  const int port = free_port();
  const std::string exe = self_exe();
  running.pids.resize(world);
  running.logs.resize(world);
  for (int r = 0; r < world; ++r) {
    running.logs[r] =
        "/tmp/fsdp_test_" + std::to_string(getpid()) + "_" + std::to_string(port) + "_" + std::to_string(r) + ".log";
    pid_t pid = fork();
    if (pid == 0) {
      int fd = open(running.logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("OMP_NUM_THREADS", "1", 1);
      setenv("FSDP_TIMEOUT_S", "60", 0);
      for (const auto& kv : extra_env) putenv(strdup(kv.c_str()));
      std::vector<std::string> argv_s{exe, "--fsdp-worker", name};
      argv_s.insert(argv_s.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& s : argv_s) argv.push_back(s.data());
      argv.push_back(nullptr);
      execv(exe.c_str(), argv.data());
      _exit(127);
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
  return result;
}

LaunchResult launch(const std::string& name, int world, const std::vector<std::string>& args, int timeout_s,
                    const std::vector<std::string>& extra_env) {
  RunningRanks running = start(name, world, args, extra_env);
  return wait_for(running, timeout_s);
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp_test.XXXXXX").string();
  WORKER_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp(", tmpl, "): ", std::strerror(errno));
  path = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

}  // namespace fsdp_test

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--fsdp-worker") {
    auto& reg = fsdp_test::worker_registry();
    auto it = reg.find(argv[2]);
    if (it == reg.end()) {
      std::cerr << "unknown worker " << argv[2] << "\n";
      return 2;
    }
    fsdp_test::WorkerContext ctx;
    ctx.rank = std::atoi(std::getenv("RANK"));
    ctx.world = std::atoi(std::getenv("WORLD_SIZE"));
    for (int i = 3; i < argc; ++i) ctx.args.push_back(argv[i]);
    torch::set_num_threads(1);
    try {
      it->second(ctx);
    } catch (const std::exception& e) {
      std::cerr << "rank " << ctx.rank << " failed: " << e.what() << "\n";
      std::cerr.flush();
      _exit(1);  // skip destructors: peers may be gone and a clean shutdown could wait on them
    }
    std::cout.flush();
    std::cerr.flush();
    _exit(0);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
