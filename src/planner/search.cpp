// fsdp::plan (include/fsdp/planner.h): every candidate of the request's search space, each
// predicted by evaluate(); fitting ones first, fastest first.
#include <algorithm>
#include <map>
#include <sstream>

#include "fsdp/check.h"
#include "fsdp/planner.h"
#include "planner/evaluate.h"
#include "planner/model_costs.h"
#include "unit_plan.h"

namespace fsdp {

namespace {

std::vector<int> hybrid_factors(const PlanRequest& request, const Cluster& cluster, int world) {
  std::vector<int> factors = request.hybrid_factors();
  if (factors.empty()) factors.push_back(cluster.nodes > 1 ? cluster.ranks_per_node : world / 2);
  std::vector<int> ok;
  for (const int f : factors)
    if (f > 1 && f < world && world % f == 0) ok.push_back(f);
  return ok;
}

std::vector<int> micro_batches(const PlanRequest& request, int per_rank) {
  if (!request.micro_batches().empty()) return request.micro_batches();
  std::vector<int> all;
  for (int m = 1; m <= per_rank; ++m)
    if (per_rank % m == 0) all.push_back(m);
  return all;
}

}  // namespace

Plan plan(torch::nn::Module& model, const Cluster& cluster, const PlanRequest& request) {
  const int world = request.world() > 0 ? request.world() : cluster.world();
  FSDP_CHECK(request.seq_len() >= 1, "PlanRequest::seq_len must be >= 1");
  const int global = request.global_batch() > 0 ? request.global_batch() : world;
  FSDP_CHECK(global % world == 0, "the global batch ", global, " does not divide over ", world, " ranks");
  const int per_rank = global / world;

  Plan result;
  result.budget = request.memory_budget() > 0 ? request.memory_budget() : cluster.device.memory_bytes;
  FSDP_CHECK(request.memory_margin() >= 0, "PlanRequest::memory_margin must be >= 0 (a share of the peak), got ",
             request.memory_margin());
  result.memory_margin = request.memory_margin();
  const double with_margin = 1.0 + request.memory_margin();
  result.cluster = cluster.describe();
  // Every wrap policy's units and costs (the searched ones first, then those only runtime timings
  // name), then what the runtime timings add to their replays.
  std::vector<NamedWrapPolicy> known = request.wrap_policies();
  const size_t searched = known.size();
  known.insert(known.end(), request.calibration_wrap_policies().begin(), request.calibration_wrap_policies().end());
  FSDP_CHECK(!request.trace_forward() || !request.module_cost(),
             "PlanRequest: set trace_forward or module_cost, not both (the trace counts every operator, the "
             "module's own ones included)");
  std::vector<planner::TracedSegment> traced;
  if (request.trace_forward())
    traced = planner::trace_forward(model, request.trace_forward(), request.trace_sequences() * request.seq_len(),
                                    request.trace_probe_bytes());
  std::vector<UnitPlan> unit_plans;
  std::vector<planner::ModelCosts> model_costs;
  unit_plans.reserve(known.size());
  model_costs.reserve(known.size());
  auto view_of = [&](size_t w) {
    while (unit_plans.size() <= w) {
      const size_t next = unit_plans.size();
      unit_plans.push_back(plan_units(model, Options().auto_wrap_policy(known[next].policy), c10::Device(c10::kCPU)));
      model_costs.push_back(request.trace_forward() ? planner::model_costs(model, unit_plans.back(), traced)
                                                    : planner::model_costs(model, unit_plans.back(),
                                                                           request.module_cost(), request.seq_len()));
    }
    return planner::ModelView{&unit_plans[w], &model_costs[w]};
  };
  std::map<at::ScalarType, std::vector<planner::TimedConfiguration>> timed;
  for (const RuntimeTiming& timing : request.calibration().runtime) {
    if (timing.world != world) {
      result.notes.push_back("the calibration's " + std::string(c10::toString(timing.precision)) +
                             " runtime timing was made at world " + std::to_string(timing.world) + ", not " +
                             std::to_string(world) + ": FSDP's own work is not in these predictions");
      continue;
    }
    size_t w = 0;
    while (w < known.size() && known[w].name != timing.wrap) ++w;
    FSDP_CHECK(w < known.size(), "the calibration's runtime timing was made with the wrap policy \"", timing.wrap,
               "\", which neither PlanRequest::wrap_policies nor calibration_wrap_policies names; add it under that "
               "name, or calibrate again");
    timed[timing.precision].push_back({&timing, view_of(w), known[w]});
  }
  std::map<at::ScalarType, planner::RuntimeCorrection> corrections;
  for (const auto& [precision, configurations] : timed)
    corrections[precision] = planner::runtime_correction(configurations, cluster, world, request);
  for (size_t w = 0; w < searched; ++w) {
    const NamedWrapPolicy& wrap = known[w];
    const planner::ModelView view = view_of(w);
    const UnitPlan& units = *view.units;
    for (const ShardingStrategy strategy : request.strategies()) {
      std::vector<int> factors{0};
      if (strategy == ShardingStrategy::kHybridShard) factors = hybrid_factors(request, cluster, world);
      if (world == 1 && strategy != ShardingStrategy::kFullShard) continue;  // all the same at one rank
      for (const int factor : factors)
        for (const bool checkpointing : request.activation_checkpointing())
          for (const bool offload : request.cpu_offload()) {
            if (offload && cluster.device_is_host) continue;
            if (checkpointing && units.units.size() < 2) continue;  // only the root: nothing to checkpoint
            for (const at::ScalarType precision : request.precisions())
              for (const int limit : request.all_gather_limits())
                for (const BackwardPrefetch prefetch : request.backward_prefetch())
                  for (const bool forward : request.forward_prefetch())
                    for (const int in_flight : request.reductions_in_flight())
                      for (const int micro : micro_batches(request, per_rank)) {
                        if (micro < 1 || per_rank % micro != 0) continue;
                        Candidate c;
                        c.strategy = strategy;
                        c.sharding_factor = factor;
                        c.wrap = wrap;
                        c.activation_checkpointing = checkpointing;
                        c.cpu_offload = offload;
                        c.precision = precision;
                        c.all_gather_limit = limit;
                        c.backward_prefetch = prefetch;
                        c.forward_prefetch = forward;
                        c.reductions_in_flight = in_flight;
                        c.micro_batch = micro;
                        c.accumulation = per_rank / micro;
                        const auto corrected = corrections.find(precision);
                        PlanEntry e = planner::evaluate(view, c, cluster, world, request,
                                                        corrected == corrections.end() ? nullptr : &corrected->second);
                        e.fits =
                            static_cast<double>(e.memory.peak) * with_margin <= static_cast<double>(result.budget) &&
                            (e.memory.host == 0 || e.memory.host * cluster.ranks_per_node <= cluster.host_memory_bytes);
                        result.entries.push_back(std::move(e));
                      }
          }
    }
  }
  std::stable_sort(result.entries.begin(), result.entries.end(), [](const PlanEntry& a, const PlanEntry& b) {
    if (a.fits != b.fits) return a.fits;
    return a.time.step_s < b.time.step_s;
  });
  return result;
}

}  // namespace fsdp
