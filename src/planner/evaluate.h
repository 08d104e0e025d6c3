#pragma once
// One candidate's prediction: the FlatParameters' byte layout on a rank (as flat_param.cpp lays
// them out), the simulated iteration over it, and the memory and time figures of a PlanEntry.
#include "fsdp/cluster.h"
#include "fsdp/plan_request.h"
#include "planner/model_costs.h"
#include "unit_plan.h"

namespace fsdp::planner {

struct ModelView {
  const UnitPlan* units = nullptr;
  const ModelCosts* costs = nullptr;
};

// What the runtime spends beyond the replay of a calibrated configuration (Note [Planner runtime
// calibration]): per pass, per unit in each pass, per collective, and waits on peers.
struct RuntimeCorrection {
  double forward_per_unit_s = 0;
  double backward_per_unit_s = 0;
  // Whatever the units, in each micro-batch's forward and backward, spread over the model's
  // stretches by their share of its forward FLOPs.
  double forward_per_pass_s = 0;
  double backward_per_pass_s = 0;
  double waits_per_compute_s = 0;  // waits on peers per second of computation, spread over the collectives
  // Waits on peers beside the modeled links' time (timed beneath the job's modeled network), per
  // second of computation, spread over the collectives (a CPU cluster's).
  double beside_waits_per_compute_s = 0;
  double per_collective_work_s = 0;  // FSDP's work on the compute thread for each collective it issues
  double per_step_s = 0;             // beyond the optimizer step's own prediction
  // The passes' computation against the replay's, where the runtime computed faster than the
  // replay of its configuration (FSDP's work per unit would come out negative): 1 otherwise.
  double compute_scale = 1;
  // What checkpointing changes in each pass per second of the checkpointed forward, measured
  // through the runtime; not measured: the copy's checkpointed timings, else one more forward.
  bool checkpointing_measured = false;
  double checkpointed_forward_change = 0;
  double checkpointed_backward_change = 0;
};

// The replay's figures for one micro-batch of a candidate, beside its PlanEntry.
struct Replayed {
  double forward_s = 0;  // the forward's end
  double passes_s = 0;   // forward and backward, the reductions waited for
  double exposed_s = 0;
  int collectives = 0;
  double wait_weight = 0;  // the collectives' waits on peers blocked, counted in world-wide collectives'
  int units = 0;
  double optimizer_s = 0;             // the predicted optimizer step
  double checkpointed_forward_s = 0;  // the calibrated forward computation of what checkpointing covers
};

// Whether candidate `c` at `world` ranks has micro-batches whose parameters no_sync may keep
// unsharded: several of them under no_sync, and units that gather.
inline bool can_keep_unsharded(const Candidate& c, int world) {
  return c.no_sync && c.accumulation > 1 && c.strategy != ShardingStrategy::kNoShard && world > 1;
}

// Whether candidate `c` at `world` ranks has a replica all-reduce to defer to its last micro-batch:
// HYBRID_SHARD with more than one replica group, several micro-batches, each reducing.
inline bool can_defer_replicas(const Candidate& c, int world) {
  return c.strategy == ShardingStrategy::kHybridShard && c.sharding_factor > 0 && world / c.sharding_factor > 1 &&
         c.accumulation > 1 && !c.no_sync;
}

// `world` ranks of `cluster`; every other input comes from `request`. `correction`: added to the
// replay (none: null); `replayed`: where to put the replay's own figures (null: nowhere).
PlanEntry evaluate(const ModelView& model, const Candidate& candidate, const Cluster& cluster, int world,
                   const PlanRequest& request, const RuntimeCorrection* correction = nullptr,
                   Replayed* replayed = nullptr);

// One runtime timing, with the units of the wrap policy it names.
struct TimedConfiguration {
  const RuntimeTiming* timing = nullptr;
  ModelView model;
  NamedWrapPolicy wrap;
};

// The correction a precision's runtime timings imply: their measured iterations against the
// replays of the configurations they timed (Note [Planner runtime calibration]).
RuntimeCorrection runtime_correction(const std::vector<TimedConfiguration>& timed, const Cluster& cluster, int world,
                                     const PlanRequest& request);

}  // namespace fsdp::planner
