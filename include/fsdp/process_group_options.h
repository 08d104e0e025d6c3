#pragma once
// ProcessGroupOptions: how a process group's communicators are made (timeout, transport, device,
// interface, modeled network, collective fingerprints). See docs/transports.md.
#include <torch/torch.h>

#include <chrono>
#include <optional>
#include <string>

#include "fsdp/network_model.h"

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
  // Gloo over TCP: check that the members run the same collective (fingerprints carried in the
  // data's slots and compared through the store when a collective stalls, or exchanged before
  // all-reduces, broadcasts and barriers), so ranks out of step fail within seconds instead of at
  // the timeout or with wrong sums. Shared memory always checks (free); the end-of-job agreement
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

}  // namespace fsdp
