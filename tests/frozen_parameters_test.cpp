// Frozen parameters mixed with trainable ones in a unit (a frozen base with LoRA adapters): the unit
// stays gathered until its backward has also computed its inputs' gradient, which reads the frozen
// weights, so backward gathers each unit once (none under SHARD_GRAD_OP) and the rate limiter's
// bound holds; gradients and steps equal local training. Parameters frozen when fully_shard() runs
// may be unfrozen (and frozen again) later, as in local training.
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace fsdp_test {
namespace {

// A frozen Linear plus a trainable low-rank update (LoRA): y = tanh(base(x) + up(down(x))).
struct LoraBlockImpl : torch::nn::Module {
  explicit LoraBlockImpl(int width, int rank) {
    base = register_module("base", torch::nn::Linear(width, width));
    down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(width, rank).bias(false)));
    up = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(rank, width).bias(false)));
    for (auto& p : base->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(base(x) + up(down(x))); }
  torch::nn::Linear base{nullptr}, down{nullptr}, up{nullptr};
};
TORCH_MODULE(LoraBlock);

struct LoraNetImpl : torch::nn::Module {
  LoraNetImpl() {
    for (int i = 0; i < 4; ++i) blocks->push_back(LoraBlock(16, 2));
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(16, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : *blocks) x = b->as<LoraBlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LoraNet);

LoraNet make_lora_net() {
  torch::manual_seed(21);
  return LoraNet();
}

// args: strategy, the backward all-gathers expected per iteration. Three SGD steps on 2 rows per
// rank; the third iteration's trace is checked.
FSDP_WORKER(lora_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const int expected_gathers = std::stoi(ctx.args.at(1));
  LoraNet ref = make_lora_net(), model = make_lora_net();
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<LoraBlockImpl>())
                     .trace(true);
  if (strategy == "HYBRID_SHARD") options.sharding_factor(2);
  auto sharded = fsdp::fully_shard(model, pg, options);
  torch::optim::SGD ref_opt(unique_parameters(*ref), torch::optim::SGDOptions(0.1)),
      opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = at::randn({rows * ctx.world, 16}, at::detail::createCPUGenerator(30 + step));
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(x), x.narrow(1, 0, 2)).backward();
    ref_opt.step();
    opt.zero_grad();
    const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows);
    torch::mse_loss(model->forward(mine), mine.narrow(1, 0, 2)).backward();
    opt.step();
  }
  expect_same_parameters(*ref, *sharded, 1e-5, strategy);
  const fsdp::IterationTrace t = sharded->last_trace();
  int backward_gathers = 0, on_demand = 0;
  int64_t gathered_bytes = 0, block_bytes = 0;
  for (const auto& e : t.events) {
    if (e.kind != fsdp::TraceEvent::Kind::kUnshardIssued || e.unit <= 0 || !contains(e.label, "backward")) continue;
    ++backward_gathers;
    on_demand += contains(e.label, "on demand");
    gathered_bytes += sharded->units().at(size_t(e.unit)).padded_bytes;
  }
  for (size_t u = 1; u < sharded->units().size(); ++u) block_bytes += sharded->units()[u].padded_bytes;
  const int64_t per_block = block_bytes / int64_t(sharded->units().size() - 1);
  WORKER_CHECK(on_demand == 0, strategy, ": ", on_demand, " units gathered again on demand in backward");
  WORKER_CHECK(backward_gathers == expected_gathers, strategy, ": ", backward_gathers,
               " all-gathers in backward, expected ", expected_gathers);
  WORKER_CHECK(gathered_bytes == expected_gathers * per_block, strategy, ": ", gathered_bytes,
               " bytes gathered in backward, expected ", expected_gathers * per_block);
  // SHARD_GRAD_OP keeps every unit from forward to backward; the others free each after its
  // forward, so the rate limiter's bound holds.
  const int limit = strategy == "SHARD_GRAD_OP" ? 4 : 2;
  WORKER_CHECK(t.max_unsharded_units <= limit, strategy, ": ", t.max_unsharded_units,
               " units unsharded at once, at most ", limit, " expected");
}

TEST(FrozenParameters, LoraUnitsAreGatheredOnceInBackwardAndTrainLikeLocal) {
  // FULL_SHARD: 4 block units, the last kept from forward to backward: 3 gathers.
  for (int world : {2, 3}) {
    auto r = launch("lora_worker", world, {"FULL_SHARD", "3"});
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
  auto r = launch("lora_worker", 2, {"SHARD_GRAD_OP", "0"});  // kept from forward to backward
  ASSERT_TRUE(r.all_ok()) << "SHARD_GRAD_OP\n" << r.report();
  r = launch("lora_worker", 4, {"HYBRID_SHARD", "3"});
  ASSERT_TRUE(r.all_ok()) << "HYBRID_SHARD\n" << r.report();
}

// args: strategy, case. Parameters frozen at fully_shard() are unfrozen after two steps (the
// first two only run forward in "all"), and one is frozen again after four:
//   bases: every block's frozen base; head: the head, whose gradients are the first of backward;
//   all: every parameter.
FSDP_WORKER(unfreeze_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), which = ctx.args.at(1);
  LoraNet ref = make_lora_net(), model = make_lora_net();
  auto freeze = [&](LoraNetImpl& m, bool frozen) {
    if (which == "head") {
      for (auto& p : m.head->parameters()) p.set_requires_grad(!frozen);
    } else if (which == "all") {
      for (auto& p : m.parameters()) p.set_requires_grad(!frozen);
    }
  };
  freeze(*ref, true);
  freeze(*model, true);
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<LoraBlockImpl>());
  if (strategy == "HYBRID_SHARD") options.sharding_factor(2);
  auto sharded = fsdp::fully_shard(model, pg, options);
  // Over every parameter, frozen ones too, as local training would hold them.
  torch::optim::AdamW ref_opt(unique_parameters(*ref), torch::optim::AdamWOptions(0.02)),
      opt(sharded->parameters(), torch::optim::AdamWOptions(0.02));
  const int rows = 2;
  for (int step = 0; step < 6; ++step) {
    if (step == 2) {
      freeze(*ref, false);
      freeze(*model, false);
      for (LoraNetImpl* m : {ref.get(), model.get()})
        for (auto& b : *m->blocks)
          for (auto& p : b->as<LoraBlockImpl>()->base->parameters()) p.set_requires_grad(true);
    }
    if (step == 4)
      for (LoraNetImpl* m : {ref.get(), model.get()})
        for (auto& p : m->blocks[0]->as<LoraBlockImpl>()->base->parameters()) p.set_requires_grad(false);
    const at::Tensor x = at::randn({rows * ctx.world, 16}, at::detail::createCPUGenerator(40 + step));
    const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows);
    if (which == "all" && step < 2) {  // nothing to train yet
      at::NoGradGuard no_grad;
      WORKER_CHECK(rel_diff(model->forward(mine), ref->forward(x).narrow(0, ctx.rank * rows, rows)) < 1e-5,
                   "forward differs");
      continue;
    }
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(x), x.narrow(1, 0, 2)).backward();
    ref_opt.step();
    opt.zero_grad();
    torch::mse_loss(model->forward(mine), mine.narrow(1, 0, 2)).backward();
    opt.step();
    if (step >= 2)
      for (const auto& [name, piece] : sharded->named_parameters()) {
        const bool frozen = step >= 4 && name.rfind("blocks.0.base.", 0) == 0;
        WORKER_CHECK(piece.requires_grad() == !frozen, "the piece of ", name, " does not follow its parameter");
      }
  }
  expect_same_parameters(*ref, *sharded, 1e-5, strategy + "/" + which);
}

TEST(FrozenParameters, ParametersFrozenAtFullyShardCanBeUnfrozenLater) {
  for (const char* which : {"bases", "head", "all"}) {
    for (const auto& [strategy, world] : std::vector<std::pair<std::string, int>>{
             {"FULL_SHARD", 3}, {"SHARD_GRAD_OP", 2}, {"NO_SHARD", 3}, {"HYBRID_SHARD", 4}, {"FULL_SHARD", 1}}) {
      auto r = launch("unfreeze_worker", world, {strategy, which});
      ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << " " << which << "\n" << r.report();
    }
  }
}

// Unfreezing through a shard piece alone is refused: the parameter decides, and its piece follows.
FSDP_WORKER(unfreeze_piece_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  LoraNet model = make_lora_net();
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<LoraBlockImpl>()));
  for (const auto& [name, piece] : sharded->named_parameters())
    if (name == "blocks.0.base.weight") piece.set_requires_grad(true);
  const at::Tensor x = at::randn({2, 16}, at::detail::createCPUGenerator(3 + ctx.rank));
  expect_error([&] { model->forward(x).sum().backward(); }, "the shard piece of parameter 'blocks.0.base.weight'",
               "piece unfrozen alone");
}

TEST(FrozenParameters, UnfreezingAPieceAloneIsRefused) {
  auto r = launch("unfreeze_piece_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
