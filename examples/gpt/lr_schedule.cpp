#include "lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp_gpt {

namespace {

constexpr double kPi = 3.14159265358979323846;

}  // namespace

double learning_rate(int step, const TrainConfig& c) {
  if (step <= c.warmup) return c.lr * step / std::max(1, c.warmup);
  if (c.schedule == "constant" || c.steps == c.warmup) return c.lr;
  const double progress = static_cast<double>(step - c.warmup) / (c.steps - c.warmup);  // (0, 1]
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(kPi * progress));
}

}  // namespace fsdp_gpt
