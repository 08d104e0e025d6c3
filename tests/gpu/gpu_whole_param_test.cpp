// Whole-parameter optimizers (LAMB, Adafactor, Muon, L-BFGS) on CUDA shards, on one GPU: at world > 1 the
// ranks share cuda:0 through the host-staged communicator (which has no all-to-all, so Muon
// exchanges by reduce-scatter and all-gather), with the shards on the device or offloaded to host
// memory (the step runs where they live), against the single-process references of
// tests/whole_param_reference.h stepping the same model on the device. Skipped where no CUDA device
// is visible.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "harness.h"
#include "lbfgs_side_by_side.h"
#include "models.h"
#include "whole_param_optimizers.h"

namespace fsdp_test {
namespace {

// The twin float64 models on the device, the second sharded under `strategy` by block, its shards
// offloaded to host memory if asked.
struct GpuTwins {
  TinyTransformer ref{nullptr}, model{nullptr};
  std::shared_ptr<fsdp::FullyShardedModule> sharded;
};
GpuTwins gpu_twins(const std::string& strategy, bool offload) {
  fsdp::ProcessGroupOptions pgo;
  pgo.device = kGpu;
  auto pg = fsdp::ProcessGroup::from_env(pgo);
  GpuTwins t;
  std::tie(t.ref, t.model) = twin_tiny_transformers();
  t.ref->to(kGpu);
  t.model->to(kGpu);
  auto options = block_unit_options(strategy);
  if (offload) options.offload(fsdp::CpuOffload().params(true));
  t.sharded = fsdp::fully_shard(t.model, pg, options);
  return t;
}

// args: optimizer, strategy, "1" to offload the shards. Four steps of float64 training, clipping
// before the last, against the reference on the same global batch.
FSDP_WORKER(gpu_whole_param_worker) {
  const std::string kind = ctx.args.at(0), strategy = ctx.args.at(1);
  const bool offload = ctx.args.at(2) == "1";
  auto [ref, model, sharded] = gpu_twins(strategy, offload);
  const torch::Device home = offload ? torch::Device(torch::kCPU) : kGpu;
  for (const auto& p : sharded->parameters())
    WORKER_CHECK(p.device() == home, "a piece is on ", p.device(), ", expected ", home);
  auto [opt, ref_step] = optimizers(kind, *sharded);
  std::vector<at::Tensor> ref_params;
  for (const auto& p : unique_parameters(*ref))
    if (p.requires_grad()) ref_params.push_back(p);
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = token_batch(ctx.world, step).to(kGpu);
    for (const auto& p : ref_params) p.mutable_grad().reset();
    loss_of(ref, x).backward();
    if (step == 3) torch::nn::utils::clip_grad_norm_(ref_params, 0.05);
    ref_step(ref_params);
    opt->zero_grad();
    loss_of(model, x.narrow(0, ctx.rank * 2, 2)).backward();
    if (step == 3) sharded->clip_grad_norm_(0.05);
    opt->step();
  }
  const std::string what =
      kind + " " + strategy + " world " + std::to_string(ctx.world) + " offload " + std::to_string(int(offload));
  auto full = sharded->full_state_dict();
  for (const auto& kv : ref->named_parameters()) {
    const auto it = full.find(kv.key());
    WORKER_CHECK(it != full.end(), what, ": ", kv.key(), " is missing from full_state_dict");
    const at::Tensor a = it->second.detach().cpu(), b = kv.value().detach().cpu();
    const double d = (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
    WORKER_CHECK(d <= 1e-12, what, ": ", kv.key(), " differs by ", d);
  }
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

void run_all(const std::vector<std::vector<std::string>>& runs) {
  for (const auto& run : runs) {
    const int world = std::stoi(run.at(3));
    // World 1: a group of one; larger worlds share the device through host staging.
    const std::vector<std::string> env =
        world > 1 ? std::vector<std::string>{"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=30"} : std::vector<std::string>{};
    auto r = launch("gpu_whole_param_worker", world, {run.at(0), run.at(1), run.at(2)}, 120, env);
    EXPECT_TRUE(r.all_ok()) << run.at(0) << " " << run.at(1) << " offload " << run.at(2) << " world " << world << "\n"
                            << r.report();
    std::istringstream lines(r.ranks[0].output);
    for (std::string line; std::getline(lines, line);)
      if (line.size() > 3 && line.compare(line.size() - 3, 3, " ok") == 0) std::cout << line << std::endl;
  }
}

// Each optimizer at worlds 1-3 and hybrid groups at 4, on the device and offloaded.
TEST(GpuWholeParamOptim, LambAdafactorMuonEqualSingleProcessOnTheDeviceAndOffloaded) {
  REQUIRE_GPU();
  std::vector<std::vector<std::string>> runs;
  for (const char* kind : {"lamb", "adafactor", "muon"})
    for (const char* offload : {"0", "1"}) {
      runs.push_back({kind, "FULL_SHARD", offload, "1"});
      runs.push_back({kind, "FULL_SHARD", offload, "3"});
      runs.push_back({kind, "SHARD_GRAD_OP", offload, "2"});
      runs.push_back({kind, "NO_SHARD", offload, "2"});
      runs.push_back({kind, "HYBRID_SHARD", offload, "4"});
    }
  run_all(runs);
}

// args: strategy, "1" to offload the shards, "1" for the strong Wolfe line search. Three steps of
// fsdp::LBFGS against torch::optim::LBFGS on the unsharded model and global batch, on the device.
FSDP_WORKER(gpu_lbfgs_worker) {
  const std::string strategy = ctx.args.at(0);
  const bool offload = ctx.args.at(1) == "1", line_search = ctx.args.at(2) == "1";
  auto [ref, model, sharded] = gpu_twins(strategy, offload);
  fsdp::LBFGS opt(*sharded, lbfgs_options(line_search));
  torch::optim::LBFGS ref_opt(unique_parameters(*ref), lbfgs_options(line_search));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = token_batch(ctx.world, step).to(kGpu);
    lbfgs_step_side_by_side(
        ref_opt, [&, &ref = ref] { return loss_of(ref, x); }, opt,
        [&, &model = model] { return loss_of(model, x.narrow(0, ctx.rank * 2, 2)); });
  }
  const std::string what = "lbfgs " + strategy + (line_search ? " strong_wolfe" : " fixed step") + " world " +
                           std::to_string(ctx.world) + " offload " + std::to_string(int(offload));
  expect_same_lbfgs_counts(opt, ref_opt, what);
  expect_same_parameters(*ref, *sharded, 1e-10, what);
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

TEST(GpuWholeParamOptim, LbfgsEqualsTorchLbfgsOnTheDeviceAndOffloaded) {
  REQUIRE_GPU();
  for (const auto& [strategy, world] : std::vector<std::pair<std::string, int>>{
           {"FULL_SHARD", 1}, {"FULL_SHARD", 3}, {"NO_SHARD", 2}, {"HYBRID_SHARD", 4}})
    for (const char* offload : {"0", "1"})
      for (const char* line_search : {"0", "1"}) {
        const std::vector<std::string> env = world > 1
                                                 ? std::vector<std::string>{"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=30"}
                                                 : std::vector<std::string>{};
        auto r = launch("gpu_lbfgs_worker", world, {strategy, offload, line_search}, 120, env);
        EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << " offload " << offload << " line search "
                                << line_search << "\n"
                                << r.report();
      }
}

}  // namespace
}  // namespace fsdp_test
