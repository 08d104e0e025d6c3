#pragma once
// --plan and --memory-budget: fsdp::plan over this trainer's GPT (built on the meta device), and
// the chosen configuration written back into the flags.
#include <fsdp/fsdp.h>

#include <cstdint>
#include <stdexcept>

#include "train_config.h"

namespace fsdp_gpt {

// --cluster, or this machine with `world` ranks.
fsdp::Cluster plan_cluster(const TrainConfig& config, int world);

// Every configuration the trainer can run (`flags_only`: the one the flags select), for the flags'
// model and batch on `cluster`. `process_bytes`: this process's memory outside tensors (its
// resident set before the model).
fsdp::Plan plan_gpt(const TrainConfig& config, const fsdp::Cluster& cluster, int64_t process_bytes,
                    bool flags_only = false, const fsdp::Calibration& calibration = {});

// --calibrate: the GPT's forward, backward and AdamW step timed on this machine (a real copy of the
// model, one micro-batch of random tokens) in the precisions the plan considers (`flags_only`:
// the flags' own). Collective-free.
fsdp::Calibration calibrate_gpt(const TrainConfig& config, bool flags_only);

// --calibrate in a training job: a throwaway copy of the GPT sharded as the flags say (without
// checkpointing or quantization) timed through the FSDP runtime, every rank at once, in the
// precisions the plan considers (fsdp::calibrate_runtime); `both_wrappings`: also wrapped the other
// way (by block or not at all). Collective over `pg`.
void calibrate_gpt_runtime(const TrainConfig& config, const fsdp::ProcessGroupPtr& pg, bool flags_only,
                           bool both_wrappings, fsdp::Calibration& calibration);

// The flags that run `candidate` (strategy, wrapping, checkpointing, precision, micro-batch).
void apply_candidate(const fsdp::Candidate& candidate, TrainConfig& config);

// --plan: rank 0 prints the table (fitting configurations first, fastest first), planned from
// what a --memory-budget run of the same flags plans from; the exit code.
int print_plan(const TrainConfig& config, const fsdp::ProcessGroupPtr& pg, double job_matmul_flops);

// An error every rank met alike, which rank 0 reports: the others exit with it quietly.
struct ReportedByRankZero : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// --memory-budget: every rank plans alike (the resident set's mean over ranks as the process's own
// memory) and takes the fastest configuration that fits; rank 0 says which. Throws fsdp::Error
// naming the smallest budget that would fit when none does. --plan-file: rank 0 writes the
// prediction for the configuration the run trains with. Without --cluster, `job_matmul_flops`
// (the sum over ranks of the rates measured at once) sets this machine's peak per rank.
void adopt_plan(TrainConfig& config, const fsdp::ProcessGroupPtr& pg, double job_matmul_flops);

}  // namespace fsdp_gpt
