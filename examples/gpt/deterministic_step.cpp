#include "deterministic_step.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <optional>
#include <vector>

#include "evaluation.h"
#include "optimizer.h"
#include "training_data.h"

namespace fsdp_gpt {

namespace {

constexpr uint64_t kDropoutStream = 4;  // after the streams of training_data.h

}  // namespace

std::vector<double> global_step_losses(fsdp::ProcessGroup& pg, const std::vector<std::vector<double>>& per_step) {
  std::vector<double> means;
  if (per_step.empty()) return means;
  const auto steps = static_cast<int64_t>(per_step.size()), count = static_cast<int64_t>(per_step[0].size());
  // Each loss is added to zeros only (every other rank holds 0 there): the sums are exact.
  at::Tensor all = at::zeros({steps, count}, at::kDouble);
  for (int64_t s = 0; s < steps; ++s) std::copy(per_step[s].begin(), per_step[s].end(), all[s].data_ptr<double>());
  if (pg.size() > 1) pg.world()->all_reduce(all, fsdp::CollectiveOptions::labeled("micro-batch losses"))->wait();
  for (int64_t s = 0; s < steps; ++s) {
    const double* row = all[s].data_ptr<double>();
    double sum = 0;
    for (int64_t i = 0; i < count; ++i) sum += row[i];  // in index order, as at any world size
    means.push_back(sum / static_cast<double>(count));
  }
  return means;
}

MicroBatchRange micro_batch_range(int count, int rank, int world) {
  return {static_cast<int>(int64_t(count) * rank / world), static_cast<int>(int64_t(count) * (rank + 1) / world)};
}

int micro_batches_per_rank(int count, int world) { return static_cast<int>((int64_t(count) + world - 1) / world); }

std::vector<double> deterministic_train_step(const TrainingLoop& loop, int step, double lr) {
  const TrainConfig& config = loop.config;
  gpt::set_learning_rate(loop.optimizer, lr);
  const BatchPlan& plan = config.batch;
  const int count = plan.global / plan.micro;
  const MicroBatchRange range = micro_batch_range(count, loop.pg.rank(), loop.pg.size());
  const int passes = micro_batches_per_rank(count, loop.pg.size());
  const int64_t micro = plan.micro;
  const uint64_t key = gpt::batch_key(config.seed, kTrainStream, step);
  const auto batch = range.end > range.first ? gpt::sample_batch(loop.train_tokens, config.context, key, plan.global,
                                                                 range.first * micro, (range.end - range.first) * micro)
                                             : gpt::Batch{};
  // A padding pass runs micro-batch 0 again, uncounted: its gradients are dropped.
  const auto padding = range.end - range.first < passes
                           ? gpt::sample_batch(loop.train_tokens, config.context, key, plan.global, 0, micro)
                           : gpt::Batch{};
  loop.optimizer.zero_grad();
  std::vector<double> losses(count, 0.0);
  for (int m = 0; m < passes; ++m) {
    const int i = range.first + m;
    const bool real = i < range.end, last = m + 1 == passes;
    const int64_t row = m * micro;
    gpt::Batch part =
        real ? gpt::Batch{batch.inputs.narrow(0, row, micro), batch.targets.narrow(0, row, micro)} : padding;
    std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
    if (!last) no_sync.emplace(loop.sharded.no_sync());
    if (config.grad_accum_mode == "no-sync-unsharded") loop.sharded.set_reshard_after_backward(last);
    loop.sharded.set_backward_counted(real);
    // Dropout's draws follow the micro-batch's index in the global batch, not the rank.
    {
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_current_seed(gpt::batch_key(config.seed, kDropoutStream, uint64_t(step) * count + (real ? i : 0)));
    }
    // Not divided by the micro-batch count: FSDP averages over every rank's micro-batches.
    auto loss = next_token_loss(loop.model, part);
    (loop.scaler ? loop.scaler->scale(loss) : loss).backward();
    if (real) losses[i] = loss.item<double>();
  }
  loop.sharded.set_backward_counted(true);
  finish_step(loop);
  return losses;
}

}  // namespace fsdp_gpt
