#pragma once
// Each rank's environment: the launcher's own, plus RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS and
// FSDP_RUN_STDOUT_IS_TTY, and the job token FSDP_JOB_TOKEN.
#include <optional>
#include <string>
#include <vector>

#include "options.h"

namespace fsdp_run {

// The environment shared by all ranks: ours, minus the variables each rank
// gets its own value for.
std::vector<std::string> base_environment(bool set_omp_threads);

// "FSDP_JOB_TOKEN=<random>" (256 bits from the kernel, in hexadecimal) for a single-node job
// whose environment sets none; nothing otherwise: the nodes of a multi-node job must share the
// token the user sets (docs/security.md). Exits with a message if no random bytes can be read.
std::optional<std::string> job_token_entry(const Options& o);

// OMP_NUM_THREADS for each rank, or nothing to leave the inherited value.
std::optional<int> omp_threads_per_rank(const Options& o);

// `base` plus the variables of local rank `local_rank` (OMP_NUM_THREADS only when `omp_threads`).
std::vector<std::string> rank_environment(const Options& o, int local_rank, const std::vector<std::string>& base,
                                          std::optional<int> omp_threads, bool stdout_is_tty);

}  // namespace fsdp_run
