#include "rank_setup.h"

#include <dlfcn.h>
#include <fsdp/fsdp.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sched.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace fsdp_gpt {

std::string g_rank_label;

namespace {

// CPUs this process may run on (respects taskset / cgroup cpusets, unlike the core count).
int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}

// OpenBLAS (Debian's LibTorch calls it for matmuls) keeps its own thread pool, sized from
// OMP_NUM_THREADS when it loads and left alone by torch::set_num_threads; without this, every
// rank started without OMP_NUM_THREADS (mpirun, srun) would run one BLAS thread per core.
void set_openblas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(threads);
}

}  // namespace

fsdp::RankEnv read_rank_env() {
  fsdp::RankEnv env;
  try {
    env = fsdp::RankEnv::from_env();
    if (env.world_size > 1) g_rank_label = " [rank " + std::to_string(env.rank) + "]";
  } catch (const fsdp::Error&) {
    // A broken launcher environment: parse flags as a single process; ProcessGroup::from_env
    // reports the problem once the flags are parsed.
  }
  return env;
}

// Sets this rank's compute threads (unless OMP_NUM_THREADS did) and returns how many it uses.
int set_threads_per_rank(const fsdp::RankEnv& env, bool deterministic) {
  if (deterministic) {  // the same at every world size (Note [Deterministic training])
    torch::set_num_threads(1);
    set_openblas_threads(1);
    return 1;
  }
  // Ranks on one host share its cores. OMP_NUM_THREADS, if set, is the user's choice (LibTorch
  // already applied it); otherwise split the usable cores between the local ranks, since more
  // threads than cores makes every rank slower.
  if (!std::getenv("OMP_NUM_THREADS")) {
    const int threads = std::max(1, usable_cpus() / env.local_world_size);
    torch::set_num_threads(threads);
    set_openblas_threads(threads);
  }
  return torch::get_num_threads();
}

std::string set_malloc(const std::string& mode) {
#if defined(__GLIBC__)
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES"})
    if (std::getenv(name)) return std::string("glibc's, as the environment sets them (") + name + ")";
  if (mode != "keep") return "glibc's defaults (--malloc default)";
  // The largest mmap threshold glibc accepts; -1 turns trimming off (mallopt(3)).
  constexpr int kMmapThreshold = 32 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 || mallopt(M_TRIM_THRESHOLD, -1) != 1)
    return "glibc's defaults (it refused --malloc keep)";
  return "heap kept between steps (--malloc keep: blocks under 32 MiB from the heap, never trimmed)";
#else
  return mode == "keep" ? "the C library's (--malloc keep applies to glibc only)" : "the C library's";
#endif
}

}  // namespace fsdp_gpt
