// One candidate's prediction (evaluate.h). See Note [Planner memory model] in docs/design.md.
#include "planner/evaluate.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "planner/exact_reduction.h"
#include "planner/optimizer_state.h"
#include "planner/quantized_sizes.h"
#include "planner/quantized_work.h"
#include "planner/schedule_sim.h"

namespace fsdp::planner {
namespace {

struct CalibratedPasses {
  double forward_s = 0, backward_s = 0;
};

// The calibrated passes' seconds at `tokens`: on the line through the two timed batch sizes (a
// fixed cost and a cost per token; Note [Planner calibration]) where a smaller batch was timed and
// gives a positive cost per token and fixed cost, else in proportion to the tokens.
CalibratedPasses calibrated_passes(const Calibration& calibration, const PrecisionTiming& t, double tokens) {
  const double big = static_cast<double>(calibration.tokens), small = static_cast<double>(calibration.small_tokens);
  auto at = [&](double big_s, double small_s) {
    const double per_token = small > 0 && small_s > 0 ? (big_s - small_s) / (big - small) : 0;
    const double fixed = big_s - per_token * big;
    if (per_token <= 0 || fixed < 0) return big_s * tokens / big;
    return fixed + per_token * tokens;
  };
  return {at(t.forward_s, t.small_forward_s), at(t.backward_s, t.small_backward_s)};
}

// AdamW reads parameter, gradient and two moments and writes three of them: 7 values per element.
constexpr double kOptimizerValuesPerElement = 7.0;

int64_t element_size(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// Ranks each FlatParameter is split over.
int shard_factor(const Candidate& c, int world) {
  switch (c.strategy) {
    case ShardingStrategy::kNoShard: return 1;
    case ShardingStrategy::kHybridShard: return c.sharding_factor > 0 ? c.sharding_factor : world;
    default: return world;
  }
}

// A collective among n of the world's ranks against one among all of them: each rank waits for the
// latest of its peers (Note [Planner waits by group]).
double wait_weight(int n, int world) {
  auto latest = [](int m) {  // the expected latest of m exponential arrivals beyond one's own: H(m) - 1
    double h = 0;
    for (int i = 2; i <= m; ++i) h += 1.0 / i;
    return h;
  };
  return latest(world) > 0 ? latest(n) / latest(world) : 1.0;
}

// The replay of one micro-batch, with the waits on peers the runtime calibration measured: they
// grow with the computation between the ranks' meetings, not with their number, so the
// candidate's share of them is spread evenly over the collectives it issues.
SimResult replay_with_waits(SimInput sim, const RuntimeCorrection& extra, const SimMicroBatch& m) {
  sim.micro = m;
  SimResult r = simulate(sim);
  const double waits = extra.waits_per_compute_s, beside = extra.beside_waits_per_compute_s;
  if ((waits == 0 && beside == 0) || r.collectives == 0) return r;
  const double wait = waits * r.compute_s / r.collectives;
  if (sim.comm_cpu_share > 0) {  // the compute thread's: exposed, not hidden behind it on a link
    sim.wait_per_collective_s = wait;
    sim.beside_wait_per_collective_s = beside * r.compute_s / r.collectives;
    return simulate(sim);
  }
  for (SimUnit& su : sim.units)
    for (SimFlat& flat : su.flats) {
      flat.gather_s = std::max(0.0, flat.gather_s + sim.shard_wait_weight * wait);
      const double replicas = flat.replica_reduce_s > 0 ? sim.replica_wait_weight : 0.0;
      if (flat.requires_grad) flat.reduce_s = std::max(0.0, flat.reduce_s + (sim.shard_wait_weight + replicas) * wait);
    }
  return simulate(sim);
}

struct Resting {
  int64_t shards = 0;       // parameter storage between iterations (device)
  int64_t piece_grads = 0;  // the shard pieces' gradients
  int64_t piece_numel = 0;  // this rank's real elements (optimizer state)
  int64_t piece_bytes = 0;
  int64_t optimizer_bytes = 0;  // the optimizer's state over this rank's pieces
  int64_t feedback_bytes = 0;   // error feedback's float32 residuals (held from the first reduction on)
  int64_t largest_piece = 0;    // one FlatParameter's separate pieces' gradients (the step in backward's, landed)
  int64_t separate_pieces = 0;  // the pieces' bytes of FlatParameters whose shard is separate from the storage
};

}  // namespace

PlanEntry evaluate(const ModelView& model, const Candidate& c, const Cluster& cluster, int world,
                   const PlanRequest& request, const RuntimeCorrection* correction, Replayed* replayed) {
  const RuntimeCorrection none;
  const RuntimeCorrection& extra = correction != nullptr ? *correction : none;
  const UnitPlan& plan = *model.units;
  const ModelCosts& costs = *model.costs;
  const int F = shard_factor(c, world);
  const bool offload = c.cpu_offload && !cluster.device_is_host;
  const double peak_flops =
      (c.precision == at::kFloat ? cluster.device.peak_flops_fp32 : cluster.device.peak_flops_16) *
      cluster.device.matmul_efficiency;
  // A calibrated link (the job's own ranks, measured) replaces both of the cluster's; where the
  // calibration also timed each host's ranks, groups of consecutive ranks within a host use that.
  const Calibration& calibration = request.calibration();
  const bool measured_link = calibration.link_gbps > 0;
  const Link measured = Link().bandwidth_gbps(calibration.link_gbps).latency_us(calibration.link_latency_us);
  const Link measured_intra =
      Link().bandwidth_gbps(calibration.intra_link_gbps).latency_us(calibration.intra_link_latency_us);
  const int per_host = calibration.intra_link_gbps > 0 ? calibration.link_ranks_per_host : 0;
  auto link_for = [&](int n) -> Link {
    if (!measured_link) return cluster.link_for_group(n);
    return per_host > 0 && per_host % n == 0 ? measured_intra : measured;
  };
  const Link shard_link = link_for(F);
  const Link world_link = link_for(world);
  // Replica groups hold one rank per host: the measured world link spans hosts with per_host
  // ranks on each, so one rank's own link is its share (Note [Modeled network]).
  const Link replica_link = !measured_link ? cluster.inter
                            : per_host > 1 ? Link(measured).bandwidth_gbps(measured.bandwidth_gbps() / per_host)
                                           : measured;
  const int k = c.reshard_after_forward_size;
  const Link hpz_link = link_for(std::max(k, 1));
  const double host_bps = cluster.host_device_gbps * 1e9;
  const Options options = c.options();

  SimInput sim;
  sim.units.resize(plan.units.size());
  Resting rest;
  // A unit no stretch of forward brings a gradient to (a block forward skips) holds none after
  // backward, and the optimizer keeps no state for its pieces.
  std::vector<char> trained(plan.units.size(), 0);
  for (const SegmentCost& s : costs.segments) trained[s.unit] = trained[s.unit] || s.grads_arrive;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    SimUnit& su = sim.units[u];
    const UnitPlan::Unit& pu = plan.units[u];
    su.ancestors = pu.ancestors;
    su.reshard_after_forward = reshards_after_forward(pu, options);  // as FsdpState decides it
    for (const int f : pu.flat_params) {
      const UnitPlan::FlatParam& fp = plan.flat_params[f];
      int64_t numel = 0;
      const at::Tensor& first = plan.params[fp.params.front()].param;
      for (const int p : fp.params) numel += plan.params[p].param.numel();
      const at::ScalarType dtype = first.scalar_type();
      const bool floating = at::isFloatingType(dtype);
      const at::ScalarType compute = floating && !fp.full_precision && c.precision != at::kFloat ? c.precision : dtype;
      const at::ScalarType reduce = floating && !fp.full_precision && c.precision != at::kFloat ? at::kFloat : dtype;
      const bool requires_grad = first.requires_grad();
      const int64_t padded = (numel + F - 1) / F * F;
      const int64_t shard = padded / F;
      const int64_t piece = std::max<int64_t>(0, std::min(shard, numel));  // rank 0's real elements
      SimFlat flat;
      flat.separate_shard = offload || F > 1 || compute != dtype || reduce != dtype || c.deterministic;
      flat.requires_grad = requires_grad;
      flat.unsharded_bytes = padded * element_size(compute);
      flat.gather_input_bytes = F > 1 && (compute != dtype || offload) ? shard * element_size(compute) : 0;
      if (requires_grad) {
        // Without a separate shard the pieces' gradients are the flat's own: with the step in backward
        // they live from the unit's backward until its reduction lands and steps.
        flat.grad_buffer_bytes = flat.separate_shard  ? padded * element_size(reduce)
                                 : c.step_in_backward ? padded * element_size(dtype)
                                                      : 0;
        flat.reduce_output_bytes = flat.separate_shard && F > 1 ? shard * element_size(reduce) : 0;
      }
      flat.gather_s = modeled_seconds(Collective::kAllGather, flat.unsharded_bytes, F, shard_link);
      if (k > 1 && su.reshard_after_forward && flat.separate_shard && F > 1) {  // hpZ: 1/k kept, gathered in k
        flat.post_forward_bytes = padded / k * element_size(compute);
        flat.post_forward_gather_s = modeled_seconds(Collective::kAllGather, flat.unsharded_bytes, k, hpz_link);
      }
      // Offloaded shards cross in the compute dtype, cast on the host, unless the step in backward
      // holds the host (Note [Cast on the host]); then in their own dtype, counted for both passes.
      if (offload)
        flat.gather_s += static_cast<double>(shard * element_size(c.step_in_backward ? dtype : compute)) / host_bps;
      if (requires_grad) {
        const int64_t grad_bytes = padded * element_size(reduce);
        flat.reduce_s = F == 1 ? modeled_seconds(Collective::kAllReduce, grad_bytes, world, world_link)
                               : modeled_seconds(Collective::kReduceScatter, grad_bytes, F, shard_link);
        if (c.strategy == ShardingStrategy::kHybridShard && world / F > 1) {
          flat.replica_reduce_s =
              modeled_seconds(Collective::kAllReduce, shard * element_size(reduce), world / F, replica_link);
          flat.reduce_s += flat.replica_reduce_s;
        }
        if (offload) flat.reduce_s += static_cast<double>(shard * element_size(reduce)) / host_bps;
      }
      const Quantization& gq = c.all_gather_quantization;
      if (gq.applies_to(pu.name, *pu.module) && F > 1 && floating && !offload) {
        // quantized_all_gather: each rank's shard packed in a slot; the slots gathered, then unpacked.
        const int64_t slot = packed_slot(block_format(gq, plan, fp, padded), F, shard);
        flat.gather_input_bytes = 0;
        flat.packed_shard_bytes = slot;
        flat.packed_gathered_bytes = F * slot;
        flat.gather_s = modeled_seconds(Collective::kAllGather, F * slot, F, shard_link);
        const QuantizedRates rates = quantized_rates(gq, calibration, cluster);
        flat.gather_pack_s = static_cast<double>(shard) * rates.pack_s;
        flat.gather_unpack_s = static_cast<double>(padded) * rates.unpack_s;
      }
      const Quantization& rq = c.reduce_quantization;
      if (requires_grad && rq.applies_to(pu.name, *pu.module) && world > 1 && floating) {
        const BlockFormat format = block_format(rq, plan, fp, padded);
        const QuantizedRates rates = quantized_rates(rq, calibration, cluster);
        // quantized_all_reduce: the parts to their owners, the owners' sums to everyone.
        // The largest rank's: a replica all-reduce's values start at its shard (F origins), NO_SHARD's at 0.
        auto all_reduce = [&](int64_t numel, int n, const Link& link, std::vector<int64_t>& packed) {
          int64_t slot = 0;
          for (int r = 0; r < (numel == padded ? 1 : F); ++r)
            slot = std::max(slot, all_reduce_slot(format, numel, n, r * numel));
          packed = {n * slot, n * slot, slot, n * slot};
          return modeled_seconds(Collective::kAllToAll, n * slot, n, link) + rates.owner_s(numel, n) +
                 modeled_seconds(Collective::kAllGather, n * slot, n, link);
        };
        // Every value packed as the reduction is issued; the landing sums the parts or unpacks the sums.
        const double values = static_cast<double>(padded);
        flat.reduce_pack_s = values * rates.pack_s;
        if (F == 1) {
          flat.reduce_s = all_reduce(padded, world, world_link, flat.reduce_packed);
          flat.reduce_land_s = values * rates.unpack_s;
        } else {  // quantized_reduce_scatter: each part packed to its owner, who sums them
          const int64_t slot = packed_slot(format, F, shard);
          flat.reduce_packed = {F * slot, F * slot};
          flat.reduce_s = modeled_seconds(Collective::kAllToAll, F * slot, F, shard_link);
          flat.reduce_land_s = values * rates.sum_s;
          if (c.strategy == ShardingStrategy::kHybridShard && world / F > 1) {  // of each rank's shard
            flat.replica_reduce_s = all_reduce(shard, world / F, replica_link, flat.replica_packed);
            flat.reduce_s += flat.replica_reduce_s;
            flat.replica_pack_s = static_cast<double>(shard) * rates.pack_s;
            flat.replica_land_s = static_cast<double>(shard) * rates.unpack_s;
          }
        }
        if (offload) flat.reduce_s += static_cast<double>(shard * element_size(reduce)) / host_bps;
        // Residuals: a reduce-scatter's of the whole unsharded gradient, and its all-reduces'.
        if (rq.error_feedback() && trained[u])
          rest.feedback_bytes += 4 * feedback_residuals(padded, F, world, c.strategy == ShardingStrategy::kHybridShard);
      }
      if (requires_grad && c.deterministic)
        set_exact_reduction(flat, padded, F, world, c.strategy == ShardingStrategy::kHybridShard && world / F > 1,
                            {shard_link, world_link, replica_link}, cluster.device.memory_gbps * 1e9);
      flat.issue_work_s = extra.per_collective_work_s;
      if (!offload) rest.shards += flat.separate_shard ? shard * element_size(dtype) : padded * element_size(compute);
      if (requires_grad && trained[u]) {
        rest.piece_numel += flat.separate_shard ? piece : numel;
        flat.step_elements = flat.separate_shard ? piece : numel;
        rest.piece_bytes += (flat.separate_shard ? piece : numel) * element_size(dtype);
        if (flat.separate_shard) {
          const int64_t piece_bytes = piece * element_size(dtype);
          rest.largest_piece = std::max(rest.largest_piece, piece_bytes);
          rest.separate_pieces += piece_bytes;
        }
        rest.optimizer_bytes += optimizer_state_bytes(request, plan, fp, flat.separate_shard ? piece : numel);
      }
      su.flats.push_back(flat);
    }
  }
  // Pieces' gradients from the last step, or, dropped between steps, the stores of FlatParameters
  // without a separate shard, born with backward's first gradient and kept to its end.
  if (!offload)
    rest.piece_grads = request.grads_kept_between_steps() ? rest.piece_bytes : rest.piece_bytes - rest.separate_pieces;
  // The optimizer's step, bound by memory bandwidth; in backward, each FlatParameter's share right
  // after its reduction lands, whose gradients it then drops (Note [Step in backward]).
  const double bandwidth = (offload ? cluster.host_device_gbps * 4 : cluster.device.memory_gbps) * 1e9;
  const double step_s = calibration.step_s_per_element > 0 && !offload
                            ? static_cast<double>(rest.piece_numel) * calibration.step_s_per_element
                            : static_cast<double>(rest.piece_numel) * kOptimizerValuesPerElement * 4.0 / bandwidth;
  const double optimizer_s = std::max(0.0, step_s + extra.per_step_s);
  if (c.step_in_backward && rest.piece_numel > 0) {
    sim.step_s_per_element = optimizer_s / static_cast<double>(rest.piece_numel);
    rest.piece_grads = 0;
  }

  // Activations and computation, per micro-batch; the checkpointed units, the first in forward order.
  const double tokens = static_cast<double>(c.micro_batch) * static_cast<double>(request.seq_len());
  const int64_t act_size = element_size(c.precision);
  const std::vector<int>& checkpointable = costs.checkpointable_units;
  const size_t checkpointed = !c.activation_checkpointing ? 0
                              : c.checkpointed_units > 0
                                  ? std::min(checkpointable.size(), static_cast<size_t>(c.checkpointed_units))
                                  : checkpointable.size();
  for (size_t i = 0; i < checkpointed; ++i) sim.units[checkpointable[i]].checkpointed = true;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    SimUnit& su = sim.units[u];
    su.full_activation_bytes = std::llround(costs.unit_activation_values[u] * tokens) * act_size +
                               std::llround(costs.unit_activation_fixed_bytes[u] * tokens);
    su.kept_activation_bytes = su.checkpointed ? static_cast<int64_t>(costs.unit_input_values[u] * tokens) * act_size
                                               : su.full_activation_bytes;
  }
  // Seconds per forward FLOP and backward over forward: measured (calibration) or nominal.
  const PrecisionTiming* timing = calibration.find(c.precision);
  const bool calibrated = timing != nullptr && costs.forward_flops > 0 && timing->forward_s > 0 && tokens > 0;
  double forward_s_per_flop = 1.0 / peak_flops, backward_ratio = 2.0;
  if (calibrated) {
    const CalibratedPasses passes = calibrated_passes(calibration, *timing, tokens);
    forward_s_per_flop = passes.forward_s / (costs.forward_flops * tokens);
    backward_ratio = passes.backward_s / passes.forward_s;
  }
  // What checkpointing changes per second of a checkpointed stretch's forward: in its forward (no
  // graph kept) and in its backward (the recomputation). Measured through the runtime
  // (runtime_correction), else by the copy's checkpointed passes, over the share of the forward
  // that checkpointing covered (the model's fsdp::Checkpointed modules, else the units this
  // candidate checkpoints); else one more forward in backward. See Note [Planner calibration].
  double covered_flops = costs.checkpointed_forward_flops;
  if (covered_flops <= 0 && c.activation_checkpointing)
    for (const SegmentCost& s : costs.segments)
      if (sim.units[s.unit].checkpointed) covered_flops += s.forward_flops;
  const double covered_forward_s = covered_flops * tokens * forward_s_per_flop;
  bool recompute_measured = extra.checkpointing_measured;
  double recompute_forward = extra.checkpointed_forward_change, recompute_backward = extra.checkpointed_backward_change;
  if (!recompute_measured && calibrated && covered_flops > 0 && timing->checkpointed_forward_s > 0 &&
      timing->checkpointed_backward_s > 0) {
    const double covered_s = timing->forward_s * covered_flops / costs.forward_flops;
    recompute_measured = true;
    recompute_forward = (timing->checkpointed_forward_s - timing->forward_s) / covered_s;
    recompute_backward = (timing->checkpointed_backward_s - timing->backward_s) / covered_s;
  }
  std::vector<int> unit_segments(plan.units.size(), 0);
  for (const SegmentCost& s : costs.segments) ++unit_segments[s.unit];
  for (const SegmentCost& s : costs.segments) {
    SimSegment seg;
    seg.unit = s.unit;
    const double forward_s = s.forward_flops * tokens * forward_s_per_flop * extra.compute_scale;
    const double share = 1.0 / unit_segments[s.unit];  // the unit's runtime work, spread over its stretches
    const double pass_share = costs.forward_flops > 0 ? s.forward_flops / costs.forward_flops
                                                      : 1.0 / static_cast<double>(costs.segments.size());
    const bool recompute = sim.units[s.unit].checkpointed;
    const bool measured = recompute && recompute_measured;
    seg.forward_s = std::max(0.0, forward_s * (1 + (measured ? recompute_forward : 0.0)) +
                                      extra.forward_per_unit_s * share + extra.forward_per_pass_s * pass_share);
    seg.backward_s =
        std::max(0.0, backward_ratio * forward_s + extra.backward_per_unit_s * share +
                          extra.backward_per_pass_s * pass_share + (measured ? recompute_backward * forward_s : 0.0)) +
        (recompute && !measured ? seg.forward_s : 0.0);
    const auto act = static_cast<double>(act_size);
    const double unit_bytes = costs.unit_activation_values[s.unit] * act + costs.unit_activation_fixed_bytes[s.unit];
    seg.activation_share = unit_bytes > 0 ? (s.activation_values * act + s.activation_fixed_bytes) / unit_bytes : 0;
    seg.reads_params = s.reads_params;
    seg.grads_arrive = s.grads_arrive;
    seg.arriving_flats = s.arriving_flats;
    seg.backward_reads = s.backward_reads;
    sim.segments.push_back(seg);
  }
  sim.backward_prefetch = c.backward_prefetch;
  sim.forward_prefetch = c.forward_prefetch;
  sim.keep_first_in_backward = !c.reshard_after_forward_policy;
  sim.limit_all_gathers = c.all_gather_limit > 0;
  sim.all_gather_limit = std::max(1, c.all_gather_limit);
  sim.reductions_in_flight = c.reductions_in_flight;
  sim.no_shard = c.strategy == ShardingStrategy::kNoShard;
  sim.separate_lanes = cluster.separate_comm_lanes;
  sim.shard_wait_weight = wait_weight(F == 1 ? world : F, world);
  sim.hpz_wait_weight = wait_weight(std::max(k, 1), world);
  sim.replica_wait_weight = wait_weight(world / F, world);
  sim.waits_preempt = cluster.device_is_host;
  // On a CPU cluster the transport copies on the compute cores; beneath a slower modeled link, the
  // links' time beyond the copies overlaps the computation.
  if (cluster.device_is_host) {
    auto cpu_share = [&](const Link& link) {
      return measured_link && calibration.link_copy_gbps > link.bandwidth_gbps()
                 ? link.bandwidth_gbps() / calibration.link_copy_gbps
                 : 1.0;
    };
    sim.comm_cpu_share = cpu_share(world_link);
    sim.shard_cpu_share = cpu_share(F == 1 ? world_link : shard_link);
    sim.hpz_cpu_share = cpu_share(hpz_link);
  }
  // One micro-batch, or with no_sync or replica-deferred reductions the first, one of those between
  // and the last (which reduces the sum, or reduces across replicas); their peaks are the step's,
  // their times add up.
  const bool no_sync = c.no_sync && c.accumulation > 1;
  const bool deferred = c.replica_deferred && can_defer_replicas(c, world);
  const bool unsharded = c.keep_unsharded && can_keep_unsharded(c, world);
  // The first micro-batch begins with nothing held; one between and the last begin with what the
  // one before left; all but the last end as the mode says.
  SimMicroBatch first, between_batch, last_batch;
  first.reduce = between_batch.reduce = !no_sync;
  between_batch.grads_held = last_batch.grads_held = no_sync;
  first.defer_replicas = between_batch.defer_replicas = deferred;
  between_batch.partials_held = last_batch.partials_held = deferred;
  first.reshard_after_backward = between_batch.reshard_after_backward = !unsharded;
  between_batch.params_held = last_batch.params_held = unsharded;
  SimResult r = replay_with_waits(sim, extra, no_sync || deferred ? first : SimMicroBatch{});
  double step_passes_s = c.accumulation * r.step_s, step_compute_s = c.accumulation * r.compute_s,
         step_exposed_s = c.accumulation * r.exposed_s;
  if (no_sync || deferred) {
    const SimResult last = replay_with_waits(sim, extra, last_batch);
    const SimResult between = c.accumulation > 2 ? replay_with_waits(sim, extra, between_batch) : r;
    const double n = c.accumulation - 2;
    step_passes_s = r.step_s + n * between.step_s + last.step_s;
    step_compute_s = r.compute_s + n * between.compute_s + last.compute_s;
    step_exposed_s = r.exposed_s + n * between.exposed_s + last.exposed_s;
    for (const SimResult* o : {&between, &last}) {
      r.param_transient_peak = std::max(r.param_transient_peak, o->param_transient_peak);
      r.grad_transient_peak = std::max(r.grad_transient_peak, o->grad_transient_peak);
      r.activation_peak = std::max(r.activation_peak, o->activation_peak);
      r.total_transient_peak = std::max(r.total_transient_peak, o->total_transient_peak);
      r.pool_bytes = std::max(r.pool_bytes, o->pool_bytes);
    }
  }
  // After the first of several micro-batches the pieces hold gradients (its reduced ones, or, where
  // it left them unreduced under no_sync or replica-deferred reductions, zeros), which the next
  // backward's accounting counts.
  // (Stepping in backward, a FlatParameter without a separate shard holds them in its own storage.)
  if (c.accumulation > 1 && !offload) rest.piece_grads = c.step_in_backward ? rest.separate_pieces : rest.piece_bytes;
  if (replayed != nullptr) {
    replayed->forward_s = r.forward_s;
    replayed->passes_s = r.step_s;
    replayed->exposed_s = r.exposed_s;
    replayed->collectives = r.collectives;
    replayed->wait_weight = r.wait_weight;
    replayed->units = static_cast<int>(plan.units.size());
    replayed->checkpointed_forward_s = covered_forward_s;
  }

  PlanEntry e;
  e.candidate = c;
  for (size_t i = 0; i < checkpointed; ++i)
    e.candidate.checkpointed_unit_names.push_back(plan.units[checkpointable[i]].name);
  MemoryPrediction& m = e.memory;
  m.params = rest.shards + r.param_transient_peak;
  // Each backward ends with every trained piece holding its gradient, however they began it.
  const int64_t landed = offload || c.step_in_backward ? 0 : rest.piece_bytes - rest.piece_grads;
  m.grads = rest.piece_grads + std::max(r.grad_transient_peak, landed);
  m.optimizer = offload ? 0 : rest.optimizer_bytes;
  m.activations = r.activation_peak;
  m.feedback = rest.feedback_bytes;
  for (const UnitPlan::Param& p : plan.ignored_params)  // on the device, with a gradient after backward
    m.ignored += p.param.numel() * element_size(p.param.scalar_type()) * (p.param.requires_grad() ? 2 : 1) +
                 (p.param.requires_grad() && request.step_ignored() ? ignored_state_bytes(request, p) : 0);
  // What the calibrated passes held beyond the activations the replay keeps, per token; with some
  // units checkpointed, between the passes' peaks with none and with every one, by their share.
  const double share = checkpointable.empty() ? 0.0 : static_cast<double>(checkpointed) / checkpointable.size();
  const int64_t passes_peak =
      timing == nullptr ? 0
      : share <= 0      ? timing->peak_bytes
      : timing->checkpointed_peak_bytes <= 0
          ? 0
          : std::llround((1 - share) * timing->peak_bytes + share * timing->checkpointed_peak_bytes);
  if (passes_peak > 0 && tokens > 0) {
    const double beyond = static_cast<double>(passes_peak) / static_cast<double>(calibration.tokens) -
                          static_cast<double>(r.activation_peak) / tokens;
    m.workspace = std::llround(std::max(0.0, beyond) * tokens);
  }
  const int64_t tensors = rest.shards + rest.piece_grads + m.optimizer + m.feedback + m.ignored +
                          std::max(r.total_transient_peak, landed) + m.workspace +
                          (c.step_in_backward ? rest.largest_piece : 0);
  // The pool's idle buffers at the joint peak: once warm it holds its most of every size throughout.
  const int64_t pool_idle = std::max<int64_t>(0, r.pool_bytes + r.activation_peak - r.total_transient_peak);
  m.headroom = pool_idle + static_cast<int64_t>(static_cast<double>(tensors) * request.allocator_headroom());
  m.process = request.process_bytes();
  m.peak = tensors + m.headroom + m.process;
  // A host heap keeps what a checkpointed backward's steps free among its recomputed activations:
  // no lower than stepping after backward (Note [Step in backward on a host heap]).
  if (c.step_in_backward && c.activation_checkpointing && cluster.device_is_host) {
    Candidate after = c;
    after.step_in_backward = false;
    const int64_t kept = evaluate(model, after, cluster, world, request, correction, nullptr).memory.peak - m.peak;
    if (kept > 0) {
      m.headroom += kept;
      m.peak += kept;
    }
  }
  if (offload) m.host = 2 * rest.piece_bytes + rest.optimizer_bytes;

  // Each micro-batch reduces its gradients; the optimizer steps once after them, or within the last.
  if (replayed != nullptr) replayed->optimizer_s = step_s;
  TimePrediction& t = e.time;
  t.step_s = step_passes_s + (c.step_in_backward ? 0 : optimizer_s);
  t.compute_s = step_compute_s + (c.step_in_backward ? 0 : optimizer_s);
  t.exposed_comm_s = step_exposed_s;
  const double model_flops = 3.0 * costs.forward_flops * tokens * c.accumulation;
  t.tflops_per_device = t.step_s > 0 ? model_flops / t.step_s / 1e12 : 0;
  const double peak = c.precision == at::kFloat ? cluster.device.peak_flops_fp32 : cluster.device.peak_flops_16;
  t.mfu = peak > 0 ? t.tflops_per_device * 1e12 / peak : 0;
  return e;
}

}  // namespace fsdp::planner
