#pragma once
// Rank 0's progress bar on a terminal.
#include <fsdp/fsdp.h>

namespace fsdp_gpt {

// Whether stdout reaches a terminal, also through fsdp-run's pipes; never under mpirun.
bool stdout_is_terminal(const fsdp::RankEnv& env);

// A one-line progress bar redrawn in place; log lines clear it first so they are not interleaved.
class ProgressBar {
 public:
  ProgressBar(bool enabled, int total) : enabled_(enabled), total_(total) {}
  // Redraws the bar at `step` of the total, with the loss and the time left.
  void draw(int step, double loss, double elapsed_s);
  // Erases the bar, if shown.
  void clear();

 private:
  bool enabled_;
  int total_;
  bool shown_ = false;
};

}  // namespace fsdp_gpt
