// fsdp_gpt: trains the small GPT of model.h on text with libfsdp, one process per rank.
//
//   fsdp-run --nproc-per-node 4 ./fsdp_gpt                  # fortunes corpus, FULL_SHARD
//   fsdp-run --nproc-per-node 4 ./fsdp_gpt --strategy HYBRID_SHARD --sharding-factor 2
//   ./fsdp_gpt --data my_text.txt --steps 1000              # a single process works too
//   fsdp-run --nproc-per-node 4 ./fsdp_gpt --save-dir ckpt --save-every 50 [--resume]
//
// Every rank runs this same program (SPMD). Rank 0 alone prints and writes the metrics file, but
// every forward pass (training, validation, sampling) is run by every rank: FSDP gathers each
// unit's parameters from all ranks when an operation reads them, so a forward is collective.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <exception>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "checkpointing.h"
#include "evaluation.h"
#include "formatting.h"
#include "measurements.h"
#include "model_setup.h"
#include "parameter_hash.h"
#include "planning.h"
#include "quantization_report.h"
#include "rank_setup.h"
#include "report.h"
#include "step_log.h"
#include "timing.h"
#include "train_config.h"
#include "training.h"
#include "training_data.h"

namespace fsdp_gpt {

namespace {

// The whole program on one rank: flags, set-up, training, evaluation and report; the exit code.
int run(int argc, char** argv) {
  const auto program_start = Clock::now();
  const fsdp::RankEnv env = read_rank_env();
  TrainConfig config;
  if (const int code = parse_flags(argc, argv, env, config); code >= 0) return code;
  JobFigures job;
  job.malloc = set_malloc(config.malloc);
  job.threads_per_rank = set_threads_per_rank(env, config.deterministic);

  auto pg = fsdp::ProcessGroup::from_env();
  const int rank = pg->rank();
  job.world = pg->size();
  const bool is_main = rank == 0;

  check_save_dir(config);
  const std::optional<TrainingData> data = load_data(config, is_main);
  if (!data) return 1;
  job.peak = measure_peak(*pg);
  if (config.plan) return print_plan(config, pg, job.peak.job_flops);
  if (!config.memory_budget.empty() || !config.plan_file.empty()) adopt_plan(config, pg, job.peak.job_flops);

  resolve_init(config, rank);
  BuiltModel built = build_model(config);
  auto sharded = shard_model(built, config, pg);
  auto optimizer = build_optimizer(*sharded, config);
  if (config.step_in_backward)
    sharded->set_step_in_backward(optimizer.get(), config.step_thread == "own"        ? fsdp::StepThread::kOwn
                                                   : config.step_thread == "backward" ? fsdp::StepThread::kBackward
                                                                                      : fsdp::StepThread::kAuto);

  std::optional<fsdp::GradScaler> scaler;
  if (config.mixed_precision == "fp16") scaler.emplace(*sharded);
  // A resumed run keeps its checkpoint's global batch, whatever the world size now.
  const Progress start =
      config.resume ? resume(*pg, config, *sharded, *optimizer, scaler ? &*scaler : nullptr) : Progress{};
  resolve_batch(config, job.world, start.global_batch, start.dir);

  job.tokens_per_step = static_cast<int64_t>(config.batch.global) * config.context;
  job.flops_per_token = training_flops_per_token(built.parameter_count, config);
  if (is_main) print_configuration(config, pg->env(), job, *sharded, built, *data);
  std::ofstream metrics = open_metrics(config, is_main, start.step);

  const double val_loss_start = validation_loss(built.model, data->splits.validation, config);
  if (is_main) std::cout << "validation loss before training: " << fixed(val_loss_start, 4) << "\n" << std::flush;

  TrainingLoop loop{config,
                    *pg,
                    built.model,
                    *sharded,
                    *optimizer,
                    data->splits.train,
                    job,
                    metrics,
                    program_start,
                    is_main,
                    scaler ? &*scaler : nullptr,
                    start};
  const ModeledLinks links_before = pg->modeled_links();
  const TrainingResult result = train(loop);
  if (is_main) print_modeled_traffic(links_before, pg->modeled_links(), result.timed_steps);
  const uint64_t hash = parameter_hash(*sharded);
  if (is_main) std::cout << "final parameter hash " << hex16(hash) << "\n" << std::flush;
  if (result.stopped_after > 0) {
    if (is_main)
      std::cout << "stopped after step " << result.stopped_after << " of " << config.steps
                << "; continue with --resume\n"
                << std::flush;
    return 0;
  }

  const double val_loss_end = validation_loss(built.model, data->splits.validation, config);
  std::string sample;
  if (config.sample_bytes > 0) {
    // The whole model at once for generation (full precision), instead of a gather per forward.
    auto full = sharded->summon_full_params();
    sample = generate(built.model, config.prompt, config);
  }
  if (is_main) print_report(config, job, result, val_loss_start, val_loss_end, sample, program_start);
  if (!config.quantization_report.empty()) report_quantization_error(config, *sharded, pg, data->splits.train, is_main);
  if (!config.export_file.empty()) export_model(config, *sharded, is_main);
  return 0;
}

}  // namespace

}  // namespace fsdp_gpt

int main(int argc, char** argv) {
  try {
    return fsdp_gpt::run(argc, argv);
  } catch (const fsdp_gpt::ReportedByRankZero&) {
    return 1;
  } catch (const std::exception& e) {
    // Errors after start-up can differ between ranks (a lost peer, a bad file on one host), so
    // every rank reports its own.
    std::cerr << "fsdp_gpt" << fsdp_gpt::g_rank_label << ": error: " << e.what() << "\n";
    return 1;
  }
}
