// libfsdp quick start: shard a small MLP over every rank and train it on a synthetic regression
// task. Run with the launcher, e.g.  fsdp-run --nproc-per-node 2 ./fsdp_quickstart
// The planner's flags work here as in any program that passes them on (fsdp/plan_flags.h):
//   fsdp-run --nproc-per-node 2 ./fsdp_quickstart --plan                   # predictions; exit
//   fsdp-run --nproc-per-node 2 ./fsdp_quickstart --memory-budget 1GiB     # train the best that fits
//   fsdp-run --nproc-per-node 2 ./fsdp_quickstart --plan --calibrate       # from times measured here
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <iostream>

// Plain LibTorch: the model knows nothing about FSDP.
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 1));
}

int run(int argc, char** argv) {
  const auto plan_flags = fsdp::PlanFlags::parse(argc, argv);  // takes --plan, --memory-budget, ...
  if (argc > 1) {  // what parse() left is this program's, and it takes nothing else
    std::cerr << "unknown argument " << argv[1] << "; the quick start takes the planner's flags:\n"
              << fsdp::PlanFlags::help();
    return 2;
  }
  // Rank, world size and rendezvous address come from the launcher's environment.
  auto pg = fsdp::ProcessGroup::from_env();
  if (pg->size() > 1) torch::set_num_threads(1);  // ranks share the CPU cores
  const int batch = 256;                          // samples per rank per step

  // Each Linear becomes an FSDP unit: its parameters are gathered only while it runs.
  auto linear_units = fsdp::wrap::by_type<torch::nn::LinearImpl>();
  auto options = fsdp::Options().sharding_strategy(fsdp::ShardingStrategy::kFullShard).auto_wrap_policy(linear_units);
  if (plan_flags.any()) {
    // The planner reads the model built on the meta device (no memory) and traces one sample's forward.
    fsdp::DeferredInit meta_device;
    auto meta = make_model();
    auto request = fsdp::PlanRequest()
                       .batch_per_rank(batch)
                       .micro_batches({batch})  // this loop does not accumulate micro-batches
                       .activation_checkpointing({false})
                       .wrap_policies({{"linear", linear_units}, {"none", nullptr}})
                       .trace_forward([&] {
                         torch::mse_loss(meta->forward(torch::zeros({1, 16})).to(torch::kFloat), torch::zeros({1, 1}));
                       });
    // --calibrate: a real copy's forward and backward on one batch, timed in each precision the plan tries.
    auto calibrate = [&] {
      auto copy = make_model();
      auto x = torch::randn({batch, 16}), y = torch::sin(x).sum(1, /*keepdim=*/true);
      auto loss = [&] {  // the copy is cast to each precision in turn; its input follows
        return torch::mse_loss(copy->forward(x.to(copy->parameters()[0].scalar_type())).to(torch::kFloat), y);
      };
      return fsdp::calibrate(*copy, loss, batch, fsdp::CalibrateOptions().precisions(request.precisions()));
    };
    const fsdp::PlanDecision decision = fsdp::plan_from_flags(plan_flags, *pg, *meta, request, calibrate);
    if (decision.exit) return decision.exit_code;
    options = decision.chosen->candidate.options();
  }

  // Every rank seeds alike, and fully_shard broadcasts rank 0's initial weights anyway.
  torch::manual_seed(0);
  auto model = make_model();
  auto sharded = fsdp::fully_shard(model, pg, options);
  if (pg->rank() == 0) std::cout << sharded->describe();

  // The optimizer steps this rank's shards, not the module's (gathered) parameters.
  torch::optim::AdamW optimizer(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  sharded->check_optimizer(optimizer);  // throws if it held the module's own parameters

  // Target: y = sum(sin(x)). Each rank draws different data (its own seed), as data parallelism does.
  torch::manual_seed(1 + pg->rank());
  for (int step = 1; step <= 20; ++step) {
    auto x = torch::randn({batch, 16});
    auto y = torch::sin(x).sum(1, /*keepdim=*/true);

    optimizer.zero_grad();
    // Through the handle: it casts x to the parameters' dtype under mixed precision.
    auto loss = torch::mse_loss(sharded->forward(x).to(torch::kFloat), y);
    loss.backward();  // gradients are reduce-scattered onto the shards
    optimizer.step();

    if (pg->rank() == 0 && (step == 1 || step % 5 == 0))
      std::cout << "step " << step << "  loss " << loss.item<float>() << "\n";
  }

  const auto mem = sharded->memory_stats();
  if (pg->rank() == 0)
    std::cout << "rank 0 FSDP memory: params " << mem.param_bytes << " B (peak " << mem.param_peak_bytes
              << " B), grads " << mem.grad_bytes << " B (peak " << mem.grad_peak_bytes << " B)\n";
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // bad flags, a budget nothing fits, a lost peer...
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
