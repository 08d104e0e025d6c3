#pragma once
// The optimizer state a rank holds for one FlatParameter's pieces, for the planner's memory figures.
#include <cstdint>

#include "fsdp/plan_request.h"
#include "unit_plan.h"

namespace fsdp::planner {

// The optimizer state over rank 0's pieces of `fp`'s parameters, which hold [0, limit) of the
// flat, in bytes of the parameters' dtype (PlanRequest::optimizer_state, else optimizer_states).
int64_t optimizer_state_bytes(const PlanRequest& request, const UnitPlan& plan, const UnitPlan::FlatParam& fp,
                              int64_t limit);

// The optimizer state of one whole parameter FSDP leaves alone, in bytes of its dtype.
int64_t ignored_state_bytes(const PlanRequest& request, const UnitPlan::Param& param);

}  // namespace fsdp::planner
