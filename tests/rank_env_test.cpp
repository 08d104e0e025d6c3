// Rank environment: RankEnv::from_env reads the launchers' variables, and its errors name the variable.
// fsdp-run/torchrun's RANK and WORLD_SIZE, mpirun's OMPI_COMM_WORLD_* and srun's SLURM_* variables, set
// by hand as those launchers set them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/check.h"
#include "fsdp/process_group.h"
#include "harness.h"

namespace fsdp_test {
namespace {

const char* const kLauncherVariables[] = {"RANK",
                                          "WORLD_SIZE",
                                          "LOCAL_RANK",
                                          "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR",
                                          "MASTER_PORT",
                                          "OMPI_COMM_WORLD_RANK",
                                          "OMPI_COMM_WORLD_SIZE",
                                          "OMPI_COMM_WORLD_LOCAL_RANK",
                                          "OMPI_COMM_WORLD_LOCAL_SIZE",
                                          "SLURM_PROCID",
                                          "SLURM_NTASKS",
                                          "SLURM_LOCALID",
                                          "SLURM_NTASKS_PER_NODE",
                                          "SLURM_STEP_TASKS_PER_NODE",
                                          "SLURM_NODEID"};

// Sets exactly `vars` among the launcher variables for its lifetime.
class LauncherEnvironment {
 public:
  explicit LauncherEnvironment(const std::vector<std::pair<const char*, const char*>>& vars) {
    for (const char* name : kLauncherVariables) unsetenv(name);
    for (const auto& [name, value] : vars) setenv(name, value, 1);
  }
  ~LauncherEnvironment() {
    for (const char* name : kLauncherVariables) unsetenv(name);
  }
};

std::string error_of(const std::vector<std::pair<const char*, const char*>>& vars) {
  LauncherEnvironment scope(vars);
  try {
    fsdp::RankEnv::from_env();
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "";
}

// fsdp-run's and torchrun's variables.
TEST(RankEnv, TorchrunErrorsNameTheVariable) {
  EXPECT_TRUE(contains(error_of({{"RANK", "0"}}), "WORLD_SIZE"));
  EXPECT_TRUE(contains(error_of({{"WORLD_SIZE", "2"}}), "RANK is not"));
  EXPECT_TRUE(contains(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK=2 is not below WORLD_SIZE=2"));
  EXPECT_TRUE(contains(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK='x' is not an integer"));
  EXPECT_TRUE(
      contains(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}), "MASTER_ADDR is not set"));
  EXPECT_TRUE(contains(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), "MASTER_PORT"));
  LauncherEnvironment none({});
  EXPECT_EQ(fsdp::RankEnv::from_env().world_size, 1);  // no launcher: a world of one
}

TEST(RankEnv, Mpirun) {
  LauncherEnvironment scope({{"OMPI_COMM_WORLD_RANK", "3"},
                             {"OMPI_COMM_WORLD_SIZE", "4"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                             {"MASTER_ADDR", "10.0.0.1"},
                             {"MASTER_PORT", "1234"}});
  const auto env = fsdp::RankEnv::from_env();
  EXPECT_EQ(env.source, "mpirun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 1234);
}

TEST(RankEnv, MpirunSingleHostNeedsNoMasterAddress) {
  LauncherEnvironment scope({{"OMPI_COMM_WORLD_RANK", "1"},
                             {"OMPI_COMM_WORLD_SIZE", "2"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  const auto env = fsdp::RankEnv::from_env();
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

// Plain 'srun -N2 -n4' sets no SLURM_NTASKS_PER_NODE; the node's count is in SLURM_STEP_TASKS_PER_NODE.
TEST(RankEnv, SrunReadsTheStepTaskCountOfThisNode) {
  LauncherEnvironment scope({{"SLURM_PROCID", "3"},
                             {"SLURM_NTASKS", "4"},
                             {"SLURM_LOCALID", "1"},
                             {"SLURM_NODEID", "1"},
                             {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                             {"MASTER_ADDR", "10.0.0.1"}});
  const auto env = fsdp::RankEnv::from_env();
  EXPECT_EQ(env.source, "srun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
}

TEST(RankEnv, SrunUnevenNodes) {
  {
    LauncherEnvironment scope({{"SLURM_PROCID", "3"},
                               {"SLURM_NTASKS", "4"},
                               {"SLURM_LOCALID", "0"},
                               {"SLURM_NODEID", "1"},
                               {"SLURM_STEP_TASKS_PER_NODE", "3,1"},
                               {"MASTER_ADDR", "10.0.0.1"}});
    EXPECT_EQ(fsdp::RankEnv::from_env().local_world_size, 1);
  }
  {
    LauncherEnvironment scope({{"SLURM_PROCID", "5"},
                               {"SLURM_NTASKS", "6"},
                               {"SLURM_LOCALID", "0"},
                               {"SLURM_NODEID", "3"},
                               {"SLURM_STEP_TASKS_PER_NODE", "2(x2),1(x2)"},
                               {"MASTER_ADDR", "10.0.0.1"}});
    EXPECT_EQ(fsdp::RankEnv::from_env().local_world_size, 1);
  }
}

TEST(RankEnv, SrunNtasksPerNodeWins) {
  LauncherEnvironment scope({{"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "2"},
                             {"SLURM_LOCALID", "0"},
                             {"SLURM_NODEID", "0"},
                             {"SLURM_NTASKS_PER_NODE", "2"},
                             {"SLURM_STEP_TASKS_PER_NODE", "garbage"}});
  EXPECT_EQ(fsdp::RankEnv::from_env().local_world_size, 2);
}

TEST(RankEnv, SrunErrorsNameTheVariable) {
  // Several nodes and no MASTER_ADDR: refused instead of every node rendezvousing with itself.
  EXPECT_TRUE(contains(error_of({{"SLURM_PROCID", "0"},
                                 {"SLURM_NTASKS", "4"},
                                 {"SLURM_LOCALID", "0"},
                                 {"SLURM_NODEID", "0"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}),
                       "MASTER_ADDR is not set"));
  EXPECT_TRUE(contains(error_of({{"SLURM_PROCID", "0"},
                                 {"SLURM_NTASKS", "4"},
                                 {"SLURM_LOCALID", "0"},
                                 {"SLURM_NODEID", "0"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "2(y2)"}}),
                       "SLURM_STEP_TASKS_PER_NODE='2(y2)'"));
  EXPECT_TRUE(contains(error_of({{"SLURM_PROCID", "0"},
                                 {"SLURM_NTASKS", "4"},
                                 {"SLURM_LOCALID", "0"},
                                 {"SLURM_NODEID", "2"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}),
                       "SLURM_NODEID=2"));
  EXPECT_TRUE(contains(error_of({{"SLURM_PROCID", "0"},
                                 {"SLURM_NTASKS", "2"},
                                 {"SLURM_LOCALID", "2"},
                                 {"SLURM_NODEID", "0"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "2"}}),
                       "SLURM_LOCALID=2 is not below SLURM_STEP_TASKS_PER_NODE=2"));
}

}  // namespace
}  // namespace fsdp_test
