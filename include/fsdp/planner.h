#pragma once
// fsdp::plan: predicts, before launch, each configuration's peak memory per rank (by kind) and its
// step time (by simulating the runtime's schedule over the cluster's links), and picks the fastest
// that fits. The units are the runtime's own (the same unit planning fully_shard uses). How the
// prediction is made and what it leaves out: docs/planner.md.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/cluster.h"
#include "fsdp/plan_request.h"

namespace fsdp {

struct Plan {
  std::vector<PlanEntry> entries;  // fitting ones first, each group fastest first
  int64_t budget = 0;
  double memory_margin = 0;  // PlanRequest::memory_margin
  std::string cluster;
  std::vector<std::string> notes;  // what the plan could not use (a runtime timing of another world)

  bool any_fits() const { return !entries.empty() && entries.front().fits; }
  // The fastest fitting entry. Throws fsdp::Error naming the smallest budget any candidate needs.
  const PlanEntry& best() const;
  // The smallest budget any candidate fits in: its peak with the margin (0: no candidates).
  int64_t smallest_peak() const;
  // Every entry: memory by kind (in KiB, MiB or GiB by the largest peak shown), step time split, TFLOP/s, MFU, fits.
  std::string table(size_t max_rows = 0) const;
  // Every entry as one line of JSON (its keys: docs/planner.md), each listing `not_modeled`: what
  // the run does that the prediction leaves out.
  std::string json_lines(const std::vector<std::string>& not_modeled = {}) const;
};

// Plans for `model` (its parameters on the meta device, or anywhere: nothing is allocated or run).
Plan plan(torch::nn::Module& model, const Cluster& cluster, const PlanRequest& request);

}  // namespace fsdp
