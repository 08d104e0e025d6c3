// A Plan's table, its best entry and the message when nothing fits (include/fsdp/planner.h).
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fsdp/check.h"
#include "fsdp/options.h"
#include "fsdp/planner.h"

namespace fsdp {
namespace {

// The table's unit: KiB for peaks under 1 MiB, GiB from 1 TiB on, MiB between.
struct TableUnit {
  const char* name;
  double bytes;
  std::string operator()(int64_t b) const {
    std::ostringstream o;
    o << std::fixed << std::setprecision(1) << static_cast<double>(b) / bytes;
    return o.str();
  }
};

TableUnit table_unit(int64_t largest) {
  constexpr double kKiB = 1024.0;
  if (largest < kKiB * kKiB) return {"KiB", kKiB};
  if (largest >= kKiB * kKiB * kKiB * kKiB) return {"GiB", kKiB * kKiB * kKiB};
  return {"MiB", kKiB * kKiB};
}

std::string fixed_digits(double v, int digits) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(digits) << v;
  return o.str();
}

}  // namespace

int64_t Plan::smallest_peak() const {
  int64_t smallest = 0;
  for (const PlanEntry& e : entries)
    if (smallest == 0 || e.memory.peak < smallest) smallest = e.memory.peak;
  return static_cast<int64_t>(std::ceil(static_cast<double>(smallest) * (1.0 + memory_margin)));
}

const PlanEntry& Plan::best() const {
  FSDP_CHECK(!entries.empty(), "the plan has no candidates (an empty search space)");
  if (entries.front().fits) return entries.front();
  const PlanEntry* smallest = &entries.front();
  for (const PlanEntry& e : entries)
    if (e.memory.peak < smallest->memory.peak) smallest = &e;
  // Ranks shard the model's state, not what the process holds outside tensors.
  const bool process_bound = static_cast<double>(smallest->memory.process) * (1.0 + memory_margin) >= budget;
  FSDP_FAIL("no configuration fits in ", format_bytes(budget), " per rank on ", cluster, "; the smallest needs ",
            format_bytes(smallest_peak()), " (", smallest->candidate.describe(), "): raise the budget to at least that",
            process_bound ? "; the process alone holds " + format_bytes(smallest->memory.process) +
                                " outside tensors (PlanRequest::process_bytes), which more ranks do not divide"
                          : ", or add ranks");
}

std::string Plan::table(size_t max_rows) const {
  std::ostringstream o;
  o << "Plan for " << cluster << "; budget " << format_bytes(budget) << " per rank";
  if (memory_margin > 0) o << " (fits: the peak plus a " << fixed_digits(100.0 * memory_margin, 0) << "% margin)";
  o << "\n";
  const size_t rows = max_rows > 0 ? std::min(max_rows, entries.size()) : entries.size();
  int64_t largest = 0;
  for (size_t i = 0; i < rows; ++i) largest = std::max(largest, entries[i].memory.peak);
  const TableUnit mebibytes = table_unit(largest);
  const std::string u = std::string(" ") + mebibytes.name + " | ";
  o << "| # | configuration | params" << u << "grads" << u << "optimizer" << u << "activations" << u << "workspace" << u
    << "other" << u << "peak" << u << "fits | step ms | compute ms | exposed comm % | TFLOP/s | MFU % |\n";
  o << "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n";
  for (size_t i = 0; i < rows; ++i) {
    const PlanEntry& e = entries[i];
    const double exposed = e.time.step_s > 0 ? 100.0 * e.time.exposed_comm_s / e.time.step_s : 0;
    o << "| " << i + 1 << " | " << e.candidate.describe() << " | " << mebibytes(e.memory.params) << " | "
      << mebibytes(e.memory.grads) << " | " << mebibytes(e.memory.optimizer) << " | " << mebibytes(e.memory.activations)
      << " | " << mebibytes(e.memory.workspace) << " | "
      << mebibytes(e.memory.feedback + e.memory.ignored + e.memory.headroom + e.memory.process) << " | "
      << mebibytes(e.memory.peak) << " | " << (e.fits ? "yes" : "no") << " | " << fixed_digits(e.time.step_s * 1e3, 2)
      << " | " << fixed_digits(e.time.compute_s * 1e3, 2) << " | " << fixed_digits(exposed, 1) << " | "
      << fixed_digits(e.time.tflops_per_device, 3) << " | " << fixed_digits(e.time.mfu * 100, 1) << " |\n";
  }
  if (rows < entries.size()) o << "(" << entries.size() - rows << " more)\n";
  for (const std::string& note : notes) o << "note: " << note << "\n";
  return o.str();
}

std::string Plan::json_lines(const std::vector<std::string>& not_modeled) const {
  std::ostringstream o;
  for (const PlanEntry& e : entries) {
    const Candidate& c = e.candidate;
    o << nlohmann::json{{"configuration", c.describe()},
                        {"strategy", to_string(c.strategy)},
                        {"sharding_factor", c.sharding_factor},
                        {"reshard_after_forward_size", c.reshard_after_forward_size},
                        {"wrap", c.wrap.name},
                        {"activation_checkpointing", c.activation_checkpointing},
                        {"checkpointed_units", c.checkpointed_units},
                        {"cpu_offload", c.cpu_offload},
                        {"precision", c.precision == at::kFloat      ? "fp32"
                                      : c.precision == at::kBFloat16 ? "bf16"
                                                                     : "fp16"},
                        {"micro_batch", c.micro_batch},
                        {"accumulation", c.accumulation},
                        {"no_sync", c.no_sync},
                        {"keep_unsharded", c.keep_unsharded},
                        {"replica_deferred", c.replica_deferred},
                        {"step_in_backward", c.step_in_backward},
                        {"params_bytes", e.memory.params},
                        {"grads_bytes", e.memory.grads},
                        {"optimizer_bytes", e.memory.optimizer},
                        {"activations_bytes", e.memory.activations},
                        {"workspace_bytes", e.memory.workspace},
                        {"feedback_bytes", e.memory.feedback},
                        {"ignored_bytes", e.memory.ignored},
                        {"process_bytes", e.memory.process},
                        {"peak_bytes", e.memory.peak},
                        {"memory_margin", memory_margin},
                        {"host_bytes", e.memory.host},
                        {"step_s", e.time.step_s},
                        {"compute_s", e.time.compute_s},
                        {"exposed_comm_s", e.time.exposed_comm_s},
                        {"tflops_per_device", e.time.tflops_per_device},
                        {"mfu", e.time.mfu},
                        {"fits", e.fits},
                        {"not_modeled", not_modeled}}
             .dump()
      << "\n";
  }
  return o.str();
}

}  // namespace fsdp
