#pragma once
// What the report measures besides the loss: resident memory, the job's matmul peak, and the
// model FLOPs per token that MFU compares with it.
#include <fsdp/fsdp.h>

#include <cstdint>
#include <string>

#include "train_config.h"

namespace fsdp_gpt {

// Resident set size of this process, from /proc/self/status (0 where unavailable).
int64_t resident_bytes();
// The resident set's peak since the process began, or since restart_resident_peak().
int64_t peak_resident_bytes();
void restart_resident_peak();
// Minor page faults of this process so far (memory the kernel mapped in, zero-filled or shared).
int64_t minor_page_faults();

// Model FLOPs per trained token (forward + backward, PaLM's estimate): 6 per parameter (a
// multiply-add forward, two backward) plus the attention score and mixing matmuls,
// 2 matmuls x 2 FLOPs x context x width per layer forward, tripled for backward: 12 L T W.
double training_flops_per_token(int64_t parameters, const TrainConfig& c);

// The peak matmul rate of this rank and of the whole job.
struct MatmulPeak {
  double rank0_flops = 0.0;  // this rank's own rate (printed by rank 0)
  double job_flops = 0.0;    // the sum over all ranks
};

// Peak matmul rate, measured by all ranks at once (see measure_matmul_flops).
MatmulPeak measure_peak(fsdp::ProcessGroup& pg);

// Figures of the whole job that the configuration and the step log report.
struct JobFigures {
  int world = 1;
  int threads_per_rank = 1;
  std::string malloc;  // the allocator settings in effect (set_malloc)
  int64_t tokens_per_step = 0;
  double flops_per_token = 0.0;
  MatmulPeak peak;
};

}  // namespace fsdp_gpt
