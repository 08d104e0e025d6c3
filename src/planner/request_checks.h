#pragma once
// PlanRequest's values checked before a plan: values no run can have, and lists that leave nothing
// to search, each refused naming the setting.
#include "fsdp/cluster.h"
#include "fsdp/plan_request.h"

namespace fsdp::planner {

void check_request(const PlanRequest& request, const Cluster& cluster);

}  // namespace fsdp::planner
