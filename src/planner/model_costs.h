#pragma once
// The planner's shape pass: per unit, the forward FLOPs and the values kept for backward per token,
// counted over the module tree (Linear, Embedding, LayerNorm and matrices by rule; anything else by
// PlanRequest::module_cost) or from an operator trace, and the order in which forward runs through
// the units. See Note [Planner cost pass] in docs/design.md.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "fsdp/plan_request.h"
#include "planner/op_trace.h"
#include "unit_plan.h"

namespace fsdp::planner {

// One stretch of forward inside one unit, per token.
struct SegmentCost {
  int unit = 0;
  double forward_flops = 0;
  double activation_values = 0;       // floating values kept, in the compute dtype
  double activation_fixed_bytes = 0;  // bytes kept whose width no precision changes (integers)
  bool reads_params = false;          // reads a parameter of its unit (the runtime enters the unit)
  bool grads_arrive =
      false;  // its backward brings a first gradient: it reads a parameter requiring grad for the first time
  bool backward_reads = false;      // its backward reads a parameter of its unit (the runtime enters the unit again)
  std::vector<int> arriving_flats;  // the unit's FlatParameters (by position) its backward brings a first gradient
};

struct ModelCosts {
  std::vector<SegmentCost> segments;                // forward order (module order), merged per unit
  std::vector<double> unit_activation_values;       // per unit, per token
  std::vector<double> unit_activation_fixed_bytes;  // per unit, per token
  std::vector<double> unit_input_values;            // per unit, per token: what a checkpointed unit keeps
  double forward_flops = 0;                         // whole model, per token
  double checkpointed_forward_flops = 0;            // inside the model's fsdp::Checkpointed modules, per token
  std::vector<int> checkpointable_units;  // each non-root unit with an input, in forward order (a candidate's first k)
};

ModelCosts model_costs(torch::nn::Module& root, const UnitPlan& units, const ModuleCostFn& extra, int64_t seq_len);
// The modules (name and type) whose costs the rules miscount and `extra` gives nothing for.
std::vector<std::string> miscounted_modules(torch::nn::Module& root, const ModuleCostFn& extra, int64_t seq_len);
// The coarsest module type that repeats and whose instances hold at least half the parameters
// (a model's blocks): its C++ class, instances and share of the parameters; count 0 where none does.
struct RepeatedBlock {
  std::string type;
  int count = 0;
  double share = 0;
};
RepeatedBlock repeated_block(torch::nn::Module& root);
// The same from an operator trace (op_trace.h) instead of the rules, in the trace's order.
ModelCosts model_costs(torch::nn::Module& root, const UnitPlan& units, const std::vector<TracedSegment>& traced);

}  // namespace fsdp::planner
