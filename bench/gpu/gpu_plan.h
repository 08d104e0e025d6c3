#pragma once
// gpu_gpt_bench --plan: the planner's prediction for the run's own configuration (step time and
// peak reserved memory at world 1), from a calibration made on the run's device just before it
// (docs/planner.md, "On a CUDA device").
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "model.h"

namespace gpu_bench {

// The run the bench is about to make.
struct PlannedConfiguration {
  gpt::GPTConfig model;
  int64_t rows = 1;  // sequences per rank per step
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
  at::ScalarType compute = at::kBFloat16;  // bf16: MixedPrecision over float32 masters; kFloat: none
  bool fused_optimizer = true;             // fsdp::FusedAdamW, else torch::optim::AdamW
};

struct PlannedRun {
  double step_s = 0;
  int64_t peak_bytes = 0;         // the device's whole peak, the allocator's headroom included
  double allocator_headroom = 0;  // the plain copy's calibration: peak reserved over peak allocated, minus 1
  double calibrate_s = 0;         // the calibration's own wall time
  std::string table;              // Plan::table() of the one candidate
};

// Calibrates on `pg`'s device (a throwaway copy of the model: its passes and AdamW step, then the
// same sharded by the FSDP runtime) and plans `run` on `cluster`; leaves the device's cache
// emptied and its peak statistics reset. Collective over `pg`.
PlannedRun plan_run(const PlannedConfiguration& run, const fsdp::ProcessGroupPtr& pg, const fsdp::Cluster& cluster);

// The preset for a device named `device_name` (e.g. "NVIDIA H200"), `world` ranks on one node.
fsdp::Cluster cluster_for(const std::string& device_name, int world);

}  // namespace gpu_bench
