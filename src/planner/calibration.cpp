// fsdp::calibrate (include/fsdp/calibration.h): timings of a model's own forward, backward and
// optimizer step. See Note [Planner calibration] in docs/design.md.
#include "fsdp/calibration.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/check.h"
#include "fsdp/memory.h"
#include "planner/parameter_elements.h"
#include "planner/process_status.h"
#include "planner/timing_stats.h"

namespace fsdp {
namespace {

using planner::Clock;
using planner::keep_timing;
using planner::median;
using planner::seconds_since;

// The largest growth of the resident set while `run` runs, beyond what the process held when it
// began, with the allocator's free pages first returned to the system; 0 where Linux cannot restart
// the peak (/proc/self/clear_refs). See Note [Planner calibration] in docs/design.md.
int64_t peak_growth(const std::function<void()>& run) {
  malloc_trim(0);
  const int64_t before = detail::status_bytes("VmRSS");
  {
    std::ofstream reset("/proc/self/clear_refs");
    if (!(reset << "5" << std::flush)) return 0;
  }
  if (detail::status_bytes("VmHWM") > before + (int64_t(1) << 20)) return 0;  // the peak did not restart
  run();
  return std::max<int64_t>(0, detail::status_bytes("VmHWM") - before);
}

void zero_grads(torch::nn::Module& model) {
  for (auto& p : model.parameters())
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

// The model's checkpointing wrappers (fsdp::Checkpointed) and whether each is enabled.
std::vector<std::pair<CheckpointedBase*, bool>> checkpointed_modules(torch::nn::Module& model) {
  std::vector<std::pair<CheckpointedBase*, bool>> found;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (auto* c = dynamic_cast<CheckpointedBase*>(m.get())) found.emplace_back(c, c->enabled());
  return found;
}

// The caching allocator's largest allocation on `device` while `run` runs beyond what was
// allocated when it began; 0 where the allocator reports nothing (no CUDA).
int64_t device_peak_growth(c10::Device device, const std::function<void()>& run) {
  const DeviceMemoryStats before = device_memory_stats(device);
  if (!before.available) return 0;
  reset_device_peak_memory_stats(device);
  run();
  return std::max<int64_t>(0, device_memory_stats(device).allocated_peak_bytes - before.allocated_bytes);
}

// Memory of a forward and backward with the gradients already allocated, as in training: the
// resident set's growth for a model on the CPU, the caching allocator's for one on a device.
int64_t pass_peak(torch::nn::Module& model, const std::function<at::Tensor()>& loss) {
  c10::optional<c10::Device> device;
  for (const auto& p : model.parameters())
    if (!p.device().is_cpu()) device = p.device();
  loss().backward();
  if (device) return device_peak_growth(*device, [&] { loss().backward(); });
  return peak_growth([&] { loss().backward(); });
}

struct PassTimes {
  double forward_s = 0, backward_s = 0;
};

// One kind of pass a calibration times: a loss, with the model's checkpointing wrappers on or off.
struct TimedPass {
  std::function<at::Tensor()> loss;
  bool checkpointed = false;
};

// Each pass's forward-and-loss and backward seconds, median over `repetitions` (or more while the
// first pass has not filled min_timed_s: keep_timing) after one untimed round. The passes take
// turns, so a passing disturbance of the machine meets each alike (Note [Planner calibration]).
std::vector<PassTimes> time_loop(torch::nn::Module& model, const std::vector<TimedPass>& passes,
                                 const std::vector<std::pair<CheckpointedBase*, bool>>& wrappers, int repetitions,
                                 double min_timed_s) {
  std::vector<std::vector<double>> forward(passes.size()), backward(passes.size());
  double timed_s = 0;
  for (int i = 0; i == 0 || keep_timing(forward[0].size(), timed_s, repetitions, min_timed_s); ++i)
    for (size_t k = 0; k < passes.size(); ++k) {
      for (const auto& w : wrappers) w.first->set_enabled(passes[k].checkpointed);
      zero_grads(model);
      const auto start = Clock::now();
      at::Tensor value = passes[k].loss();
      FSDP_CHECK(value.numel() == 1, "fsdp::calibrate: loss() must return a scalar, got ", value.numel(), " values");
      const double f = seconds_since(start);
      const auto middle = Clock::now();
      value.backward();
      const double b = seconds_since(middle);
      if (i == 0) continue;
      forward[k].push_back(f), backward[k].push_back(b);
      if (k == 0) timed_s += f + b;
    }
  std::vector<PassTimes> times;
  for (size_t k = 0; k < passes.size(); ++k) times.push_back({median(forward[k]), median(backward[k])});
  return times;
}

// The passes' times and memory without checkpointing, both again with the model's checkpointing
// wrappers enabled where it has any, and with `smaller` the times of that loss's passes.
PrecisionTiming time_passes(torch::nn::Module& model, const std::function<at::Tensor()>& loss,
                            const std::function<at::Tensor()>& smaller, int repetitions, double min_timed_s) {
  const auto wrappers = checkpointed_modules(model);
  std::vector<TimedPass> passes{{loss, false}};
  if (smaller) passes.push_back({smaller, false});
  if (!wrappers.empty()) passes.push_back({loss, true});
  const std::vector<PassTimes> times = time_loop(model, passes, wrappers, repetitions, min_timed_s);
  PrecisionTiming t;
  t.forward_s = times[0].forward_s;
  t.backward_s = times[0].backward_s;
  if (smaller) {
    t.small_forward_s = times[1].forward_s;
    t.small_backward_s = times[1].backward_s;
  }
  for (const auto& w : wrappers) w.first->set_enabled(false);
  t.peak_bytes = pass_peak(model, loss);
  if (!wrappers.empty()) {
    t.checkpointed_forward_s = times.back().forward_s;
    t.checkpointed_backward_s = times.back().backward_s;
    for (const auto& w : wrappers) w.first->set_enabled(true);
    t.checkpointed_peak_bytes = pass_peak(model, loss);
  }
  for (const auto& w : wrappers) w.first->set_enabled(w.second);
  zero_grads(model);
  return t;
}

// The optimizer's step per parameter element, median over `repetitions` (or more: keep_timing)
// after one untimed.
double time_step(torch::nn::Module& model, const std::function<at::Tensor()>& loss, const OptimizerFactory& factory,
                 int repetitions, double min_timed_s) {
  std::vector<at::Tensor> params;
  int64_t numel = 0;
  for (auto& p : model.parameters())
    if (p.requires_grad()) params.push_back(p), numel += p.numel();
  FSDP_CHECK(numel > 0, "fsdp::calibrate: the model has no trainable parameters to time a step over");
  loss().backward();
  auto optimizer = factory(params);
  FSDP_CHECK(optimizer != nullptr, "fsdp::calibrate: the optimizer factory returned null");
  std::vector<double> steps;
  double timed_s = 0;
  for (int i = 0; i == 0 || keep_timing(steps.size(), timed_s, repetitions, min_timed_s); ++i) {
    const auto start = Clock::now();
    optimizer->step();
    const double s = seconds_since(start);
    if (i > 0) steps.push_back(s), timed_s += s;
  }
  zero_grads(model);
  return median(steps) / static_cast<double>(numel);
}

const char* precision_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "fp32";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kDouble: return "fp64";
    default: throw Error(std::string("a calibration has no name for precision ") + c10::toString(t));
  }
}

at::ScalarType precision_named(const std::string& name, const std::string& source) {
  for (const auto t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble})
    if (name == precision_name(t)) return t;
  throw Error(source + ": unknown precision \"" + name + "\"; use fp32, bf16, fp16 or fp64");
}

}  // namespace

std::string Calibration::to_json() const {
  nlohmann::json j{{"tokens", tokens},
                   {"small_tokens", small_tokens},
                   {"parameters", parameters},
                   {"step_s_per_element", step_s_per_element},
                   {"link_gbps", link_gbps},
                   {"link_latency_us", link_latency_us},
                   {"link_copy_gbps", link_copy_gbps},
                   {"link_copy_latency_us", link_copy_latency_us},
                   {"link_ranks_per_host", link_ranks_per_host},
                   {"intra_link_gbps", intra_link_gbps},
                   {"intra_link_latency_us", intra_link_latency_us},
                   {"timings", nlohmann::json::array()}};
  for (const auto& t : timings)
    j["timings"].push_back({{"precision", precision_name(t.precision)},
                            {"forward_s", t.forward_s},
                            {"backward_s", t.backward_s},
                            {"peak_bytes", t.peak_bytes},
                            {"checkpointed_peak_bytes", t.checkpointed_peak_bytes},
                            {"checkpointed_forward_s", t.checkpointed_forward_s},
                            {"checkpointed_backward_s", t.checkpointed_backward_s},
                            {"small_forward_s", t.small_forward_s},
                            {"small_backward_s", t.small_backward_s}});
  j["runtime"] = nlohmann::json::array();
  for (const auto& r : runtime)
    j["runtime"].push_back({{"wrap", r.wrap},
                            {"strategy", to_string(r.strategy)},
                            {"sharding_factor", r.sharding_factor},
                            {"precision", precision_name(r.precision)},
                            {"activation_checkpointing", r.activation_checkpointing},
                            {"micro_batch", r.micro_batch},
                            {"world", r.world},
                            {"all_gather_limit", r.all_gather_limit},
                            {"backward_prefetch", to_string(r.backward_prefetch)},
                            {"forward_prefetch", r.forward_prefetch},
                            {"reductions_in_flight", r.reductions_in_flight},
                            {"forward_s", r.forward_s},
                            {"backward_s", r.backward_s},
                            {"exposed_s", r.exposed_s},
                            {"step_s", r.step_s},
                            {"beneath_network_model", r.beneath_network_model}});
  j["quantization"] = nlohmann::json::array();
  for (const auto& q : quantization)
    j["quantization"].push_back({{"dtype", to_string(q.dtype)},
                                 {"block_size", q.block_size},
                                 {"pack_s", q.pack_s},
                                 {"pack_feedback_s", q.pack_feedback_s},
                                 {"unpack_s", q.unpack_s},
                                 {"sum_s", q.sum_s}});
  return j.dump(1);
}

Calibration Calibration::from_json(const std::string& text, const std::string& source) {
  Calibration c;
  try {
    const auto j = nlohmann::json::parse(text);
    c.tokens = j.at("tokens").get<int64_t>();
    c.small_tokens = j.value("small_tokens", int64_t(0));
    c.parameters = j.value("parameters", int64_t(0));
    c.step_s_per_element = j.value("step_s_per_element", 0.0);
    c.link_gbps = j.value("link_gbps", 0.0);
    c.link_latency_us = j.value("link_latency_us", 0.0);
    c.link_copy_gbps = j.value("link_copy_gbps", 0.0);
    c.link_copy_latency_us = j.value("link_copy_latency_us", 0.0);
    FSDP_CHECK(c.link_copy_gbps >= 0 && c.link_copy_latency_us >= 0, source,
               ": link_copy_gbps and link_copy_latency_us must not be negative");
    c.link_ranks_per_host = j.value("link_ranks_per_host", 0);
    c.intra_link_gbps = j.value("intra_link_gbps", 0.0);
    c.intra_link_latency_us = j.value("intra_link_latency_us", 0.0);
    FSDP_CHECK(c.link_ranks_per_host >= 0 && c.intra_link_gbps >= 0 && c.intra_link_latency_us >= 0, source,
               ": link_ranks_per_host, intra_link_gbps and intra_link_latency_us must not be negative");
    for (const auto& t : j.at("timings")) {
      PrecisionTiming timing;
      timing.precision = precision_named(t.at("precision").get<std::string>(), source);
      timing.forward_s = t.at("forward_s").get<double>();
      timing.backward_s = t.at("backward_s").get<double>();
      timing.peak_bytes = t.value("peak_bytes", int64_t(0));
      timing.checkpointed_peak_bytes = t.value("checkpointed_peak_bytes", int64_t(0));
      timing.checkpointed_forward_s = t.value("checkpointed_forward_s", 0.0);
      timing.checkpointed_backward_s = t.value("checkpointed_backward_s", 0.0);
      timing.small_forward_s = t.value("small_forward_s", 0.0);
      timing.small_backward_s = t.value("small_backward_s", 0.0);
      FSDP_CHECK(timing.small_forward_s >= 0 && timing.small_backward_s >= 0, source, ": the ",
                 precision_name(timing.precision),
                 " timing's small_forward_s and small_backward_s must not be negative");
      FSDP_CHECK(timing.checkpointed_forward_s >= 0 && timing.checkpointed_backward_s >= 0, source, ": the ",
                 precision_name(timing.precision),
                 " timing's checkpointed_forward_s and checkpointed_backward_s must not be negative");
      FSDP_CHECK(timing.forward_s > 0 && timing.backward_s > 0, source, ": the ", precision_name(timing.precision),
                 " timing must have positive forward_s and backward_s");
      FSDP_CHECK(timing.peak_bytes >= 0 && timing.checkpointed_peak_bytes >= 0, source, ": the ",
                 precision_name(timing.precision), " timing's peak bytes must not be negative");
      c.timings.push_back(timing);
    }
    for (const auto& r : j.value("runtime", nlohmann::json::array())) {
      RuntimeTiming timing;
      timing.wrap = r.at("wrap").get<std::string>();
      timing.strategy = parse_sharding_strategy(r.at("strategy").get<std::string>());
      timing.sharding_factor = r.value("sharding_factor", 0);
      timing.precision = precision_named(r.at("precision").get<std::string>(), source);
      timing.activation_checkpointing = r.value("activation_checkpointing", false);
      timing.micro_batch = r.at("micro_batch").get<int>();
      timing.world = r.at("world").get<int>();
      timing.all_gather_limit = r.value("all_gather_limit", timing.all_gather_limit);
      timing.backward_prefetch = parse_backward_prefetch(r.value("backward_prefetch", std::string("BACKWARD_PRE")));
      timing.forward_prefetch = r.value("forward_prefetch", timing.forward_prefetch);
      timing.reductions_in_flight = r.value("reductions_in_flight", timing.reductions_in_flight);
      timing.forward_s = r.at("forward_s").get<double>();
      timing.backward_s = r.at("backward_s").get<double>();
      timing.exposed_s = r.value("exposed_s", -1.0);
      timing.step_s = r.value("step_s", -1.0);
      timing.beneath_network_model = r.value("beneath_network_model", false);
      FSDP_CHECK(timing.micro_batch >= 1 && timing.world >= 1, source,
                 ": a runtime timing's micro_batch and world must be at least 1");
      FSDP_CHECK(timing.forward_s > 0 && timing.backward_s > 0, source, ": the ", precision_name(timing.precision),
                 " runtime timing must have positive forward_s and backward_s");
      c.runtime.push_back(timing);
    }
    for (const auto& q : j.value("quantization", nlohmann::json::array())) {
      QuantizationTiming timing;
      timing.dtype = parse_quantized_dtype(q.at("dtype").get<std::string>());
      timing.block_size = q.at("block_size").get<int64_t>();
      timing.pack_s = q.at("pack_s").get<double>();
      timing.pack_feedback_s = q.value("pack_feedback_s", timing.pack_s);
      timing.unpack_s = q.at("unpack_s").get<double>();
      timing.sum_s = q.at("sum_s").get<double>();
      FSDP_CHECK(timing.block_size >= 1, source, ": a quantization timing's block_size must be at least 1");
      FSDP_CHECK(timing.pack_s >= 0 && timing.pack_feedback_s >= 0 && timing.unpack_s >= 0 && timing.sum_s >= 0, source,
                 ": a quantization timing's seconds per value must not be negative");
      c.quantization.push_back(timing);
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": not a calibration (" + e.what() + "); fsdp::Calibration::save writes one");
  }
  FSDP_CHECK(c.tokens > 0, source, ": tokens must be positive");
  FSDP_CHECK(c.small_tokens >= 0 && c.small_tokens < c.tokens, source,
             ": small_tokens must be 0 (none) or fewer than tokens, got ", c.small_tokens);
  return c;
}

Calibration Calibration::from_file(const std::string& path) {
  std::ifstream in(path);
  FSDP_CHECK(in.good(), "cannot read the calibration file ", path);
  std::stringstream text;
  text << in.rdbuf();
  return from_json(text.str(), path);
}

void Calibration::save(const std::string& path) const {
  std::ofstream out(path);
  FSDP_CHECK(out.good(), "cannot write the calibration file ", path);
  out << to_json() << "\n";
}

const PrecisionTiming* Calibration::find(at::ScalarType precision) const {
  for (const auto& t : timings)
    if (t.precision == precision) return &t;
  return nullptr;
}

const RuntimeTiming* Calibration::find_runtime(at::ScalarType precision) const {
  for (const auto& r : runtime)
    if (r.precision == precision) return &r;
  return nullptr;
}

const QuantizationTiming* Calibration::find_quantization(QuantizedDtype dtype, int64_t block_size) const {
  const QuantizationTiming* same_dtype = nullptr;
  for (const auto& q : quantization) {
    if (q.dtype != dtype) continue;
    if (q.block_size == block_size) return &q;
    if (same_dtype == nullptr) same_dtype = &q;
  }
  return same_dtype;
}

Calibration calibrate(torch::nn::Module& model, const std::function<at::Tensor()>& loss, int64_t tokens,
                      const CalibrateOptions& options) {
  FSDP_CHECK(loss != nullptr, "fsdp::calibrate: loss is null; pass a function that runs one forward");
  FSDP_CHECK(tokens > 0, "fsdp::calibrate: tokens must be positive (the tokens in one forward), got ", tokens);
  FSDP_CHECK(options.repetitions() >= 1, "fsdp::calibrate: repetitions must be >= 1, got ", options.repetitions());
  FSDP_CHECK(options.min_timed_s() >= 0, "fsdp::calibrate: min_timed_s must be >= 0, got ", options.min_timed_s());
  FSDP_CHECK(!options.precisions().empty(), "fsdp::calibrate: no precision to time; name at least one");
  const bool smaller = options.smaller_loss() != nullptr;
  FSDP_CHECK(!smaller || (options.smaller_tokens() >= 1 && options.smaller_tokens() < tokens),
             "fsdp::calibrate: smaller_tokens must be from 1 to tokens - 1 (", tokens - 1,
             ") with a smaller_loss, got ", options.smaller_tokens());
  Calibration c;
  c.tokens = tokens;
  c.small_tokens = smaller ? options.smaller_tokens() : 0;
  c.parameters = planner::parameter_elements(model);
  if (options.optimizer()) {
    model.to(at::kFloat);
    c.step_s_per_element = time_step(model, loss, options.optimizer(), options.repetitions(), options.min_timed_s());
  }
  for (const at::ScalarType precision : options.precisions()) {
    FSDP_CHECK(at::isFloatingType(precision), "fsdp::calibrate: precision ", c10::toString(precision),
               " is not a floating type");
    model.to(precision);
    PrecisionTiming t = time_passes(model, loss, smaller ? options.smaller_loss() : nullptr, options.repetitions(),
                                    options.min_timed_s());
    t.precision = precision;
    c.timings.push_back(t);
  }
  if (!options.quantizations().empty()) {
    int64_t values = 0;
    at::Device device = at::kCPU;
    for (const auto& p : model.parameters()) {
      values += p.numel();
      device = p.device();
    }
    values = std::min<int64_t>(std::max<int64_t>(values, int64_t(1) << 16), int64_t(1) << 24);
    for (const Quantization& q : options.quantizations())
      c.quantization.push_back(calibrate_quantization(q, values, device, options.repetitions(), options.min_timed_s()));
  }
  return c;
}

void agree_across_ranks(Calibration& calibration, Communicator& comm) {
  const int n = comm.size();
  if (n < 2) return;
  auto& timings = calibration.timings;
  const auto count = static_cast<int64_t>(timings.size());
  const auto formats = static_cast<int64_t>(calibration.quantization.size());
  // The counts first (every rank sees every count, so all fail alike), then every rank's precisions
  // and peaks: the precision and the two peaks per timing.
  auto counts = torch::empty({n, 2}, torch::kLong);
  comm.all_gather_into(counts.view({-1}), torch::tensor({count, formats}, torch::kLong))->wait();
  auto names = [](int64_t k, const char* what) {
    return std::to_string(k) + " " + what + (k == 1 ? "" : "s");
  };
  for (int r = 0; r < n; ++r) {
    FSDP_CHECK(counts[r][0].item<int64_t>() == count, "fsdp::agree_across_ranks: this rank has ",
               names(count, "timing"), " but rank ", r, " has ", names(counts[r][0].item<int64_t>(), "timing"),
               "; calibrate every rank in the same precisions");
    FSDP_CHECK(counts[r][1].item<int64_t>() == formats, "fsdp::agree_across_ranks: this rank has ",
               names(formats, "quantization timing"), " but rank ", r, " has ",
               names(counts[r][1].item<int64_t>(), "quantization timing"),
               "; calibrate every rank with the same CalibrateOptions::quantizations");
  }
  auto mine = torch::empty({3 * count}, torch::kLong);
  for (int64_t i = 0; i < count; ++i) {
    mine[3 * i] = static_cast<int64_t>(timings[i].precision);
    mine[3 * i + 1] = timings[i].peak_bytes;
    mine[3 * i + 2] = timings[i].checkpointed_peak_bytes;
  }
  auto all = torch::empty({n, 3 * count}, torch::kLong);
  if (count > 0) comm.all_gather_into(all.view({-1}), mine)->wait();
  for (int64_t i = 0; i < count; ++i) {
    for (int r = 0; r < n; ++r) {
      const auto theirs = static_cast<at::ScalarType>(all[r][3 * i].item<int64_t>());
      FSDP_CHECK(theirs == timings[i].precision, "fsdp::agree_across_ranks: timing ", i, " is for ",
                 timings[i].precision, " on this rank but for ", theirs, " on rank ", r,
                 "; calibrate every rank in the same precisions, in the same order");
      timings[i].peak_bytes = std::max(timings[i].peak_bytes, all[r][3 * i + 1].item<int64_t>());
      timings[i].checkpointed_peak_bytes =
          std::max(timings[i].checkpointed_peak_bytes, all[r][3 * i + 2].item<int64_t>());
    }
  }
  // The times: one sum over ranks of every figure, then the mean.
  std::vector<double*> figures = {&calibration.step_s_per_element};
  for (auto& t : timings)
    for (double* f : {&t.forward_s, &t.backward_s, &t.checkpointed_forward_s, &t.checkpointed_backward_s,
                      &t.small_forward_s, &t.small_backward_s})
      figures.push_back(f);
  for (auto& q : calibration.quantization)
    for (double* f : {&q.pack_s, &q.pack_feedback_s, &q.unpack_s, &q.sum_s}) figures.push_back(f);
  std::vector<double> values;
  for (const double* f : figures) values.push_back(*f);
  auto sums = torch::tensor(values, torch::kDouble);
  comm.all_reduce(sums)->wait();
  const double* sum = sums.data_ptr<double>();
  for (size_t i = 0; i < figures.size(); ++i) *figures[i] = sum[i] / n;
}

}  // namespace fsdp
