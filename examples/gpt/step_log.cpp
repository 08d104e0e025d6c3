#include "step_log.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <stdexcept>
#include <string>

#include "deterministic_step.h"
#include "formatting.h"
#include "measurements.h"

namespace fsdp_gpt {

std::ofstream open_metrics(const TrainConfig& config, bool is_main, int resumed_step) {
  std::ofstream metrics;
  if (!is_main || config.metrics_file.empty()) return metrics;
  std::string kept;  // a resumed run keeps the lines of the steps its checkpoint holds
  if (resumed_step > 0) {
    std::ifstream earlier(config.metrics_file);
    for (std::string line; std::getline(earlier, line);) {
      const auto entry = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (entry.is_object() && entry.contains("step") && entry["step"].is_number_integer() &&
          entry["step"].get<int64_t>() <= resumed_step)
        kept += line + "\n";
    }
  }
  metrics.open(config.metrics_file);
  if (!metrics) throw std::runtime_error("cannot write --metrics-file " + config.metrics_file);
  metrics << kept << std::flush;
  return metrics;
}

void settle_losses(const TrainingLoop& loop, LogWindow& window) {
  if (!loop.config.deterministic) return;
  for (const double mean : global_step_losses(loop.pg, window.pending_losses)) window.loss += mean;
  window.pending_losses.clear();
}

void log_window(const TrainingLoop& loop, int step, double lr, double local_loss, LogWindow& window,
                TrainingResult& result, ProgressBar& progress) {
  const TrainConfig& config = loop.config;
  settle_losses(loop, window);
  // The logged loss is the mean over the window's steps and over all ranks' slices (--deterministic:
  // each step's loss is already the global batch's, the same on every rank).
  const double mean_loss =
      (config.deterministic ? window.loss : fsdp::mean_across_ranks(loop.pg, window.loss)) / window.steps;
  result.last_logged_loss = mean_loss;

  const double ms_per_step = 1000.0 * window.seconds / window.timed_steps;
  const double tokens_per_s = loop.job.tokens_per_step * window.timed_steps / window.seconds;
  const double model_flops = loop.job.flops_per_token * tokens_per_s;
  const double mfu = model_flops / loop.job.peak.job_flops;
  // Above the measured peak is impossible: such a figure is a measurement fault, not printed.
  const bool mfu_possible = mfu <= 1.0;
  const auto memory = loop.sharded.memory_stats();
  const int64_t fsdp_peak = memory.param_peak_bytes + memory.grad_peak_bytes;
  result.param_peak_bytes = std::max(result.param_peak_bytes, memory.param_peak_bytes);
  result.grad_peak_bytes = std::max(result.grad_peak_bytes, memory.grad_peak_bytes);
  const int64_t rss = resident_bytes();
  if (loop.is_main) {
    progress.clear();
    std::cout << "step " << std::setw(std::to_string(config.steps).size()) << step << "/" << config.steps << " | loss "
              << fixed(mean_loss, 4) << " | lr " << std::scientific << std::setprecision(2) << lr << std::defaultfloat
              << " | " << std::setw(7) << fixed(ms_per_step, 1) << " ms/step | " << std::setw(7)
              << with_commas(std::llround(tokens_per_s)) << " tok/s | " << fixed(model_flops / 1e12, 4)
              << " TFLOP/s | MFU " << (mfu_possible ? fixed(100.0 * mfu, 1) + "%" : std::string("n/a (over the peak)"))
              << " | fsdp peak " << mib(fsdp_peak) << " | rss " << fixed(rss / 1048576.0, 0) << " MiB\n"
              << std::flush;
    progress.draw(step, local_loss, result.train_seconds);
    if (loop.metrics.is_open())
      loop.metrics << nlohmann::json{{"step", step},
                                     {"loss", mean_loss},
                                     {"lr", lr},
                                     {"ms_per_step", ms_per_step},
                                     {"tokens_per_s", tokens_per_s},
                                     {"model_tflops", model_flops / 1e12},
                                     {"mfu", mfu_possible ? nlohmann::json(mfu) : nlohmann::json()},
                                     {"fsdp_param_peak_bytes", memory.param_peak_bytes},
                                     {"fsdp_grad_peak_bytes", memory.grad_peak_bytes},
                                     {"fsdp_feedback_bytes", memory.feedback_bytes},
                                     {"rss_bytes", rss},
                                     {"rss_peak_bytes", peak_resident_bytes()},
                                     {"page_faults_per_step",
                                      static_cast<double>(minor_page_faults() - window.faults_at_start) /
                                          window.timed_steps},
                                     {"exposed_comm_share", config.measure_exposed_comm
                                                                ? nlohmann::json(window.exposed_comm_s / window.seconds)
                                                                : nlohmann::json()},
                                     {"elapsed_s", seconds_since(loop.program_start)}}
                          .dump()
                   << "\n"
                   << std::flush;
  }
  loop.sharded.reset_peak_memory_stats();
  window = LogWindow();
}

}  // namespace fsdp_gpt
