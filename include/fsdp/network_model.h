#pragma once
// A network model: a Communicator decorator that runs the real collective (results stay exact)
// but completes it no earlier than a modeled duration, so that training and benchmarks on one
// machine (loopback Gloo) can see what communication would cost on a given interconnect.
// Everything it reports is *modeled*, not measured.
//
// Modeled duration of one collective over a group of n ranks, B = the collective's total bytes
// (all-gather: the output; reduce-scatter: the input; all-reduce, broadcast: the tensor),
// `latency` per ring step and `bandwidth` per rank's link (bytes each rank sends per second):
//   all-gather, reduce-scatter: (n-1) * latency + (n-1)/n * B / bandwidth     (ring)
//   all-reduce:               2(n-1) * latency + 2(n-1)/n * B / bandwidth    (ring)
//   broadcast:                 (n-1) * latency +          B / bandwidth      (pipelined chain;
//                             nccl-tests' busbw convention for broadcast, factor 1)
//   barrier:                  2(n-1) * latency                               (a 0-byte all-reduce)
//   n == 1: 0 (nothing goes on the wire).
// Collectives on one communicator share its link serially: modeled start = max(issue time,
// previous modeled completion on that communicator); modeled completion = start + duration.
// Work::wait() waits for the real collective, then sleeps (no busy wait) until the modeled
// completion; Work::completed() is true only when both have happened. The model is a floor: a
// real collective slower than its modeled time is not stretched further (the statistics count
// those as `real_exceeded_model`), so pick bandwidths below what loopback Gloo reaches (see
// bench/results/collectives.md) for the model to be in control. Each rank models from its own
// issue times: skew between ranks is coupled only through the real collective.
//
// Which link a group uses: every member's modeled host is global_rank / ranks_per_host. A group
// whose members all lie on one modeled host uses `intra`; any other group uses `inter` (a ring
// that crosses hosts runs at the speed of its slowest hop).
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
  TORCH_ARG(Link, intra) = Link().bandwidth_gbps(25.0);    // between ranks on one modeled host
  TORCH_ARG(Link, inter) = Link().bandwidth_gbps(12.5);    // any group that spans modeled hosts
  // Ranks per modeled host (consecutive global ranks). 0: the job's LOCAL_WORLD_SIZE, i.e. the
  // real hosts; set it smaller to model several hosts on one machine.
  TORCH_ARG(int, ranks_per_host) = 0;

 public:  // TORCH_ARG leaves the access at private
  // Parses "key=value,key=value,...". Keys (case-insensitive):
  //   intra_gbps, inter_gbps   bandwidth in GB/s (1e9 bytes/s) of the intra-/inter-host link
  //   gbps                     both bandwidths
  //   latency_us               both latencies, microseconds per ring step (default 0)
  //   intra_latency_us, inter_latency_us
  //   ranks_per_host           integer >= 1 (default: LOCAL_WORLD_SIZE)
  // Both bandwidths must be given (directly or through gbps). `source` names where the text came
  // from in error messages (e.g. the environment variable). Throws fsdp::Error on bad input.
  static NetworkModel parse(const std::string& spec, const std::string& source = "network model");
  // FSDP_NETWORK_MODEL, e.g. "intra_gbps=25,inter_gbps=12.5,ranks_per_host=8,latency_us=10".
  // Unset, empty or "off": no model.
  static std::optional<NetworkModel> from_env();
  // Throws fsdp::Error naming the bad field.
  void validate(const std::string& source = "network model") const;
  // e.g. "modeled: intra 25 GB/s 10 us, inter 12.5 GB/s 10 us, 8 ranks/host"
  std::string describe() const;
};

// What a modeled communicator models, and what it has modeled so far.
struct ModeledLinkStats {
  std::string link;              // "intra" or "inter"
  Link params;                   // the link's parameters
  int64_t collectives = 0;       // issued (barriers included)
  int64_t wire_bytes = 0;        // modeled bytes this rank sent
  double modeled_busy_s = 0;     // sum of modeled durations (the link is busy that long)
  // Collectives whose real work was seen (by wait() or completed()) still running after their
  // modeled completion: there the real transport, not the model, set the time. A lower bound.
  int64_t real_exceeded_model = 0;
};

// Wraps `inner` (a communicator over the sorted global ranks `global_ranks`) in the model. The
// link is chosen from `global_ranks` as described above; `ranks_per_host` must be resolved (>= 1).
// ProcessGroup does this for every communicator it creates when a model is configured.
CommunicatorPtr with_network_model(CommunicatorPtr inner, const std::vector<int>& global_ranks,
                                   const NetworkModel& model);

// The modeled link and statistics of a communicator made by with_network_model; nullopt for an
// unmodeled communicator.
std::optional<ModeledLinkStats> modeled_link_stats(const Communicator& comm);

enum class Collective { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
// Bytes each rank sends in one collective of `bytes` total bytes over `n` ranks (formulas above).
double modeled_wire_bytes(Collective c, int64_t bytes, int n);
// The modeled duration in seconds of that collective on `link`.
double modeled_seconds(Collective c, int64_t bytes, int n, const Link& link);

}  // namespace fsdp
