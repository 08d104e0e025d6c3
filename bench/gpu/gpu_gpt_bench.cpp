// gpu_gpt_bench: the example GPT (examples/gpt/model.h) trained on one CUDA device, as plain
// LibTorch (--mode local) or under libfsdp (--mode fsdp), or the device's measured bf16 matrix
// product peak (--mode peak) that MFU is reported against. One JSON line of results per run
// (--result FILE appends it); bench/gpu/run.py runs the contenders interleaved, with PyTorch FSDP2
// (bench/gpu/fsdp2_gpt.py) on the same model, and writes the table.
//
//   gpu_gpt_bench --mode peak
//   gpu_gpt_bench --mode local --layers 24 --width 2048 --heads 16 --context 1024 --batch 8
//   gpu_gpt_bench --mode fsdp --strategy FULL_SHARD --layers 24 ...      (world of one, NCCL)
//
// A step is zero_grad, forward, loss, backward, optimizer step and reading the loss (which waits
// for the device). Tokens are drawn on the device from a seeded generator, the same for every
// contender; weights come from the same seed through fsdp::DeferredInit, initialized on the device.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "gpu_plan.h"
#include "model.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// bf16 n x n x n matrix products, timed after warm-up: what this device sustains on dense matmuls.
double measured_peak_tflops(const torch::Device& device, int n, int reps) {
  auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  for (int i = 0; i < 3; ++i) (void)torch::mm(a, b);
  c10::cuda::device_synchronize();
  const auto start = Clock::now();
  for (int i = 0; i < reps; ++i) (void)torch::mm(a, b);
  c10::cuda::device_synchronize();
  return 2.0 * n * n * double(n) * reps / seconds_since(start) / 1e12;
}

// This process's peak resident host memory.
int64_t host_peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return int64_t(u.ru_maxrss) * 1024;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT training step on one CUDA device: plain LibTorch or libfsdp"};
  std::string mode = "fsdp", strategy = "FULL_SHARD", dtype_name = "bf16", result, label, init_mode = "deferred";
  std::string optimizer_name = "adamw";
  int layers = 24, width = 2048, heads = 16, context = 1024, batch = 8, warmup = 3, steps = 10, seed = 1;
  int peak_n = 8192;
  double peak_tflops = 0;
  bool mixed_precision = false, offload = false, step_in_backward = false, plan = false, device_cast = false;
  app.add_option("--mode", mode, "local | fsdp | peak")->check(CLI::IsMember({"local", "fsdp", "peak"}));
  app.add_option("--strategy", strategy, "fsdp mode: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD");
  app.add_option("--dtype", dtype_name, "bf16 | f32: the model's parameters, gradients and AdamW state")
      ->check(CLI::IsMember({"bf16", "f32"}));
  app.add_option("--layers", layers);
  app.add_option("--width", width);
  app.add_option("--heads", heads);
  app.add_option("--context", context, "sequence length (and the position table's size)");
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--seed", seed);
  app.add_option("--optimizer", optimizer_name,
                 "adamw: torch::optim::AdamW; fused: fsdp::FusedAdamW (PyTorch's "
                 "fused kernel, same math)")
      ->check(CLI::IsMember({"adamw", "fused"}));
  app.add_option("--init", init_mode,
                 "deferred: built on the meta device, initialized on the GPU (unit by unit "
                 "under FSDP); eager: built and initialized on the CPU, then moved")
      ->check(CLI::IsMember({"deferred", "eager"}));
  app.add_option("--peak-n", peak_n, "peak mode: matrix size");
  app.add_option("--peak-tflops", peak_tflops, "bf16 peak that MFU is computed against (0: measure it now)");
  app.add_option("--result", result, "append the JSON result line to this file");
  app.add_option("--label", label, "contender name in the result");
  app.add_flag("--mixed-precision", mixed_precision,
               "fsdp mode: MixedPrecision(param bf16, reduce f32) over the --dtype masters (use --dtype f32)");
  app.add_flag("--offload", offload, "fsdp mode: CpuOffload: shards, gradients and the optimizer step in host memory");
  app.add_flag("--device-cast", device_cast,
               "fsdp mode, --offload with --mixed-precision: copy shards in float32 and cast on the device "
               "(CpuOffload().cast_on_host(false))");
  app.add_flag("--step-in-backward", step_in_backward,
               "fsdp mode: the optimizer steps each unit in backward (set_step_in_backward; under --offload on a "
               "host thread of its own, beside the device's backward)");
  app.add_flag("--plan", plan,
               "fsdp mode: first calibrate on the device and plan this run (bench/gpu/gpu_plan.h); the "
               "predicted step and peak reserved memory join the result");
  CLI11_PARSE(app, argc, argv);

  FSDP_CHECK(torch::cuda::is_available(), "gpu_gpt_bench needs a CUDA device (none is visible)");
  auto pg = fsdp::ProcessGroup::from_env([] {
    fsdp::ProcessGroupOptions o;
    o.device = torch::Device(torch::kCUDA, 0);
    return o;
  }());
  const torch::Device device = pg->options().device;
  c10::cuda::set_device(device.index());
  json out = {{"mode", mode},
              {"label", label.empty() ? (mode == "fsdp" ? "libfsdp " + strategy : mode) : label},
              {"device", at::cuda::getDeviceProperties(device.index())->name},
              {"world", pg->size()}};
  if (mode == "peak") {
    out["peak_tflops"] = measured_peak_tflops(device, peak_n, 20);
    out["peak_n"] = peak_n;
  } else {
    const auto dtype = dtype_name == "bf16" ? torch::kBFloat16 : torch::kFloat;
    gpt::GPTConfig cfg;
    cfg.layers = layers, cfg.width = width, cfg.heads = heads, cfg.context = context;
    auto init = [cfg](const std::string& name, torch::nn::Module& m) {
      gpt::initialize(cfg, name, m);
    };
    json planned;
    if (plan) {
      FSDP_CHECK(mode == "fsdp" && !offload && !step_in_backward && dtype_name == "f32",
                 "--plan plans fsdp mode over float32 masters (--dtype f32, with or without --mixed-precision), "
                 "without --offload or --step-in-backward");
      gpu_bench::PlannedConfiguration run;
      run.model = cfg;
      run.rows = batch / pg->size();
      run.strategy = fsdp::parse_sharding_strategy(strategy);
      run.compute = mixed_precision ? torch::kBFloat16 : torch::kFloat;
      run.fused_optimizer = optimizer_name == "fused";
      const gpu_bench::PlannedRun p = gpu_bench::plan_run(
          run, pg, gpu_bench::cluster_for(at::cuda::getDeviceProperties(device.index())->name, pg->size()));
      if (pg->rank() == 0) std::cerr << p.table;
      planned = {{"planned_step_ms", p.step_s * 1e3},
                 {"planned_peak_bytes", p.peak_bytes},
                 {"planned_allocator_headroom", p.allocator_headroom},
                 {"calibrate_s", p.calibrate_s}};
    }
    torch::manual_seed(seed);
    const auto built = Clock::now();
    gpt::GPT model{nullptr};
    if (init_mode == "deferred") {
      fsdp::DeferredInit deferred;  // nothing allocated until materialized on the device
      model = gpt::GPT(cfg);
    } else {
      model = gpt::GPT(cfg);
    }
    // The whole model in one dtype (no mixed-precision policy), for every contender alike. On meta
    // tensors this changes the dtype they materialize in.
    model->to(dtype);
    if (init_mode == "eager") model->to(device);
    std::shared_ptr<fsdp::FullyShardedModule> sharded;
    std::vector<torch::Tensor> trained;
    if (mode == "local") {
      if (init_mode == "deferred") fsdp::materialize(*model, init, device);
      // parameters() lists the tied embedding/head weight once per module registering it: keep one,
      // or the optimizer would step it twice.
      for (const auto& p : model->parameters())
        if (std::none_of(trained.begin(), trained.end(), [&](const torch::Tensor& t) { return t.is_same(p); }))
          trained.push_back(p);
    } else {
      auto options = fsdp::Options()
                         .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                         .auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>())
                         .param_init_fn(init);
      if (mixed_precision)
        options.mixed_precision(fsdp::MixedPrecision().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat));
      if (offload) options.offload(fsdp::CpuOffload().params(true).cast_on_host(!device_cast));
      sharded = fsdp::fully_shard(model, pg, options);
      for (const auto& kv : sharded->named_parameters()) trained.push_back(kv.second);
      if (pg->rank() == 0) std::cerr << sharded->describe();
    }
    const int64_t n_params = gpt::count_parameters(*model);
    const auto adamw_options = torch::optim::AdamWOptions(3e-4).betas({0.9, 0.95}).weight_decay(0.1);
    std::unique_ptr<torch::optim::Optimizer> optimizer_ptr;
    if (optimizer_name == "fused")
      optimizer_ptr = std::make_unique<fsdp::FusedAdamW>(trained, adamw_options);
    else
      optimizer_ptr = std::make_unique<torch::optim::AdamW>(trained, adamw_options);
    torch::optim::Optimizer& optimizer = *optimizer_ptr;
    FSDP_CHECK(!step_in_backward || sharded, "--step-in-backward needs --mode fsdp");
    if (step_in_backward) sharded->set_step_in_backward(&optimizer);
    c10::cuda::device_synchronize();
    const double build_s = seconds_since(built);

    // Every rank draws the global batch and takes its share (data parallelism over `batch`).
    auto gen = at::cuda::detail::createCUDAGenerator(device.index());
    gen.set_current_seed(seed + 1000);
    const int per_rank = batch / pg->size();
    FSDP_CHECK(per_rank * pg->size() == batch, "--batch ", batch, " is not a multiple of the world size ", pg->size());
    std::vector<double> step_s, losses, forward_ms, backward_ms, optimizer_ms, optimizer_wall_ms;
    for (int step = 0; step < warmup + steps; ++step) {
      if (step == warmup) fsdp::reset_device_peak_memory_stats(device);
      auto tokens = torch::randint(0, cfg.vocab_size, {batch, context + 1}, gen,
                                   torch::TensorOptions().dtype(torch::kLong).device(device))
                        .narrow(0, int64_t(pg->rank()) * per_rank, per_rank);
      c10::cuda::device_synchronize();
      const auto start = Clock::now();
      // Phase boundaries as events on the device's timeline (no synchronization inside the step).
      at::cuda::CUDAEvent e0(cudaEventDefault), e1(cudaEventDefault), e2(cudaEventDefault), e3(cudaEventDefault);
      e0.record();
      optimizer.zero_grad();
      auto logits = model->forward(tokens.narrow(1, 0, context));
      auto loss = torch::cross_entropy_loss(logits.reshape({-1, cfg.vocab_size}).to(torch::kFloat),
                                            tokens.narrow(1, 1, context).reshape({-1}));
      e1.record();
      loss.backward();
      e2.record();
      const auto optimizer_start = Clock::now();
      optimizer.step();
      const double optimizer_wall = seconds_since(optimizer_start);
      e3.record();
      const double value = loss.item<double>();
      const double secs = seconds_since(start);
      losses.push_back(value);
      if (step >= warmup) {
        step_s.push_back(secs);
        e3.synchronize();
        forward_ms.push_back(e0.elapsed_time(e1));
        backward_ms.push_back(e1.elapsed_time(e2));
        optimizer_ms.push_back(e2.elapsed_time(e3));
        optimizer_wall_ms.push_back(optimizer_wall * 1e3);
      }
    }
    const auto mem = fsdp::device_memory_stats(device);
    const double step = median(step_s);
    const double tokens_per_s = double(batch) * context / step;
    // Per token: 6 N for the matmuls with the weights (forward 2N, backward 4N) + the attention
    // scores and mixing, 12 L T d (the PaLM paper's count; the causal half is not subtracted).
    const double flops_per_token = 6.0 * double(n_params) + 12.0 * layers * double(context) * width;
    if (peak_tflops <= 0) peak_tflops = measured_peak_tflops(device, peak_n, 20);
    const double tflops = flops_per_token * tokens_per_s / 1e12;
    if (auto* fused = dynamic_cast<fsdp::FusedAdamW*>(&optimizer))
      FSDP_CHECK(fused->last_step_fused(), "--optimizer fused did not run the fused kernel");
    out.update({{"strategy", mode == "fsdp" ? strategy : ""},
                {"dtype", dtype_name},
                {"optimizer", optimizer_name},
                {"layers", layers},
                {"width", width},
                {"heads", heads},
                {"context", context},
                {"batch", batch},
                {"params", n_params},
                {"warmup", warmup},
                {"steps", steps},
                {"build_s", build_s},
                {"step_ms", step * 1e3},
                {"step_ms_all", step_s},
                {"forward_ms", median(forward_ms)},
                {"backward_ms", median(backward_ms)},
                {"optimizer_ms", median(optimizer_ms)},
                {"optimizer_wall_ms", median(optimizer_wall_ms)},
                {"mixed_precision", mixed_precision},
                {"offload", offload},
                {"cast_on_host", offload && !device_cast},
                {"step_in_backward", step_in_backward},
                {"host_peak_rss_bytes", host_peak_rss_bytes()},
                {"tokens_per_s", tokens_per_s},
                {"tflops", tflops},
                {"peak_tflops", peak_tflops},
                {"mfu", tflops / peak_tflops},
                {"losses", losses},
                {"allocated_peak_bytes", mem.allocated_peak_bytes},
                {"reserved_peak_bytes", mem.reserved_peak_bytes},
                {"num_alloc_retries", mem.num_alloc_retries}});
    if (!planned.empty()) out.update(planned);
    if (sharded) {
      const auto s = sharded->memory_stats();
      out.update({{"fsdp_param_peak_bytes", s.param_peak_bytes}, {"fsdp_grad_peak_bytes", s.grad_peak_bytes}});
    }
  }
  if (pg->rank() == 0) {
    std::cout << out.dump() << std::endl;
    if (!result.empty()) std::ofstream(result, std::ios::app) << out.dump() << "\n";
  }
  return 0;
}
