#pragma once
// What the planner's replay (schedule_sim.h) takes: the units' FlatParameters as the runtime lays
// them out, the stretches of forward in order, and the options and waits that shape the schedule.
#include <cstdint>
#include <vector>

#include "fsdp/options.h"

namespace fsdp::planner {

// One FlatParameter as the runtime lays it out on a rank.
struct SimFlat {
  bool separate_shard = true;       // false: the flat storage is the shard (no gathers, no transient)
  bool requires_grad = true;        // frozen: no gradient buffer, no reduction
  int64_t unsharded_bytes = 0;      // padded, in the compute dtype
  int64_t gather_input_bytes = 0;   // the shard cast to the compute dtype before its gather (0: none)
  int64_t grad_buffer_bytes = 0;    // the unsharded gradient, in the reduce dtype (separate shard)
  int64_t reduce_output_bytes = 0;  // the reduction's output (0: reduced in place)
  int64_t post_forward_bytes = 0;   // hpZ: the part kept from a reshard before backward (0: none)
  double gather_s = 0;
  double post_forward_gather_s = 0;  // hpZ: the gather from those parts, within their group
  double reduce_s = 0;
  double replica_reduce_s = 0;  // HYBRID_SHARD: the replica all-reduce's part of reduce_s
  double issue_work_s = 0;      // the compute thread's own work for each of its collectives (runtime calibration)
  int64_t step_elements = 0;    // its pieces' elements the optimizer steps
  // Quantized all-gather: the packed shard and the gathered packed shards, from issue to wait (0: none).
  int64_t packed_shard_bytes = 0;
  int64_t packed_gathered_bytes = 0;
  // Quantized reductions' packed buffers, from issue until the reduction lands: the shard group's
  // (NO_SHARD: the all-reduce's), and HYBRID_SHARD's replica all-reduce's.
  std::vector<int64_t> reduce_packed;
  std::vector<int64_t> replica_packed;
  // Quantized communication's own work (0: none; deterministic training's, below), on the compute thread: packing the shard as its
  // gather is issued, unpacking the gathered parts when it is waited for; packing the gradient as
  // its reduction is issued, and the work once it lands (summing the received parts, or unpacking an
  // all-reduce's sums). HYBRID_SHARD's replica all-reduce packs its values and unpacks its sums;
  // chained to the reduce-scatter, the packing and that reduce-scatter's landing run on the
  // replica communicator's thread. An all-reduce's owner sums and packs on its worker (in reduce_s).
  double gather_pack_s = 0;
  double gather_unpack_s = 0;
  double reduce_pack_s = 0;
  double reduce_land_s = 0;
  double replica_pack_s = 0;
  double replica_land_s = 0;
  // Deterministic training: the exact sums, from the first fold of a step's gradients (at its
  // reduction, or at the end of a backward that does not reduce) until the reduction lands; each
  // fold is reduce_pack_s of work, the conversion of the reduced sums reduce_land_s.
  int64_t exact_bytes = 0;
};

struct SimUnit {
  std::vector<SimFlat> flats;
  std::vector<int> ancestors;  // nearest first
  bool reshard_after_forward = true;
  bool checkpointed = false;
  int64_t kept_activation_bytes = 0;  // kept for backward (a checkpointed unit: its input)
  int64_t full_activation_bytes = 0;  // what its forward keeps without checkpointing
};

// One stretch of computation in one unit, in forward order; backward runs them reversed.
struct SimSegment {
  int unit = 0;
  double forward_s = 0;
  double backward_s = 0;        // recomputation included
  double activation_share = 0;  // of the unit's activation bytes, kept by this stretch
  bool reads_params = true;     // reads a parameter of its unit: the runtime enters the unit (Scheduler::use)
  bool grads_arrive =
      false;  // its backward brings a first gradient: it reads a parameter requiring grad for the first time
  bool backward_reads = true;       // its backward reads a parameter of its unit: backward enters the unit here
  std::vector<int> arriving_flats;  // its unit's flats (by position) whose first gradient its backward brings
};

// What one micro-batch of several begins with and does at its end.
struct SimMicroBatch {
  // Accumulation without communication: whether this micro-batch reduces its gradients, and whether
  // it begins with every unit's unsharded gradient held from the micro-batches before it.
  bool reduce = true;
  bool grads_held = false;
  // Replica-deferred accumulation: whether this micro-batch's sums stop at the shard group (kept as
  // partial sums), and whether it begins with the earlier micro-batches' partial sums held.
  bool defer_replicas = false;
  bool partials_held = false;
  // Accumulation with the parameters kept unsharded (set_reshard_after_backward(false)): whether
  // this micro-batch's backward frees them, and whether it begins with every unit left unsharded.
  bool reshard_after_backward = true;
  bool params_held = false;
};

struct SimInput {
  std::vector<SimUnit> units;  // unit 0: the root
  std::vector<SimSegment> segments;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = true;
  // Forward keeps the unit backward needs first (no ReshardPolicy: Note [Kept for backward]).
  bool keep_first_in_backward = true;
  bool limit_all_gathers = true;
  int all_gather_limit = 2;
  int reductions_in_flight = 2;
  bool no_shard = false;
  bool separate_lanes = false;  // gathers and reductions on separate lanes (else one FIFO)
  // The share of each collective's time the transports spend copying on the cores the ranks compute
  // on (a CPU machine): the compute thread's, the rest on the links (1: all of it, no overlap).
  double comm_cpu_share = 0;
  // The same for the collectives within the shard group (NO_SHARD: the world) and within hpZ's
  // groups, whose link may be a host's own.
  double shard_cpu_share = 0;
  double hpz_cpu_share = 0;
  // Waits on peers beyond the modeled collectives, on the compute thread at each collective issued
  // (a CPU cluster's; elsewhere the waits lengthen the collectives instead).
  double wait_per_collective_s = 0;
  // Waits on peers beside the links' time (a CPU cluster's, beneath a modeled link): a collective
  // lands no earlier than this long after its issue, however fast its link.
  double beside_wait_per_collective_s = 0;
  // Each group's share of a world-wide collective's waits on peers (Note [Planner waits by group]);
  // with waits_preempt (ranks sharing cores), the share blocked, the rest parked on the compute thread.
  double shard_wait_weight = 1, hpz_wait_weight = 1, replica_wait_weight = 1;
  bool waits_preempt = false;
  double step_s = 0;  // the optimizer step after backward
  // The step in backward: each FlatParameter's pieces stepped as its reduction lands (0: off).
  double step_s_per_element = 0;
  SimMicroBatch micro;  // the defaults: a step of one micro-batch
};

}  // namespace fsdp::planner
