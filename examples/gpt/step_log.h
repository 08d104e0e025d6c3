#pragma once
// The step log: one line per logged step on rank 0 (loss, learning rate, speed, MFU, memory), and
// the same as JSON in --metrics-file.
#include <cstdint>
#include <fstream>
#include <vector>

#include "measurements.h"
#include "progress_bar.h"
#include "train_config.h"
#include "training.h"

namespace fsdp_gpt {

// Rank 0 with --metrics-file: the open file (throws if it cannot be written); otherwise not open.
// Resumed at resumed_step > 0, the file keeps its lines of steps up to that one; later ones go.
std::ofstream open_metrics(const TrainConfig& config, bool is_main, int resumed_step);

// The steps since the last log line: their summed local losses, and the time of those this
// process ran (a resumed window's earlier steps count for the loss only).
struct LogWindow {
  double seconds = 0.0, loss = 0.0;
  int steps = 0;                                  // for the loss: every step of the window
  int timed_steps = 0;                            // for the speed: the steps `seconds` measured
  double exposed_comm_s = 0;                      // --measure-exposed-comm: the timed steps' waits on collectives
  int64_t faults_at_start = minor_page_faults();  // this process's minor page faults when the window began
  // --deterministic: this rank's micro-batch losses of the steps not yet in `loss` (settle_losses()).
  std::vector<std::vector<double>> pending_losses;
};

// Collective under --deterministic: adds the pending steps' global mean losses to window.loss, in
// step order, with one all-reduce. Every rank calls it at the same steps (before logging or saving).
void settle_losses(const TrainingLoop& loop, LogWindow& window);

// Closes a log window (collective): rank 0 logs its mean loss, speed and memory; a new window starts.
void log_window(const TrainingLoop& loop, int step, double lr, double local_loss, LogWindow& window,
                TrainingResult& result, ProgressBar& progress);

}  // namespace fsdp_gpt
