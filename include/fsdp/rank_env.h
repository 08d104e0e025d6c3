#pragma once
// RankEnv: where this process sits in the job, as its launcher (fsdp-run, torchrun, mpirun, srun)
// describes it in the environment. See docs/launchers.md.
#include <string>

namespace fsdp {

// Where this process sits in the job, read from the launcher's environment.
struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source;  // which convention supplied it: "torchrun", "mpirun", "srun"

  // Reads torchrun/fsdp-run's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, else mpirun's
  // OMPI_COMM_WORLD_*, else srun's SLURM_* (table in docs/launchers.md), and MASTER_ADDR (required
  // when the job spans hosts) / MASTER_PORT. Throws fsdp::Error naming the bad variable.
  static RankEnv from_env();
};

}  // namespace fsdp
