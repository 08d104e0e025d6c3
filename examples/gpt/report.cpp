#include "report.h"

#include <fsdp/fsdp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "formatting.h"

namespace fsdp_gpt {

namespace {

// Which launcher convention told this process its rank (fsdp::RankEnv::source).
std::string launcher_variables(const fsdp::RankEnv& env) {
  if (env.source == "torchrun") return "RANK, WORLD_SIZE from fsdp-run or torchrun";
  if (env.source == "mpirun") return "OMPI_COMM_WORLD_* from mpirun";
  if (env.source == "srun") return "SLURM_* from srun";
  return "no launcher";
}

// Two columns, the keys padded to the longest.
void print_table(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t key_width = 0;
  for (const auto& row : rows) key_width = std::max(key_width, row.first.size());
  for (const auto& row : rows)
    std::cout << "  " << std::left << std::setw(key_width + 2) << row.first << row.second << "\n";
  std::cout << std::right;
}

// Model state each rank keeps between steps: parameters, gradients and AdamW's two moments, for
// this run's shards next to a replica's (NO_SHARD: every rank holds all N parameters).
void print_memory_comparison(const fsdp::FullyShardedModule& sharded, int64_t parameter_count) {
  int64_t param_bytes = 0, trainable_bytes = 0;
  for (const auto& piece : sharded.parameters()) {
    const int64_t bytes = piece.numel() * piece.element_size();
    param_bytes += bytes;
    if (piece.requires_grad()) trainable_bytes += bytes;
  }
  const int64_t replica_bytes = parameter_count * static_cast<int64_t>(sizeof(float));
  const int64_t ours = param_bytes + 3 * trainable_bytes, replicated = 4 * replica_bytes;
  auto row = [](const std::string& name, int64_t p, int64_t g, int64_t adam) {
    std::cout << "  " << std::left << std::setw(30) << name << std::right << std::setw(12) << mib(p) << std::setw(12)
              << mib(g) << std::setw(12) << mib(adam) << std::setw(12) << mib(p + g + adam) << "\n";
  };
  std::cout << "\nmodel-state memory per rank (rank 0; fp32 parameters + gradients + AdamW moments):\n";
  std::cout << "  " << std::left << std::setw(30) << "" << std::right << std::setw(12) << "params" << std::setw(12)
            << "grads" << std::setw(12) << "AdamW" << std::setw(12) << "total"
            << "\n";
  row(fsdp::to_string(sharded.sharding_strategy()) + " (this run, F=" + std::to_string(sharded.sharding_factor()) + ")",
      param_bytes, trainable_bytes, 2 * trainable_bytes);
  row("NO_SHARD (full replica)", replica_bytes, replica_bytes, 2 * replica_bytes);
  std::cout << "  this run keeps " << fixed(100.0 * ours / replicated, 1) << "% of a replica's model state on each "
            << "rank,\n  plus units gathered while they run (the 'fsdp peak' column of the step log)\n";
}

// What --grad-accum-mode does with the micro-batches before the last, for the configuration table.
std::string grad_accum_mode_description(const std::string& mode) {
  if (mode == "no-sync") return "all but the last without communication";
  if (mode == "no-sync-unsharded") return "all but the last without communication, parameters kept unsharded";
  if (mode == "reduce") return "every one reduce-scattered";
  return "every one reduce-scattered in the shard group, the replica all-reduce on the last";
}

std::string optimizer_name(const std::string& kind) {
  if (kind == "lamb") return "LAMB";
  if (kind == "adafactor") return "Adafactor";
  if (kind == "muon") return "Muon (blocks' matrices, lr x20) with AdamW";
  return "AdamW";
}

}  // namespace

void print_configuration(const TrainConfig& config, const fsdp::RankEnv& env, const JobFigures& job,
                         const fsdp::FullyShardedModule& sharded, const BuiltModel& built, const TrainingData& data) {
  const int world = job.world, threads_per_rank = job.threads_per_rank;
  const BatchPlan& plan = config.batch;
  const int64_t units = static_cast<int64_t>(sharded.units().size());
  std::cout << "fsdp_gpt configuration\n";
  print_table({
      {"world size", std::to_string(world) + " (" + std::to_string(env.local_world_size) + " on this host, " +
                         std::to_string(threads_per_rank) + " thread" + (threads_per_rank == 1 ? "" : "s") +
                         " per rank; " + launcher_variables(env) + ")"},
      {"malloc", job.malloc},
      {"strategy", fsdp::to_string(sharded.sharding_strategy())},
      {"sharding factor", std::to_string(sharded.sharding_factor())},
      {"wrap", config.wrap == "block" ? "block (every BlockImpl is a unit, plus the root)"
                                      : "none (the whole model is one unit)"},
      {"units", std::to_string(units)},
      {"reshard after forward",
       (config.reshard_after_forward == "strategy" ? std::string("the strategy's choice")
                                                   : config.reshard_after_forward + " (--reshard-after-forward)") +
           (config.reshard_after_forward_size
                ? ", then sharded over groups of " + std::to_string(config.reshard_after_forward_size) +
                      " ranks until backward"
                : std::string())},
      {"mixed precision", config.mixed_precision == "none"
                              ? std::string("none (float32)")
                              : config.mixed_precision + " gathers and compute, float32 reduction and master weights" +
                                    (config.mixed_precision == "fp16" ? ", sharded gradient scaler" : "")},
      {"quantized communication",
       config.quantize_all_gather == "none" && config.quantize_reduce == "none"
           ? std::string("off")
           : "all-gathers " + config.quantize_all_gather + ", reductions " + config.quantize_reduce +
                 (config.quantize_error_feedback ? " with error feedback" : "") + ", " +
                 std::to_string(config.quantize_block) + " values per scale, every unit but the root"},
      {"grad accumulation", std::to_string(plan.accum) + " micro-batch" + (plan.accum == 1 ? "" : "es") + " of " +
                                std::to_string(plan.micro) + " per step" +
                                (plan.accum > 1 ? " (" + config.grad_accum_mode + ": " +
                                                      grad_accum_mode_description(config.grad_accum_mode) + ")"
                                                : std::string())},
      {"activation checkpointing",
       !config.activation_checkpointing ? "off"
       : config.checkpointed_blocks > 0
           ? "the first " + std::to_string(config.checkpointed_blocks) + " blocks (recomputed in backward)"
           : "every block (recomputed in backward)"},
      {"optimizer step", config.step_in_backward
                             ? "in backward, unit by unit as gradients are reduced (thread: " + config.step_thread + ")"
                             : std::string("after backward")},
      {"gradient clipping", config.clip_grad_norm > 0 ? "total 2-norm " + fixed(config.clip_grad_norm, 3) : "off"},
      {"prefetch",
       "backward " + fsdp::to_string(fsdp::parse_backward_prefetch(config.backward_prefetch)) + ", forward " +
           (config.forward_prefetch ? "on" : "off") + ", rate limiter " +
           (config.all_gather_limit > 0 ? std::to_string(config.all_gather_limit) + " units" : std::string("off"))},
      {"parameters", with_commas(built.parameter_count) + " (tied embedding and head counted once); initialization " +
                         (config.init == "deferred" ? "deferred (unit by unit in fully_shard)" : "eager")},
      {"model", std::to_string(config.layers) + " layers, width " + std::to_string(config.width) + ", " +
                    std::to_string(config.heads) + " heads, context " + std::to_string(config.context) +
                    ", vocab 256 (bytes)"},
      {"batch", "global " + std::to_string(plan.global) + " sequences (--global-batch) " +
                    (plan.global == world * plan.per_rank ? "= " : "<= ") + std::to_string(world) +
                    (world == 1 ? " rank x " : " ranks x ") + std::to_string(plan.accum) + " micro-batch" +
                    (plan.accum == 1 ? "" : "es") + " x " + std::to_string(plan.micro) + " (--batch-size); " +
                    std::to_string(plan.global) + " x " + std::to_string(config.context) + " = " +
                    with_commas(job.tokens_per_step) + " tokens per step"},
      {"steps", std::to_string(config.steps) + " (log every " + std::to_string(config.log_interval) + ")"},
      {"optimizer", optimizer_name(config.optimizer) + (config.fused_adamw ? " (fsdp::FusedAdamW)" : "") + ", lr " +
                        fixed(config.lr, 6) + ", warm-up " + std::to_string(config.warmup) + ", then " +
                        (config.schedule == "cosine" ? "cosine to " + fixed(config.min_lr, 6) : "constant") +
                        ", weight decay " + fixed(config.weight_decay, 3)},
      {"data", data.corpus.description},
      {"tokens", with_commas(static_cast<int64_t>(data.corpus.text.size())) +
                     " bytes: " + with_commas(data.splits.train.numel()) + " train, " +
                     with_commas(data.splits.validation.numel()) + " validation"},
      {"seed", std::to_string(config.seed)},
      {"FLOPs per token", fixed(job.flops_per_token / 1e6, 2) + " M (6N + 12 L T W)"},
      {"matmul peak", fixed(job.peak.job_flops / 1e12, 4) +
                          " TFLOP/s for the job (rank 0: " + fixed(job.peak.rank0_flops / 1e9, 1) +
                          " GFLOP/s: fastest of 8 1024x1024 matmuls, all ranks running)"},
  });
  std::cout << sharded.describe();
  if (config.show_memory) print_memory_comparison(sharded, built.parameter_count);
  std::cout << std::flush;
}

void print_report(const TrainConfig& config, const JobFigures& job, const TrainingResult& result, double val_loss_start,
                  double val_loss_end, const std::string& sample, Clock::time_point program_start) {
  std::cout << "validation loss after training: " << fixed(val_loss_end, 4) << " (before: " << fixed(val_loss_start, 4)
            << ")\n";
  if (config.show_memory)
    std::cout << "rank 0 FSDP peak during training: parameters " << mib(result.param_peak_bytes) << ", gradients "
              << mib(result.grad_peak_bytes) << "\n";
  if (!sample.empty())
    std::cout << "\n--- sample (temperature " << config.temperature << ") ---\n" << printable(sample) << "\n---\n\n";
  std::cout << "done: " << config.steps << " steps in " << fixed(seconds_since(program_start), 1) << " s ("
            << fixed(result.train_seconds, 1) << " s training)";
  if (result.timed_steps == 0) {  // resumed from the last step: nothing trained in this process
    std::cout << " | no steps left to train | val loss " << fixed(val_loss_end, 4) << "\n" << std::flush;
    return;
  }
  std::cout << " | final train loss " << fixed(result.last_logged_loss, 4) << " | val loss " << fixed(val_loss_start, 4)
            << " -> " << fixed(val_loss_end, 4) << " | mean "
            << with_commas(std::llround(job.tokens_per_step * result.timed_steps / result.train_seconds)) << " tok/s\n"
            << std::flush;
}

void print_modeled_traffic(const ModeledLinks& before, const ModeledLinks& after, int steps) {
  if (after.empty() || steps <= 0) return;
  double gather = 0, scatter = 0, all = 0, busy = 0;
  for (const auto& [name, s] : after) {
    gather += static_cast<double>(s.gather_wire_bytes);
    scatter += static_cast<double>(s.scatter_wire_bytes);
    all += static_cast<double>(s.wire_bytes);
    busy += s.modeled_busy_s;
  }
  for (const auto& [name, s] : before) {
    gather -= static_cast<double>(s.gather_wire_bytes);
    scatter -= static_cast<double>(s.scatter_wire_bytes);
    all -= static_cast<double>(s.wire_bytes);
    busy -= s.modeled_busy_s;
  }
  std::cout << "modeled network, bytes rank 0 sent per step: all-gathers " << fixed(gather / steps / 1e6, 4)
            << " MB, reduce-scatters " << fixed(scatter / steps / 1e6, 4) << " MB, other "
            << fixed((all - gather - scatter) / steps / 1e6, 4) << " MB; links busy " << fixed(busy / steps * 1e3, 1)
            << " ms per step\n"
            << std::flush;
}

}  // namespace fsdp_gpt
