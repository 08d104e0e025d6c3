#pragma once
// ProcessGroup: the job's ranks after the rendezvous (rank 0 hosts a c10d TCPStore), and the
// communicators for the world and sub-groups. See docs/launchers.md and docs/transports.md.
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/network_model.h"
#include "fsdp/rank_env.h"

namespace c10d {
class Store;
}

namespace fsdp {

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
  // How long a collective or rendezvous may wait for a peer. FSDP_TIMEOUT_S overrides it.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Local address Gloo binds to. Empty: the one that routes to master_addr. GLOO_SOCKET_IFNAME /
  // FSDP_BIND_ADDR override.
  std::string bind_addr;
  // A modeled network (network_model.h) wrapping every communicator this group creates. Unset:
  // FSDP_NETWORK_MODEL decides. options() shows the resolved model.
  std::optional<NetworkModel> network_model;
  // Gloo over TCP: compare every collective's fingerprint across members before its data moves
  // (one extra small message per pair per collective), so ranks out of step fail at once instead of
  // at the timeout or with wrong sums. Shared memory always checks (free); the end-of-job agreement
  // always runs. FSDP_CHECK_COLLECTIVES=0/1 overrides (Note [Collective fingerprints]).
  bool check_collectives = true;
  // Chosen per communicator, identically on every member. kAuto: FSDP_TRANSPORT if set, else
  // shared memory where every member can map a segment and Gloo otherwise. On a CUDA device kAuto
  // is NCCL; kSharedMemory / kTcp stage CUDA tensors through host memory over that transport
  // (ranks sharing one GPU; docs/transports.md).
  Transport transport = Transport::kAuto;
  // The device whose tensors the communicators move: CPU (shared memory or Gloo), or a CUDA
  // device per rank (NCCL; needs built_with_nccl()). Left at CPU: FSDP_DEVICE decides (docs/gpu.md).
  c10::Device device = c10::Device(c10::kCPU);
};

// Whether this build has the NCCL communicator (CUDA LibTorch), and Gloo.
bool built_with_nccl();
bool built_with_gloo();

class ProcessGroup {
 public:
  // Bootstraps from the environment (see RankEnv::from_env). Rank 0 hosts the TCPStore.
  static std::shared_ptr<ProcessGroup> from_env(const ProcessGroupOptions& options = {});
  static std::shared_ptr<ProcessGroup> create(const RankEnv& env, const ProcessGroupOptions& options = {});

  // Runs shutdown() if it was not run; if that fails, prints why and ends the process with status 1.
  ~ProcessGroup();
  // Ends every communicator this group created, collectively: throws if a peer is still issuing
  // collectives (ranks out of step), died or left (Note [End-of-job agreement]).
  void shutdown();
  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  const RankEnv& env() const { return env_; }
  const ProcessGroupOptions& options() const { return options_; }
  c10::intrusive_ptr<c10d::Store> store() const;
  // True when rank `r` is known to have exited: it ran on this host (same kernel boot and pid
  // namespace) and its process is gone. False when it lives or cannot be seen from here.
  bool rank_exited(int r) const;

  // The communicator over all ranks.
  CommunicatorPtr world() const { return world_; }
  // A communicator over `ranks` (sorted global ranks, must include this rank). Every member must
  // call it with the same list and key; a second call with the same ranks and key returns the
  // same communicator.
  CommunicatorPtr new_group(const std::vector<int>& ranks, const std::string& key);
  // Replaces the network model (nullopt: none) for communicators requested from now on, world()
  // included; those handed out keep theirs. Local: call it with the same model on every rank.
  void set_network_model(std::optional<NetworkModel> model);
  // A counter that advances identically on every rank; used to name per-call store keys.
  int64_t next_sequence() { return sequence_++; }

 private:
  ProcessGroup() = default;
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
