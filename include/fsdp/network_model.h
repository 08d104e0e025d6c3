#pragma once
// Modeled network: a Communicator decorator that runs the real collective (results stay exact)
// but completes it no earlier than a modeled ring time. Everything it reports is modeled, not
// measured. Formulas and link choice: Note [Modeled network] in docs/design.md; usage
// (FSDP_NETWORK_MODEL): docs/transports.md.
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/comm.h"

namespace fsdp {

struct Link {
  // Bandwidth per rank in GB/s = 1e9 bytes per second (the unit nccl-tests reports; not Gbit/s).
  TORCH_ARG(double, bandwidth_gbps) = 25.0;
  // Per ring step, in microseconds.
  TORCH_ARG(double, latency_us) = 0.0;
};

struct NetworkModel {
  TORCH_ARG(Link, intra) = Link().bandwidth_gbps(25.0);  // between ranks on one modeled host
  TORCH_ARG(Link, inter) = Link().bandwidth_gbps(12.5);  // any group that spans modeled hosts
  // Ranks per modeled host (consecutive global ranks). 0: the job's LOCAL_WORLD_SIZE, i.e. the
  // real hosts; set it smaller to model several hosts on one machine.
  TORCH_ARG(int, ranks_per_host) = 0;

 public:  // TORCH_ARG leaves the access at private
  // Parses "key=value,...": intra_gbps, inter_gbps, gbps (both), latency_us (both),
  // intra_latency_us, inter_latency_us, ranks_per_host (keys in docs/transports.md). Both
  // bandwidths are required. `source` names the text's origin in errors; throws fsdp::Error.
  static NetworkModel parse(const std::string& spec, const std::string& source = "network model");
  // FSDP_NETWORK_MODEL (e.g. "intra_gbps=25,inter_gbps=12.5"); unset, empty or "off": no model.
  static std::optional<NetworkModel> from_env();
  // Throws fsdp::Error naming the bad field.
  void validate(const std::string& source = "network model") const;
  // e.g. "modeled: intra 25 GB/s 10 us, inter 12.5 GB/s 10 us, 8 ranks/host"
  std::string describe() const;
};

// What a modeled communicator models, and what it has modeled so far.
struct ModeledLinkStats {
  std::string link;                // "intra" or "inter"
  Link params;                     // the link's parameters
  int64_t collectives = 0;         // issued (barriers included)
  int64_t wire_bytes = 0;          // modeled bytes this rank sent
  int64_t gather_wire_bytes = 0;   // of which in all-gathers
  int64_t scatter_wire_bytes = 0;  // of which in reduce-scatters and all-to-alls
  double modeled_busy_s = 0;       // sum of modeled durations (the link is busy that long)
  // Collectives seen still running after their modeled completion (the real transport set the
  // time there). A lower bound.
  int64_t real_exceeded_model = 0;
};

// Wraps `inner` (a communicator over the sorted global ranks `global_ranks`) in the model; the
// link follows from `global_ranks`. `ranks_per_host` must be resolved (>= 1).
CommunicatorPtr with_network_model(CommunicatorPtr inner, const std::vector<int>& global_ranks,
                                   const NetworkModel& model);

// The modeled link and statistics of a communicator made by with_network_model; nullopt for an
// unmodeled communicator.
std::optional<ModeledLinkStats> modeled_link_stats(const Communicator& comm);
// The real communicator beneath a communicator made by with_network_model; null for an unmodeled one.
CommunicatorPtr modeled_inner(const Communicator& comm);

enum class Collective { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier, kAllToAll };
// Bytes each rank sends in one collective of `bytes` total bytes over `n` ranks.
double modeled_wire_bytes(Collective c, int64_t bytes, int n);
// The modeled duration in seconds of that collective on `link`.
double modeled_seconds(Collective c, int64_t bytes, int n, const Link& link);

// The fewest of `ranks` (global ranks) on any host they occupy, hosts being `ranks_per_host`
// consecutive global ranks each.
int fewest_per_host(const std::vector<int>& ranks, int ranks_per_host);
// The link of a group that spans hosts with `per_host` of its ranks on each (fewest_per_host): one
// ring per rank of a host, each crossing to the next host on its own rank's `inter` link and
// moving 1/per_host of the bytes, so the group runs at min(per_host x inter, per_host/(per_host-1)
// x intra) per rank, at the inter link's latency (Note [Modeled network]).
Link spanning_link(const Link& intra, const Link& inter, int per_host);

}  // namespace fsdp
