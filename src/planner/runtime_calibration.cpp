// fsdp::calibrate_runtime (include/fsdp/calibration.h): the FSDP runtime's own passes timed at the
// job's world. See Note [Planner runtime calibration] in docs/design.md.
#include <algorithm>
#include <cmath>

#include "fsdp/calibration.h"
#include "fsdp/check.h"
#include "fsdp/fully_shard.h"
#include "fsdp/process_group.h"
#include "planner/timing_stats.h"

namespace fsdp {
namespace {

using planner::Clock;
using planner::median;
using planner::seconds_since;

void drop_grads(const FullyShardedModule& sharded) {
  for (const auto& p : sharded.shard_pieces())
    if (p.piece.grad().defined()) p.piece.mutable_grad() = at::Tensor();
}

}  // namespace

void calibrate_runtime(Calibration& calibration, FullyShardedModule& sharded, const ProcessGroup& pg,
                       const std::function<at::Tensor()>& loss, RuntimeTiming timed, int repetitions,
                       const std::function<void()>& step, double min_timed_s) {
  FSDP_CHECK(loss != nullptr, "fsdp::calibrate_runtime: loss is null; pass a function that runs one forward");
  FSDP_CHECK(repetitions >= 1, "fsdp::calibrate_runtime: repetitions must be >= 1, got ", repetitions);
  FSDP_CHECK(min_timed_s >= 0, "fsdp::calibrate_runtime: min_timed_s must be >= 0, got ", min_timed_s);
  FSDP_CHECK(timed.micro_batch >= 1, "fsdp::calibrate_runtime: the timed micro_batch must be at least 1, got ",
             timed.micro_batch);
  FSDP_CHECK(!timed.wrap.empty(),
             "fsdp::calibrate_runtime: name the wrap policy the copy was wrapped by (RuntimeTiming::wrap), as the "
             "PlanRequest names it");
  FSDP_CHECK(sharded.sharding_strategy() == timed.strategy, "fsdp::calibrate_runtime: the copy is wrapped with ",
             to_string(sharded.sharding_strategy()), " but the timing describes ", to_string(timed.strategy));
  FSDP_CHECK(timed.strategy != ShardingStrategy::kHybridShard || sharded.sharding_factor() == timed.sharding_factor,
             "fsdp::calibrate_runtime: the copy shards over ", sharded.sharding_factor(),
             " ranks but the timing describes a hybrid factor of ", timed.sharding_factor);
  timed.world = pg.size();
  sharded.set_trace(true);
  std::vector<double> forward, backward, wait_shares, steps;
  if (pg.size() > 1) pg.world()->barrier();
  int timed_repetitions = repetitions;  // every rank the same count: the iterations are collective
  for (int i = 0; i <= timed_repetitions; ++i) {
    drop_grads(sharded);
    const auto start = Clock::now();
    at::Tensor value = loss();
    FSDP_CHECK(value.numel() == 1, "fsdp::calibrate_runtime: loss() must return a scalar, got ", value.numel(),
               " values");
    const double f = seconds_since(start);
    const auto middle = Clock::now();
    value.backward();
    const double b = seconds_since(middle);
    const auto stepping = Clock::now();
    if (step) step();
    const double s = seconds_since(stepping);
    if (i == 0) {
      const double first_s = mean_across_ranks(pg, f + b + s);
      if (first_s * repetitions < min_timed_s)
        timed_repetitions =
            std::min(10 * repetitions, static_cast<int>(std::ceil(min_timed_s / std::max(first_s, 1e-9))));
      continue;
    }
    forward.push_back(f);
    backward.push_back(b);
    wait_shares.push_back(std::min(1.0, sharded.last_trace().exposed_comm_us * 1e-6 / std::max(f + b, 1e-12)));
    steps.push_back(s);
  }
  drop_grads(sharded);
  timed.forward_s = mean_across_ranks(pg, median(forward));
  timed.backward_s = mean_across_ranks(pg, median(backward));
  // Medians do not add: the waits are the median share of an iteration's passes (Note [Planner runtime calibration]).
  timed.exposed_s = mean_across_ranks(pg, median(wait_shares) * (median(forward) + median(backward)));
  timed.step_s = step ? mean_across_ranks(pg, median(steps)) : -1;
  auto& runtime = calibration.runtime;
  runtime.erase(std::remove_if(runtime.begin(), runtime.end(),
                               [&](const RuntimeTiming& r) {
                                 return r.precision == timed.precision && r.strategy == timed.strategy &&
                                        r.sharding_factor == timed.sharding_factor && r.wrap == timed.wrap &&
                                        r.activation_checkpointing == timed.activation_checkpointing &&
                                        r.beneath_network_model == timed.beneath_network_model;
                               }),
                runtime.end());
  runtime.push_back(timed);
}

}  // namespace fsdp
