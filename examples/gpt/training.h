#pragma once
// The training loop: --steps optimizer steps with gradient accumulation, logging and checkpoints.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>

#include "checkpointing.h"
#include "measurements.h"
#include "model.h"
#include "timing.h"
#include "train_config.h"

namespace fsdp_gpt {

// What the training loop hands on to the report.
struct TrainingResult {
  double train_seconds = 0.0;
  int timed_steps = 0;  // the steps this process ran (train_seconds is their time)
  double last_logged_loss = 0.0;
  int64_t param_peak_bytes = 0, grad_peak_bytes = 0;  // FSDP peaks over the logged windows
  int stopped_after = 0;  // --stop-after or SIGTERM: the step after which it saved and stopped
};

// What the training loop works with, set up before it.
struct TrainingLoop {
  const TrainConfig& config;
  fsdp::ProcessGroup& pg;
  gpt::GPT& model;
  fsdp::FullyShardedModule& sharded;
  torch::optim::Optimizer& optimizer;
  const torch::Tensor& train_tokens;
  const JobFigures& job;
  std::ofstream& metrics;  // open on rank 0 with --metrics-file only
  Clock::time_point program_start;
  bool is_main;
  fsdp::GradScaler* scaler = nullptr;  // --mixed-precision fp16
  Progress start;                      // where training continues: a resumed checkpoint's, or step 0
};

// After a step's backward passes: clips the gradients (--clip-grad-norm), then steps the
// optimizer, through the scaler under --mixed-precision fp16.
void finish_step(const TrainingLoop& loop);

// Runs --steps optimizer steps, logging at step 1, every --log-interval steps and at the last.
TrainingResult train(const TrainingLoop& loop);

}  // namespace fsdp_gpt
