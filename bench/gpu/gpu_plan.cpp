#include "gpu_plan.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "model_cost.h"

namespace gpu_bench {

namespace {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<at::Tensor>& params, bool fused) {
  const auto options = torch::optim::AdamWOptions(3e-4).betas({0.9, 0.95}).weight_decay(0.1);
  if (fused) return std::make_unique<fsdp::FusedAdamW>(params, options);
  return std::make_unique<torch::optim::AdamW>(params, options);
}

// Next-token loss of `model` on `tokens` (rows x context + 1), as the bench's step computes it.
at::Tensor next_token_loss(gpt::GPT& model, const at::Tensor& tokens, const gpt::GPTConfig& config) {
  const int64_t context = tokens.size(1) - 1;
  auto logits = model->forward(tokens.narrow(1, 0, context));
  return torch::cross_entropy_loss(logits.reshape({-1, config.vocab_size}).to(at::kFloat),
                                   tokens.narrow(1, 1, context).reshape({-1}));
}

fsdp::ParamInitFn initializer(const gpt::GPTConfig& config) {
  return [config](const std::string& name, torch::nn::Module& m) {
    gpt::initialize(config, name, m);
  };
}

fsdp::Options sharded_options(const PlannedConfiguration& run) {
  auto options = fsdp::Options()
                     .sharding_strategy(run.strategy)
                     .auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>())
                     .param_init_fn(initializer(run.model));
  if (run.compute != at::kFloat)
    options.mixed_precision(fsdp::MixedPrecision().param_dtype(run.compute).reduce_dtype(at::kFloat));
  return options;
}

}  // namespace

fsdp::Cluster cluster_for(const std::string& device_name, int world) {
  const std::string preset = device_name.find("H200") != std::string::npos   ? "h200"
                             : device_name.find("H100") != std::string::npos ? "h100"
                             : device_name.find("40GB") != std::string::npos ? "a100-40g"
                                                                             : "a100-80g";
  return fsdp::Cluster::preset(preset, 1, world);
}

PlannedRun plan_run(const PlannedConfiguration& run, const fsdp::ProcessGroupPtr& pg, const fsdp::Cluster& cluster) {
  const c10::Device device = pg->world()->device();
  const auto started = std::chrono::steady_clock::now();
  auto tokens = torch::randint(0, run.model.vocab_size, {run.rows, run.model.context + 1},
                               at::TensorOptions().dtype(at::kLong).device(device));
  PlannedRun out;
  fsdp::Calibration calibration;
  {
    // The plain copy: the passes in the compute dtype, their memory, the optimizer's step.
    torch::manual_seed(1);
    gpt::GPT copy{nullptr};
    {
      fsdp::DeferredInit deferred;  // initialized on the device, not built on the host and copied
      copy = gpt::GPT(run.model);
    }
    fsdp::materialize(*copy, initializer(run.model), device);
    const auto options = fsdp::CalibrateOptions()
                             .precisions({run.compute})
                             .repetitions(3)
                             .optimizer([&](const std::vector<at::Tensor>& params) {
                               return make_optimizer(params, run.fused_optimizer);
                             });
    calibration = fsdp::calibrate(
        *copy, [&] { return next_token_loss(copy, tokens, run.model); }, run.rows * run.model.context, options);
    // What the caching allocator holds beyond the live tensors over forward and backward alone, in
    // the compute dtype: the optimizer's timing and the cast before the passes leave blocks cached
    // that the run never has.
    fsdp::release_cached_device_memory(device);
    fsdp::reset_device_peak_memory_stats(device);
    for (int pass = 0; pass < 2; ++pass) next_token_loss(copy, tokens, run.model).backward();
    const fsdp::DeviceMemoryStats stats = fsdp::device_memory_stats(device);
    if (stats.available && stats.allocated_peak_bytes > 0)
      out.allocator_headroom =
          std::max(0.0, double(stats.reserved_peak_bytes) / double(stats.allocated_peak_bytes) - 1.0);
  }
  fsdp::release_cached_device_memory(device);
  {
    // The same through the FSDP runtime, as the run shards it.
    torch::manual_seed(1);
    gpt::GPT copy{nullptr};
    {
      fsdp::DeferredInit deferred;
      copy = gpt::GPT(run.model);
    }
    const fsdp::Options options = sharded_options(run);
    auto sharded = fsdp::fully_shard(copy, pg, options);
    std::vector<at::Tensor> pieces;
    for (const auto& kv : sharded->named_parameters()) pieces.push_back(kv.second);
    auto optimizer = make_optimizer(pieces, run.fused_optimizer);
    fsdp::RuntimeTiming timed;
    timed.wrap = "block";
    timed.strategy = run.strategy;
    timed.precision = run.compute;
    timed.micro_batch = static_cast<int>(run.rows);
    timed.all_gather_limit = options.all_gather_limit();
    timed.backward_prefetch = options.backward_prefetch();
    timed.forward_prefetch = options.forward_prefetch();
    timed.reductions_in_flight = options.reductions_in_flight();
    fsdp::calibrate_runtime(
        calibration, *sharded, *pg, [&] { return next_token_loss(copy, tokens, run.model); }, timed, 3,
        [&] { optimizer->step(); });
  }
  tokens = at::Tensor();
  fsdp::release_cached_device_memory(device);
  fsdp::reset_device_peak_memory_stats(device);
  out.calibrate_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  gpt::GPT meta{nullptr};
  {
    fsdp::DeferredInit deferred;  // shapes only
    meta = gpt::GPT(run.model);
  }
  const auto request = fsdp::PlanRequest()
                           .world(pg->size())
                           .global_batch(static_cast<int>(run.rows) * pg->size())
                           .seq_len(run.model.context)
                           .module_cost(gpt::module_cost)
                           .calibration(calibration)
                           .allocator_headroom(out.allocator_headroom)
                           .wrap_policies({{"block", fsdp::wrap::by_type<gpt::BlockImpl>()}})
                           .strategies({run.strategy})
                           .activation_checkpointing({false})
                           .cpu_offload({false})
                           .precisions({run.compute})
                           .micro_batches({static_cast<int>(run.rows)});
  const fsdp::Plan plan = fsdp::plan(*meta, cluster, request);
  FSDP_CHECK(!plan.entries.empty(), "the planner found no candidate for the run's configuration");
  const fsdp::PlanEntry& entry = plan.entries.front();
  out.step_s = entry.time.step_s;
  out.peak_bytes = entry.memory.peak;
  out.table = plan.table();
  return out;
}

}  // namespace gpu_bench
