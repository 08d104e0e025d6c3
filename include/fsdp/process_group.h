#pragma once
// ProcessGroup: the job's ranks after the rendezvous (rank 0 hosts the rendezvous store), and the
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
#include "fsdp/process_group_options.h"
#include "fsdp/rank_env.h"

namespace c10d {
class Store;
}

namespace fsdp {

// Whether this build has the NCCL communicator (CUDA LibTorch), and Gloo.
bool built_with_nccl();
bool built_with_gloo();

class ProcessGroup {
 public:
  // Bootstraps from the environment (see RankEnv::from_env). Rank 0 hosts the rendezvous store.
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
  // What the modeled network has modeled so far on each communicator handed out with a model
  // (world() included), by name; empty without a model.
  std::vector<std::pair<std::string, ModeledLinkStats>> modeled_links() const;
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

// Collective over the world: every rank must call it, in the same order as its other collectives on
// pg.world(). The mean of `value` over the ranks (their sum divided by the world size), the same on
// every rank: e.g. the loss to log.
double mean_across_ranks(const ProcessGroup& pg, double value);
// The same, element by element, for a tensor of the same shape and dtype on every rank; returns a
// new tensor on `value`'s device (an integer tensor's mean is floating point, as Tensor::div gives).
at::Tensor mean_across_ranks(const ProcessGroup& pg, const at::Tensor& value);

}  // namespace fsdp
