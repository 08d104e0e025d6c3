#pragma once
// Process-group bootstrap: rank environment (torchrun, mpirun, srun), a c10d TCPStore rendezvous,
// and communicators (shared memory within a host, Gloo over TCP across hosts) for the whole world
// and for sub-groups (hybrid sharding).
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/network_model.h"

namespace c10d {
class Store;
}

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

  // Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun,
  // fsdp-run), else OMPI_COMM_WORLD_* (mpirun), else SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun;
  // ranks on this node from SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE + SLURM_NODEID).
  // MASTER_ADDR (default 127.0.0.1, required when the job spans hosts) and MASTER_PORT (default
  // 29500) are read under every launcher.
  // Throws fsdp::Error naming the missing or inconsistent variable.
  static RankEnv from_env();
};

// How a communicator's collectives travel between its members.
enum class Transport {
  kAuto,          // shared memory when all members are on this host, Gloo over TCP otherwise
  kTcp,           // always Gloo over TCP
  kSharedMemory,  // always shared memory; an error when the members cannot share a segment
};
// "auto", "tcp", "shm"; throws fsdp::Error naming the accepted values.
Transport parse_transport(const std::string& name, const char* source);
const char* to_string(Transport transport);

struct ProcessGroupOptions {
  // How long a collective or rendezvous may wait for a peer before failing.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Local address the Gloo transport binds to. Empty: the address this host uses to reach
  // master_addr (loopback for a single host). GLOO_SOCKET_IFNAME / FSDP_BIND_ADDR override.
  std::string bind_addr;
  // A modeled network (see network_model.h): when set, every communicator this process group
  // creates (world() and new_group()) is wrapped in it, so collectives complete no earlier than
  // the model says. Unset: FSDP_NETWORK_MODEL is consulted (unset/"off": no model).
  // ranks_per_host = 0 resolves to LOCAL_WORLD_SIZE; options() shows the resolved model.
  std::optional<NetworkModel> network_model;
  // Decided per communicator (world() and each new_group()), identically on every member: kAuto
  // tries a shared-memory segment and falls back to Gloo when some member cannot map it. With
  // kAuto, FSDP_TRANSPORT=auto|tcp|shm in the environment decides. A group of one uses Gloo.
  Transport transport = Transport::kAuto;
  // The device whose tensors the communicators move. CPU (the default): shared memory or Gloo, as
  // `transport` says. A CUDA device (give each rank its own, e.g. cuda:LOCAL_RANK): NCCL, in builds
  // against a CUDA LibTorch (fsdp::built_with_nccl()); FSDP_DEVICE=cuda in the environment picks
  // cuda:LOCAL_RANK when this is left at CPU.
  c10::Device device = c10::Device(c10::kCPU);
};

// Whether this build of libfsdp has the NCCL communicator (built against a CUDA LibTorch), and Gloo.
bool built_with_nccl();
bool built_with_gloo();

class ProcessGroup {
 public:
  // Bootstraps from the environment (see RankEnv::from_env). Rank 0 hosts the TCPStore.
  static std::shared_ptr<ProcessGroup> from_env(const ProcessGroupOptions& options = {});
  static std::shared_ptr<ProcessGroup> create(const RankEnv& env, const ProcessGroupOptions& options = {});

  ~ProcessGroup();
  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  const RankEnv& env() const { return env_; }
  const ProcessGroupOptions& options() const { return options_; }
  c10::intrusive_ptr<c10d::Store> store() const;

  // The communicator over all ranks.
  CommunicatorPtr world() const { return world_; }
  // A communicator over `ranks` (sorted global ranks, must include this rank). Every member must
  // call it with the same list and key; a second call with the same ranks and key returns the
  // same communicator.
  CommunicatorPtr new_group(const std::vector<int>& ranks, const std::string& key);
  // Replaces the network model (nullopt: none) for communicators requested from now on, world()
  // included; those handed out before keep theirs. Local: call it with the same model on every
  // rank. Used by benchmarks that calibrate the model after start-up.
  void set_network_model(std::optional<NetworkModel> model);
  // A counter that advances identically on every rank; used to name per-call store keys.
  int64_t next_sequence() { return sequence_++; }

 private:
  ProcessGroup() = default;
  CommunicatorPtr connect_gloo(const c10::intrusive_ptr<c10d::Store>& prefixed, int my_index, int size,
                               const std::string& id);
  RankEnv env_;
  ProcessGroupOptions options_;
  struct Impl;
  std::shared_ptr<Impl> impl_;
  CommunicatorPtr world_;
  std::map<std::string, CommunicatorPtr> groups_;      // as handed out (with the current model)
  std::map<std::string, CommunicatorPtr> raw_groups_;  // the Gloo communicators themselves
  int64_t sequence_ = 0;
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

}  // namespace fsdp
