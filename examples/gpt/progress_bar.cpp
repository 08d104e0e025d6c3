#include "progress_bar.h"

#include <fsdp/fsdp.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>

#include "formatting.h"

namespace fsdp_gpt {

bool stdout_is_terminal(const fsdp::RankEnv& env) {
  const char* forced = std::getenv("FSDP_RUN_STDOUT_IS_TTY");  // set by fsdp-run, which pipes our stdout
  if (forced && std::string(forced) == "1") return true;
  // Open MPI gives every rank a pseudo-terminal even when mpirun's own output goes to a file, so
  // isatty() says nothing there; print no progress bar under mpirun.
  return env.source != "mpirun" && isatty(1);
}

void ProgressBar::draw(int step, double loss, double elapsed_s) {
  if (!enabled_) return;
  const int width = 30, filled = static_cast<int>(int64_t{width} * step / total_);
  const double eta = step ? elapsed_s / step * (total_ - step) : 0.0;
  std::cout << "\r\033[K[" << std::string(filled, '#') << std::string(width - filled, '.') << "] " << step << "/"
            << total_ << "  loss " << fixed(loss, 4) << "  eta " << fixed(eta, 0) << "s" << std::flush;
  shown_ = true;
}

void ProgressBar::clear() {
  if (shown_) std::cout << "\r\033[K" << std::flush;
  shown_ = false;
}

}  // namespace fsdp_gpt
