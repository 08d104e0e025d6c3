// libfsdp quick start: shard a small MLP over every rank and train it on a synthetic regression
// task. Run with the launcher, e.g.  fsdp-run --nproc-per-node 2 ./fsdp_quickstart
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  // Rank, world size and rendezvous address come from the launcher's environment.
  auto pg = fsdp::ProcessGroup::from_env();
  if (pg->size() > 1) torch::set_num_threads(1);  // ranks share the CPU cores

  // Plain LibTorch: the model knows nothing about FSDP. Every rank seeds alike, and fully_shard
  // broadcasts rank 0's initial weights anyway.
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                              torch::nn::ReLU(), torch::nn::Linear(64, 1));

  // Each Linear becomes an FSDP unit: its parameters are gathered only while it runs.
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .sharding_strategy(fsdp::ShardingStrategy::kFullShard)
                                       .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  if (pg->rank() == 0) std::cout << sharded->describe();

  // The optimizer steps this rank's shards, not the module's (gathered) parameters.
  torch::optim::AdamW optimizer(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  sharded->check_optimizer(optimizer);  // throws if it held the module's own parameters

  // Target: y = sum(sin(x)). Each rank draws different data (its own seed), as data parallelism does.
  torch::manual_seed(1 + pg->rank());
  for (int step = 1; step <= 20; ++step) {
    auto x = torch::randn({256, 16});
    auto y = torch::sin(x).sum(1, /*keepdim=*/true);

    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
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
