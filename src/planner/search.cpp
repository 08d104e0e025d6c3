// fsdp::plan (include/fsdp/planner.h): every candidate of the request's search space, each
// predicted by evaluate(); fitting ones first, fastest first.
#include <algorithm>
#include <sstream>

#include "fsdp/check.h"
#include "fsdp/planner.h"
#include "planner/evaluate.h"
#include "planner/model_costs.h"
#include "unit_plan.h"

namespace fsdp {

Options Candidate::options() const {
  Options o;
  o.sharding_strategy(strategy)
      .sharding_factor(strategy == ShardingStrategy::kHybridShard ? sharding_factor : 0)
      .auto_wrap_policy(wrap.policy)
      .backward_prefetch(backward_prefetch)
      .forward_prefetch(forward_prefetch)
      .limit_all_gathers(all_gather_limit > 0)
      .all_gather_limit(std::max(1, all_gather_limit))
      .reductions_in_flight(reductions_in_flight);
  if (precision != at::kFloat) o.mixed_precision(MixedPrecision().param_dtype(precision).reduce_dtype(at::kFloat));
  if (cpu_offload) o.offload(CpuOffload().params(true));
  return o;
}

std::string Candidate::describe() const {
  std::ostringstream o;
  o << to_string(strategy);
  if (strategy == ShardingStrategy::kHybridShard) o << "/" << sharding_factor;
  o << ", wrap " << wrap.name << (activation_checkpointing ? ", checkpointed" : "") << (cpu_offload ? ", offload" : "")
    << ", " << (precision == at::kFloat ? "fp32" : precision == at::kBFloat16 ? "bf16" : "fp16") << ", micro-batch "
    << micro_batch << " x " << accumulation;
  if (all_gather_limit != 2) o << ", all-gather limit " << all_gather_limit;
  if (backward_prefetch != BackwardPrefetch::kBackwardPre) o << ", " << to_string(backward_prefetch);
  if (!forward_prefetch) o << ", no forward prefetch";
  if (reductions_in_flight != 2) o << ", " << reductions_in_flight << " reductions in flight";
  return o.str();
}

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
  result.cluster = cluster.describe();
  for (const NamedWrapPolicy& wrap : request.wrap_policies()) {
    const UnitPlan units = plan_units(model, Options().auto_wrap_policy(wrap.policy), c10::Device(c10::kCPU));
    const planner::ModelCosts costs = planner::model_costs(model, units, request.module_cost(), request.seq_len());
    const planner::ModelView view{&units, &costs};
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
                        PlanEntry e = planner::evaluate(view, c, cluster, world, request);
                        e.fits = e.memory.peak <= result.budget &&
                                 (e.memory.host == 0 ||
                                  e.memory.host * cluster.ranks_per_node <= cluster.host_memory_bytes);
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
