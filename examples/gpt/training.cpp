#include "training.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>
#include <algorithm>

#include <optional>
#include <string>

#include "checkpointing.h"
#include "deterministic_step.h"
#include "evaluation.h"
#include "lr_schedule.h"
#include "measurements.h"
#include "optimizer.h"
#include "progress_bar.h"
#include "step_log.h"
#include "stop_signal.h"
#include "training_data.h"

namespace fsdp_gpt {

namespace {

// One optimizer step at `lr` on this rank's rows of the step's global batch; returns the rank's mean loss.
double train_step(const TrainingLoop& loop, int step, double lr) {
  const TrainConfig& config = loop.config;
  gpt::set_learning_rate(loop.optimizer, lr);
  const int64_t rank = loop.pg.rank();
  const BatchPlan& plan = config.batch;
  const auto batch =
      gpt::sample_batch(loop.train_tokens, config.context, gpt::batch_key(config.seed, kTrainStream, step), plan.global,
                        rank * plan.per_rank, plan.per_rank);
  loop.optimizer.zero_grad();
  // plan.accum micro-batches; all but the last treat their gradients as --grad-accum-mode says.
  const int64_t micro = plan.micro;
  const std::string& mode = config.grad_accum_mode;
  double loss_sum = 0;
  for (int m = 0; m < plan.accum; ++m) {
    gpt::Batch part{batch.inputs.narrow(0, m * micro, micro), batch.targets.narrow(0, m * micro, micro)};
    const bool last = m + 1 == plan.accum;
    std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
    if (!last && (mode == "no-sync" || mode == "no-sync-unsharded")) no_sync.emplace(loop.sharded.no_sync());
    if (mode == "no-sync-unsharded") loop.sharded.set_reshard_after_backward(last);
    if (mode == "replica-deferred") loop.sharded.set_requires_all_reduce(last);
    auto loss = next_token_loss(loop.model, part) / plan.accum;
    (loop.scaler ? loop.scaler->scale(loss) : loss).backward();
    loss_sum += loss.item<double>();
  }
  finish_step(loop);
  return loss_sum;
}

}  // namespace

void finish_step(const TrainingLoop& loop) {
  const double max_norm = loop.config.clip_grad_norm;
  if (loop.scaler && max_norm > 0) loop.scaler->unscale_(loop.optimizer);
  if (max_norm > 0) loop.sharded.clip_grad_norm_(max_norm);
  if (loop.scaler) {
    loop.scaler->step(loop.optimizer);
    loop.scaler->update();
  } else {
    loop.optimizer.step();
  }
}

TrainingResult train(const TrainingLoop& loop) {
  const TrainConfig& config = loop.config;
  ProgressBar progress(loop.is_main && stdout_is_terminal(loop.pg.env()), config.steps);
  loop.sharded.reset_peak_memory_stats();
  restart_resident_peak();  // the metrics' rss_peak_bytes: training only, not set-up or validation
  TrainingResult result;
  LogWindow window;
  window.loss = loop.start.window_loss, window.steps = loop.start.window_steps;
  if (!config.save_dir.empty()) install_stop_handler();
  PendingSave pending;
  for (int step = loop.start.step + 1; step <= config.steps; ++step) {
    const auto step_start = Clock::now();
    const double lr = learning_rate(step, config);
    double local_loss = 0;
    if (config.deterministic) {  // summed across ranks when the window is logged or saved (settle_losses)
      window.pending_losses.push_back(deterministic_train_step(loop, step, lr));
      int mine = 0;  // the progress bar's: the mean over this rank's micro-batches
      for (const double l : window.pending_losses.back()) local_loss += l, mine += l != 0;
      local_loss /= std::max(1, mine);
    } else {
      local_loss = train_step(loop, step, lr);
      window.loss += local_loss;
    }
    const double step_seconds = seconds_since(step_start);
    result.train_seconds += step_seconds;
    ++result.timed_steps;
    window.seconds += step_seconds;
    if (config.measure_exposed_comm) window.exposed_comm_s += loop.sharded.last_trace().exposed_comm_us * 1e-6;
    ++window.steps;
    ++window.timed_steps;
    progress.draw(step, local_loss, result.train_seconds);
    if (step == 1 || step % config.log_interval == 0 || step == config.steps)
      log_window(loop, step, lr, local_loss, window, result, progress);
    if (!config.save_dir.empty()) {
      const bool stop = step == config.stop_after || stop_requested_anywhere(loop.pg);
      const bool last = stop || step == config.steps;
      if (last || (config.save_every > 0 && step % config.save_every == 0)) {
        progress.clear();
        settle_losses(loop, window);
        save_checkpoint(loop.pg, config, loop.sharded, loop.optimizer,
                        Progress{step, window.loss, window.steps, config.batch.global, ""}, loop.scaler,
                        config.async_save && !last, pending);
      }
      if (stop && step < config.steps) {
        result.stopped_after = step;
        break;
      }
    }
  }
  pending.finish(loop.pg);
  progress.clear();
  return result;
}

}  // namespace fsdp_gpt
