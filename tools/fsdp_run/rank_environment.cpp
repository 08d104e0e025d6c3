#include "rank_environment.h"

#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace fsdp_run {

namespace {

// CPUs this launcher may run on, at least 1.
int usable_cpu_count() {
#ifdef __linux__
  // Honour taskset / cpuset limits, not just the number of cores installed.
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

std::vector<std::string> base_environment(bool set_omp_threads) {
  static const char* const kOverridden[] = {"RANK",
                                            "WORLD_SIZE",
                                            "LOCAL_RANK",
                                            "LOCAL_WORLD_SIZE",
                                            "GROUP_RANK",
                                            "NODE_RANK",
                                            "MASTER_ADDR",
                                            "MASTER_PORT",
                                            "FSDP_RUN_STDOUT_IS_TTY",
                                            "OMP_NUM_THREADS",
                                            "FSDP_RESTART_COUNT"};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view entry(*e);
    std::string_view name = entry.substr(0, entry.find('='));
    bool overridden =
        std::any_of(std::begin(kOverridden), std::end(kOverridden), [&](const char* v) { return name == v; });
    // An inherited OMP_NUM_THREADS is kept unless we set our own.
    if (name == "OMP_NUM_THREADS" && !set_omp_threads) overridden = false;
    if (entry == "FSDP_JOB_TOKEN=") overridden = true;  // empty: job_token_entry() makes one
    if (!overridden) env.emplace_back(entry);
  }
  return env;
}

std::optional<std::string> job_token_entry(const Options& o) {
  const char* inherited = std::getenv("FSDP_JOB_TOKEN");
  if (o.nnodes > 1 || (inherited != nullptr && *inherited != '\0')) return std::nullopt;
  unsigned char bytes[32];
  size_t done = 0;
  while (done < sizeof(bytes)) {
    const ssize_t got = ::getrandom(bytes + done, sizeof(bytes) - done, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      std::perror("fsdp-run: cannot make a job token: getrandom");
      std::exit(1);
    }
    done += static_cast<size_t>(got);
  }
  std::string entry = "FSDP_JOB_TOKEN=";
  for (unsigned char b : bytes) {
    entry += "0123456789abcdef"[b >> 4];
    entry += "0123456789abcdef"[b & 15];
  }
  return entry;
}

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
  env.push_back("RANK=" + s(o.first_rank + local_rank));
  env.push_back("WORLD_SIZE=" + s(o.world_size));
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

}  // namespace fsdp_run
