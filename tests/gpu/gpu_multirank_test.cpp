// The CUDA path at world > 1 on one GPU, and mixed precision and CPU offload on the device. NCCL
// refuses two ranks on one device, so the ranks (processes sharing cuda:0) use the host-staged
// communicator (FSDP_TRANSPORT=shm; Note [Host-staged collectives]): every FSDP runtime path for
// CUDA tensors at world > 1 (sharded optimizer, reduce-scatter outputs, prefetch, rate limiter,
// reductions in flight, hybrid chaining, mixed precision, offload) runs against plain LibTorch
// training on the same device. NCCL itself with more than one rank is not exercised here.
// Skipped where no CUDA device is visible.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "harness.h"
#include "mixed_precision_reference.h"
#include "models.h"

namespace fsdp_test {
namespace {

fsdp::ProcessGroupPtr group_on_gpu() {
  fsdp::ProcessGroupOptions o;
  o.device = kGpu;
  return fsdp::ProcessGroup::from_env(o);
}

// Ranks share cuda:0 and stage collectives through host shared memory.
const std::vector<std::string> kStaged = {"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=30"};

// Each collective on CUDA tensors gives its definition's values, with inputs written by work still
// queued on the caller's stream at issue (no synchronization), on two streams, and chained across
// communicators with CollectiveOptions::after.
FSDP_WORKER(gpu_staged_collectives_worker) {
  auto pg = group_on_gpu();
  auto comm = pg->world();
  WORKER_CHECK(comm->transport().rfind("host-staged", 0) == 0, "transport is ", comm->transport());
  WORKER_CHECK(comm->device() == kGpu, "device ", comm->device());
  const int W = ctx.world, r = ctx.rank;
  const double tri = W * (W + 1) / 2.0;  // sum over ranks of (rank + 1)
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(kGpu));
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    const auto opts = torch::TensorOptions().dtype(dtype).device(kGpu);
    const int64_t n = 1000;
    // The input is computed from a long product still running when the collective is issued.
    auto busy = torch::mm(a, a).sum().mul(0).to(dtype);
    auto in = (torch::full({n}, r + 1.0, opts) + busy).contiguous();
    auto out = torch::empty({W * n}, opts);
    comm->all_gather_into(out, in)->wait();
    for (int p = 0; p < W; ++p)
      WORKER_CHECK(out.narrow(0, p * n, n).eq(p + 1.0).all().item<bool>(), dtype, " all-gather part ", p);
    auto rs_in = (torch::full({W * n}, r + 1.0, opts) + busy).contiguous();
    auto rs_out = torch::empty({n}, opts);
    comm->reduce_scatter(rs_out, rs_in)->wait();
    WORKER_CHECK(rs_out.eq(tri).all().item<bool>(), dtype, " reduce-scatter");
    auto t = torch::full({n}, r + 1.0, opts) + busy;
    comm->all_reduce(t)->wait();
    WORKER_CHECK(t.eq(tri).all().item<bool>(), dtype, " all-reduce");
    auto b = torch::full({n}, double(r), opts) + busy;
    comm->broadcast(b, W - 1)->wait();
    WORKER_CHECK(b.eq(W - 1.0).all().item<bool>(), dtype, " broadcast");
  }
  // On a side stream, and a reduce-scatter chained into an all-reduce of another communicator.
  auto other = pg->new_group(
      [&] {
        std::vector<int> all(W);
        for (int i = 0; i < W; ++i) all[i] = i;
        return all;
      }(),
      "chained");
  auto side = c10::cuda::getStreamFromPool(false, 0);
  c10::cuda::CUDAStreamGuard guard(side);
  const auto opts = torch::TensorOptions().device(kGpu);
  auto rs_in = torch::full({W * 64}, r + 1.0, opts) + torch::mm(a, a).sum().mul(0);
  auto rs_out = torch::empty({64}, opts);
  auto scatter = comm->reduce_scatter(rs_out, rs_in);
  fsdp::CollectiveOptions after;
  after.after = scatter;
  auto reduced = other->all_reduce(rs_out, after);
  reduced->wait();
  scatter->wait();
  WORKER_CHECK(rs_out.eq(tri * W).all().item<bool>(), "chained all-reduce gave ", rs_out[0].item<double>());
  comm->barrier();
  if (r == 0) std::cout << "staged collectives ok at world " << W << std::endl;
}

TEST(GpuMultiRank, HostStagedCollectivesAreExact) {
  REQUIRE_GPU();
  for (int world : {2, 3}) {
    auto r = launch("gpu_staged_collectives_worker", world, {}, 300, kStaged);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
}

// args: strategy, mixed precision (none | bf16), offload (0 | 1), optimizer (adamw | fused), and
// optionally where it steps: after (backward, the default), backward (set_step_in_backward on
// backward's thread), auto (set_step_in_backward's default: its own thread under offload).
// Three AdamW steps of the tiny transformer on cuda:0, the last with gradient clipping: each
// rank's loss and then every parameter equal to plain LibTorch training on the same device (the
// same casts at the same points under mixed precision: mixed_precision_reference.h). Without
// mixed precision in float64; with it, float32 masters and bfloat16 compute, reduced in float32.
FSDP_WORKER(gpu_train_worker) {
  auto pg = group_on_gpu();
  const std::string strategy = ctx.args.at(0);
  const bool mixed = ctx.args.at(1) == "bf16", offload = ctx.args.at(2) == "1", fused = ctx.args.at(3) == "fused";
  const std::string stepping = ctx.args.size() > 4 ? ctx.args.at(4) : "after";
  const bool in_backward = stepping != "after";  // clipping is refused then: none in either run
  const auto master = mixed ? at::kFloat : at::kDouble;
  MixedPrecisionTriplet models;
  TinyTransformer ref = models.master, model = models.model;
  for (auto* m : {&models.master, &models.compute, &models.model}) (*m)->to(kGpu, master);
  LocalMixedPrecision<TinyTransformer> local(ref, models.compute, mixed ? at::kBFloat16 : master, master);
  auto o = fsdp::Options()
               .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
               .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>());
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  if (mixed) o.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  if (offload) o.offload(fsdp::CpuOffload().params(true));
  if (in_backward) o.trace(true);
  auto sharded = fsdp::fully_shard(model, pg, o);
  for (const auto& p : model->parameters())
    WORKER_CHECK(p.device() == kGpu && p.scalar_type() == (mixed ? at::kBFloat16 : master), "a parameter is ",
                 p.scalar_type(), " on ", p.device());
  for (const auto& p : sharded->parameters()) {
    WORKER_CHECK(p.device() == (offload ? torch::Device(torch::kCPU) : kGpu) && p.scalar_type() == master,
                 "a piece is ", p.scalar_type(), " on ", p.device());
    WORKER_CHECK(!offload || p.is_pinned(), "an offloaded piece is not in page-locked memory");
  }
  const auto adamw = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
  // The reference steps with the kernel the shards step with: on the device FusedAdamW is PyTorch's
  // fused kernel, whose float32 rounding differs from AdamW's (bf16 compute magnifies it); on
  // offloaded shards it is libfsdp's CPU kernel, which rounds as AdamW does.
  std::unique_ptr<torch::optim::Optimizer> ref_opt;
  if (fused && !offload)
    ref_opt = std::make_unique<fsdp::FusedAdamW>(local.parameters(), adamw);
  else
    ref_opt = std::make_unique<torch::optim::AdamW>(local.parameters(), adamw);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (fused)
    opt = std::make_unique<fsdp::FusedAdamW>(sharded->parameters(), adamw);
  else
    opt = std::make_unique<torch::optim::AdamW>(sharded->parameters(), adamw);
  if (in_backward)
    sharded->set_step_in_backward(opt.get(),
                                  stepping == "backward" ? fsdp::StepThread::kBackward : fsdp::StepThread::kAuto);
  const double tol = mixed ? 1e-5 : 1e-9;
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(50 + step)).to(kGpu);
    ref_opt->zero_grad();
    const auto losses = local.backward(x, ctx.world, rows, 1.0, cast_lm_loss);
    if (step == 2 && !in_backward) torch::nn::utils::clip_grad_norm_(local.parameters(), 0.05);
    ref_opt->step();
    opt->zero_grad();
    at::Tensor loss = cast_lm_loss(model, x.narrow(0, ctx.rank * rows, rows));
    loss.backward();
    for (const auto& p : sharded->parameters())
      WORKER_CHECK(!p.grad().defined() || (p.grad().device() == p.device() && p.grad().scalar_type() == master),
                   "a piece's gradient is ", p.grad().scalar_type(), " on ", p.grad().device());
    if (in_backward) {
      for (const auto& p : sharded->parameters())
        WORKER_CHECK(!p.grad().defined(), "a piece still has a gradient after the step in backward");
      bool on_own_thread = false;
      for (const auto& e : sharded->last_trace().events)
        on_own_thread = on_own_thread || (e.kind == fsdp::TraceEvent::Kind::kStep && e.track == "optimizer thread");
      WORKER_CHECK(on_own_thread == (offload && stepping == "auto"), "the steps ran on the ",
                   on_own_thread ? "optimizer" : "compute", " thread");
    }
    // With the step in backward, the last step that ran was backward's (the one below finds no
    // gradient); check it before.
    if (fused && in_backward)
      WORKER_CHECK(static_cast<fsdp::FusedAdamW&>(*opt).last_step_fused(), "FusedAdamW fell back in backward");
    if (step == 2 && !in_backward) sharded->clip_grad_norm_(0.05);
    opt->step();
    if (fused && !in_backward)
      WORKER_CHECK(static_cast<fsdp::FusedAdamW&>(*opt).last_step_fused(), "FusedAdamW fell back");
    const double mine = loss.item<double>(), theirs = losses.at(ctx.rank);
    WORKER_CHECK(std::abs(mine - theirs) <= tol * std::abs(theirs), "step ", step, " loss ", mine, " vs local ",
                 theirs);
  }
  if (offload) {
    // After backward every unit is resharded: no parameter memory left on the device.
    const auto mem = sharded->memory_stats();
    WORKER_CHECK(mem.param_bytes == 0, "device parameter bytes after backward: ", mem.param_bytes);
  }
  expect_same_parameters(*ref, *sharded, tol, strategy + " " + ctx.args.at(1) + " offload " + ctx.args.at(2));
  if (ctx.rank == 0)
    std::cout << strategy << " world " << ctx.world << " " << ctx.args.at(1) << " offload " << offload << " "
              << ctx.args.at(3) << " step " << stepping << " ok" << std::endl;
}

struct Run {
  const char* strategy;
  int world;
  const char* mixed;
  const char* offload;
  const char* optimizer;
  const char* stepping = "after";
};

void run_all(const std::vector<Run>& runs) {
  for (const auto& run : runs) {
    // World 1: NCCL (a group of one); larger worlds share the device through host staging.
    auto r = launch("gpu_train_worker", run.world, {run.strategy, run.mixed, run.offload, run.optimizer, run.stepping},
                    120, run.world > 1 ? kStaged : std::vector<std::string>{});
    EXPECT_TRUE(r.all_ok()) << run.strategy << " world " << run.world << " " << run.mixed << " offload " << run.offload
                            << " " << run.optimizer << "\n"
                            << r.report();
    std::istringstream lines(r.ranks[0].output);
    for (std::string line; std::getline(lines, line);)
      if (line.size() > 3 && line.compare(line.size() - 3, 3, " ok") == 0) std::cout << line << std::endl;
  }
}

// Every strategy, worlds that force padding (3) and hybrid groups (4), on one device.
TEST(GpuMultiRank, StrategiesMatchLocalTraining) {
  REQUIRE_GPU();
  run_all({{"FULL_SHARD", 2, "none", "0", "adamw"},
           {"SHARD_GRAD_OP", 2, "none", "0", "adamw"},
           {"NO_SHARD", 2, "none", "0", "adamw"},
           {"FULL_SHARD", 3, "none", "0", "adamw"},
           {"HYBRID_SHARD", 4, "none", "0", "adamw"}});
}

// fp32 masters, bf16 gathers and compute, fp32 reduction, on the device.
TEST(GpuMixedPrecision, Bf16ComputeFp32ReduceMatchesLocalReference) {
  REQUIRE_GPU();
  run_all({{"FULL_SHARD", 1, "bf16", "0", "adamw"},
           {"FULL_SHARD", 1, "bf16", "0", "fused"},
           {"FULL_SHARD", 2, "bf16", "0", "adamw"},
           {"FULL_SHARD", 2, "bf16", "0", "fused"},
           {"SHARD_GRAD_OP", 3, "bf16", "0", "adamw"},
           {"NO_SHARD", 2, "bf16", "0", "adamw"},
           {"HYBRID_SHARD", 4, "bf16", "0", "adamw"}});
}

// Shards, gradients and the optimizer step in page-locked host memory; FusedAdamW's CPU kernel on
// the offloaded shards.
TEST(GpuOffload, MatchesLocalTraining) {
  REQUIRE_GPU();
  run_all({{"FULL_SHARD", 1, "none", "1", "adamw"},
           {"FULL_SHARD", 1, "bf16", "1", "fused"},
           {"FULL_SHARD", 2, "none", "1", "adamw"},
           {"FULL_SHARD", 3, "bf16", "1", "adamw"},
           {"SHARD_GRAD_OP", 2, "bf16", "1", "fused"},
           {"NO_SHARD", 2, "none", "1", "adamw"},
           {"HYBRID_SHARD", 4, "bf16", "1", "adamw"}});
}

// The optimizer step in backward on the device (backward's thread) and under offload (its own
// host thread, landing each unit's gradients as their copies arrive), against plain LibTorch.
TEST(GpuStepInBackward, MatchesLocalTraining) {
  REQUIRE_GPU();
  run_all({{"FULL_SHARD", 1, "bf16", "0", "fused", "auto"},
           {"FULL_SHARD", 1, "none", "0", "fused", "backward"},
           {"FULL_SHARD", 1, "bf16", "0", "adamw", "backward"},
           {"FULL_SHARD", 1, "none", "0", "adamw", "backward"},
           {"FULL_SHARD", 2, "bf16", "0", "fused", "backward"},
           {"FULL_SHARD", 2, "none", "0", "adamw", "backward"},
           {"FULL_SHARD", 1, "bf16", "1", "fused", "auto"},
           {"FULL_SHARD", 2, "none", "1", "adamw", "auto"},
           {"FULL_SHARD", 3, "bf16", "1", "fused", "backward"},
           {"SHARD_GRAD_OP", 2, "bf16", "1", "adamw", "auto"},
           {"HYBRID_SHARD", 4, "bf16", "1", "adamw", "auto"}});
}

}  // namespace
}  // namespace fsdp_test
