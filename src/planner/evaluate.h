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

// `world` ranks of `cluster`; every other input comes from `request`.
PlanEntry evaluate(const ModelView& model, const Candidate& candidate, const Cluster& cluster, int world,
                   const PlanRequest& request);

}  // namespace fsdp::planner
