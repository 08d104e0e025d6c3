#pragma once
// Rank 0's report around training: the configuration table before it, the summary after it.
#include <fsdp/fsdp.h>

#include <string>

#include "measurements.h"
#include "model_setup.h"
#include "timing.h"
#include "train_config.h"
#include "training.h"
#include "training_data.h"

namespace fsdp_gpt {

// Rank 0: the resolved configuration table, the units, and (--show-memory) the memory comparison.
void print_configuration(const TrainConfig& config, const fsdp::RankEnv& env, const JobFigures& job,
                         const fsdp::FullyShardedModule& sharded, const BuiltModel& built, const TrainingData& data);

// Rank 0: validation losses, peak memory (--show-memory), the sample and the summary line.
void print_report(const TrainConfig& config, const JobFigures& job, const TrainingResult& result, double val_loss_start,
                  double val_loss_end, const std::string& sample, Clock::time_point program_start);

using ModeledLinks = std::vector<std::pair<std::string, fsdp::ModeledLinkStats>>;
// Rank 0, under FSDP_NETWORK_MODEL: the bytes this rank sent per training step, by collective,
// between two readings of ProcessGroup::modeled_links().
void print_modeled_traffic(const ModeledLinks& before, const ModeledLinks& after, int steps);

}  // namespace fsdp_gpt
