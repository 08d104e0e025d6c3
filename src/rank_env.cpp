#include "fsdp/rank_env.h"

#include <cstdio>
#include <sstream>
#include <string>

#include "env_var.h"
#include "fsdp/check.h"

namespace fsdp {

namespace {

// Slurm's per-node task counts, compressed as in "2(x3),1" (three nodes with 2 tasks, then one
// with 1): the count on node `node`, or -1 if `spec` does not have that form or is too short.
int slurm_tasks_on_node(const std::string& spec, int node) {
  std::istringstream entries(spec);
  std::string entry;
  int first_node = 0;
  while (std::getline(entries, entry, ',')) {
    int tasks = 0, repeat = 1;
    char tail = 0;
    const bool repeated = std::sscanf(entry.c_str(), "%d(x%d%c", &tasks, &repeat, &tail) == 3 && tail == ')';
    if (!repeated) {
      repeat = 1;
      if (std::sscanf(entry.c_str(), "%d%c", &tasks, &tail) != 1) return -1;  // one number, nothing after
    }
    if (tasks < 1 || repeat < 1) return -1;
    if (node < first_node + repeat) return tasks;
    first_node += repeat;
  }
  return -1;
}

}  // namespace

RankEnv RankEnv::from_env() {
  RankEnv e;
  const char *rank = nullptr, *world = nullptr, *local_rank = nullptr, *local_world = nullptr;
  const char *rank_name = "RANK", *world_name = "WORLD_SIZE", *lr_name = "LOCAL_RANK", *lw_name = "LOCAL_WORLD_SIZE";
  if (env_or_null("RANK") || env_or_null("WORLD_SIZE")) {
    e.source = "torchrun";
  } else if (env_or_null("OMPI_COMM_WORLD_RANK")) {
    e.source = "mpirun";
    rank_name = "OMPI_COMM_WORLD_RANK", world_name = "OMPI_COMM_WORLD_SIZE";
    lr_name = "OMPI_COMM_WORLD_LOCAL_RANK", lw_name = "OMPI_COMM_WORLD_LOCAL_SIZE";
  } else if (env_or_null("SLURM_PROCID")) {
    e.source = "srun";
    rank_name = "SLURM_PROCID", world_name = "SLURM_NTASKS";
    lr_name = "SLURM_LOCALID", lw_name = "SLURM_NTASKS_PER_NODE";
  } else {
    e.source = "single process";  // no launcher: a world of one
    return e;
  }
  rank = env_or_null(rank_name);
  world = env_or_null(world_name);
  FSDP_CHECK(rank, world_name, " is set but ", rank_name,
             " is not; launch every rank with fsdp-run (or torchrun/"
             "mpirun/srun), which sets both");
  FSDP_CHECK(world, rank_name, " is set but ", world_name,
             " is not; launch every rank with fsdp-run (or torchrun/"
             "mpirun/srun), which sets both");
  e.world_size = parse_env_int(world_name, world, 1, 1 << 20);
  e.rank = parse_env_int(rank_name, rank, 0, 1 << 20);
  FSDP_CHECK(e.rank < e.world_size, rank_name, "=", e.rank, " is not below ", world_name, "=", e.world_size,
             "; ranks are numbered 0..", world_name, "-1");
  local_rank = env_or_null(lr_name);
  local_world = env_or_null(lw_name);
  // srun sets SLURM_NTASKS_PER_NODE only when --ntasks-per-node was given; the step's task count
  // on each node is always in SLURM_STEP_TASKS_PER_NODE, indexed by SLURM_NODEID.
  std::string slurm_local_world;
  if (e.source == "srun" && !local_world) {
    const char* spec = env_or_null("SLURM_STEP_TASKS_PER_NODE");
    const char* node = env_or_null("SLURM_NODEID");
    if (spec && node) {
      const int tasks = slurm_tasks_on_node(spec, parse_env_int("SLURM_NODEID", node, 0, 1 << 20));
      FSDP_CHECK(tasks > 0, "cannot read this node's task count from SLURM_STEP_TASKS_PER_NODE='", spec,
                 "' (SLURM_NODEID=", node, "); export SLURM_NTASKS_PER_NODE to give it");
      slurm_local_world = std::to_string(tasks);
      local_world = slurm_local_world.c_str();
      lw_name = "SLURM_STEP_TASKS_PER_NODE";
    }
  }
  e.local_world_size = local_world ? parse_env_int(lw_name, local_world, 1, e.world_size) : e.world_size;
  e.local_rank = local_rank ? parse_env_int(lr_name, local_rank, 0, 1 << 20) : e.rank % e.local_world_size;
  FSDP_CHECK(e.local_rank < e.local_world_size, lr_name, "=", e.local_rank, " is not below ", lw_name, "=",
             e.local_world_size);
  if (const char* addr = env_or_null("MASTER_ADDR")) {
    e.master_addr = addr;
  } else {
    FSDP_CHECK(e.local_world_size == e.world_size, "MASTER_ADDR is not set and the job spans several hosts (",
               world_name, "=", e.world_size, ", ", lw_name, "=", e.local_world_size,
               "); export MASTER_ADDR=<address of rank 0's host>");
  }
  if (const char* port = env_or_null("MASTER_PORT")) e.master_port = parse_env_int("MASTER_PORT", port, 1, 65535);
  return e;
}

}  // namespace fsdp
