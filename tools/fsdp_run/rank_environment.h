#pragma once
// Each rank's environment: the launcher's own, plus RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS and
// FSDP_RUN_STDOUT_IS_TTY.
#include <optional>
#include <string>
#include <vector>

#include "options.h"

namespace fsdp_run {

// The environment shared by all ranks: ours, minus the variables each rank
// gets its own value for.
std::vector<std::string> base_environment(bool set_omp_threads);

// OMP_NUM_THREADS for each rank, or nothing to leave the inherited value.
std::optional<int> omp_threads_per_rank(const Options& o);

// `base` plus the variables of local rank `local_rank` (OMP_NUM_THREADS only when `omp_threads`).
std::vector<std::string> rank_environment(const Options& o, int local_rank, const std::vector<std::string>& base,
                                          std::optional<int> omp_threads, bool stdout_is_tty);

}  // namespace fsdp_run
