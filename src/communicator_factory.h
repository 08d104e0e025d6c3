#pragma once
// CommunicatorFactory: connects the communicator of one group of ranks over the transport that
// the process group's options choose: shared memory among ranks of one host, Gloo over TCP, NCCL
// for CUDA tensors, or CUDA tensors staged through host memory (docs/transports.md).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/process_group_options.h"
#include "fsdp/rank_env.h"
#include "member_watch.h"

namespace fsdp {

class CommunicatorFactory {
 public:
  // Resolves where Gloo binds (ProcessGroupOptions::bind_addr, FSDP_BIND_ADDR, GLOO_SOCKET_IFNAME,
  // else the address that routes to MASTER_ADDR). `members` outlives the factory.
  CommunicatorFactory(const RankEnv& env, const ProcessGroupOptions& options, const MemberWatch* members);

  // Collective over `ranks` (sorted global ranks; this rank is the `my_index`-th): their
  // communicator, named `id`, meeting through `store` (prefixed for this group).
  CommunicatorPtr connect(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks, int my_index,
                          const std::string& id) const;

 private:
  CommunicatorPtr connect_gloo(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                               int my_index, const std::string& id) const;
  RankEnv env_;
  ProcessGroupOptions options_;
  const MemberWatch* members_;
  std::string gloo_iface_, gloo_hostname_;  // Gloo binds to the interface if set, else to the address
};

}  // namespace fsdp
