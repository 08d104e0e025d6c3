#pragma once
// Where the replay (schedule_sim.cpp) enters each unit, and the orders it runs them in: from each
// stretch's parameter reads, as the runtime's Scheduler::use and GradientReducer::take_grad see them.
#include <vector>

#include "planner/sim_input.h"

namespace fsdp::planner {

struct SimOrders {
  std::vector<char> enters;              // per stretch: it enters its unit
  std::vector<int> first_segment;        // per unit: its first entering stretch (-1: none)
  std::vector<int> grads_in_segment;     // per unit: the stretch whose backward brings its last gradient
  std::vector<int> grads_alloc_segment;  // per unit: the stretch whose backward brings its first gradient
  // Per unit, per FlatParameter: the stretch whose backward brings its first gradient (-1: the unit's).
  std::vector<std::vector<int>> flat_alloc_segment;
  std::vector<int> forward_order;        // the units by first entry in forward
  std::vector<int> backward_order;       // the units by last entry in forward, last first
  int first_in_backward = -1;            // the non-root unit backward needs first, where forward keeps it
  std::vector<char> unread_in_backward;  // per unit: backward reaches it without reading its parameters
  // Per stretch: where the checkpointed forwards around inner units that end there begin, outer first.
  std::vector<std::vector<int>> recomputes;
};

SimOrders sim_orders(const SimInput& input);

}  // namespace fsdp::planner
