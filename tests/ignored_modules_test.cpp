// Options::ignored_modules / ignored_parameters: what FSDP leaves alone is not sharded, gathered,
// reduced or broadcast; with all_reduce_ignored_gradients() training equals local training, without
// it the ignored parameters stay rank-local; state dicts, exports and checkpoints hold them (rank
// 0's values) and load them back at another world size; bad combinations name both sides.
#include <gtest/gtest.h>

#include <string>

#include "fsdp/checkpoint.h"
#include "harness.h"

namespace fsdp_test {
namespace {

// A side path with its own parameters and a buffer, for FSDP to leave alone.
struct SideImpl : torch::nn::Module {
  SideImpl() {
    proj = register_module("proj", torch::nn::Linear(6, 3));
    scale = register_buffer("scale", torch::full({3}, 0.5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return proj(x) * scale; }
  torch::nn::Linear proj{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Side);

struct WithSideImpl : torch::nn::Module {
  WithSideImpl() {
    body = register_module("body",
                           torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3)));
    side = register_module("side", Side());
  }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(x) + side(x); }
  torch::nn::Sequential body{nullptr};
  Side side{nullptr};
};
TORCH_MODULE(WithSide);

WithSide make_model() {
  torch::manual_seed(5);
  return WithSide();
}

at::Tensor batch(int world, int step) { return at::randn({2 * world, 6}, at::detail::createCPUGenerator(40 + step)); }

// args: strategy, "modules" or "parameters", "reduce" or "local", checkpoint directory or "-"
FSDP_WORKER(ignored_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), how = ctx.args.at(1), dir = ctx.args.at(3);
  const bool reduce = ctx.args.at(2) == "reduce";
  WithSide ref = make_model(), model = make_model();
  if (ctx.rank == 1) {  // rank-local values: sync_module_states must leave them alone
    torch::NoGradGuard no_grad;
    model->side->scale.fill_(0.25);
  }
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (how == "modules")
    options.ignored_modules({model->side.ptr()});
  else
    options.ignored_parameters({model->side->proj->weight, model->side->proj->bias});
  if (strategy == "HYBRID_SHARD") options.sharding_factor(ctx.world % 2 ? ctx.world : 2);
  auto sharded = fsdp::fully_shard(model, pg, options);
  // An ignored module's buffer is left alone; with ignored_parameters the module's buffer is managed.
  const double expected_scale = ctx.rank == 1 && how == "modules" ? 0.25 : 0.5;
  WORKER_CHECK(model->side->scale[0].item<double>() == expected_scale, "scale ", model->side->scale[0].item<double>());
  if (ctx.rank == 1) {
    torch::NoGradGuard no_grad;
    model->side->scale.fill_(0.5);
  }

  // Nothing of the side path is in a unit, and its parameters are whole on every rank.
  int64_t managed = 0;
  for (const auto& u : sharded->units()) {
    managed += u.numel;
    for (const auto& p : u.parameters) WORKER_CHECK(p.rfind("side.", 0) != 0, "unit '", u.name, "' holds ", p);
  }
  WORKER_CHECK(managed == 6 * 8 + 8 + 8 * 3 + 3, "FSDP manages ", managed, " elements");
  WORKER_CHECK(model->side->proj->weight.numel() == 18 && model->side->proj->weight.storage().nbytes() == 18 * 4,
               "the ignored weight is not whole");
  const auto ignored = sharded->ignored_parameters();
  WORKER_CHECK(ignored.size() == 2 && ignored[0].first == "side.proj.weight", "ignored_parameters(): ", ignored.size());
  for (const auto& [name, piece] : sharded->named_parameters())
    WORKER_CHECK(name.rfind("side.", 0) != 0, "parameters() yields ", name);

  torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(sharded->parameters(), 0.1);
  std::vector<at::Tensor> side_params;
  for (const auto& kv : ignored) side_params.push_back(kv.second);
  torch::optim::SGD side_opt(side_params, 0.1);
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = batch(ctx.world, step);
    ref_opt.zero_grad();
    ref->forward(x).pow(2).mean().backward();
    opt.zero_grad();
    side_opt.zero_grad();
    const at::Tensor mine = x.narrow(0, 2 * ctx.rank, 2);
    model->forward(mine).pow(2).mean().backward();
    if (step == 0 && !reduce) {  // FSDP did not reduce it: this rank's rows alone
      WithSide alone = make_model();
      alone->forward(mine).pow(2).mean().backward();
      WORKER_CHECK(rel_diff(model->side->proj->weight.grad(), alone->side->proj->weight.grad()) < 1e-6,
                   "the ignored gradient is not rank-local");
    }
    if (reduce) sharded->all_reduce_ignored_gradients();
    ref_opt.step();
    opt.step();
    side_opt.step();
  }
  if (reduce) expect_same_parameters(*ref, *sharded, 1e-5, strategy + " " + how);

  // The full state dict and checkpoints hold rank 0's ignored tensors.
  const auto full = sharded->full_state_dict();
  WORKER_CHECK(full.count("side.proj.weight") && full.count("side.scale"), "full_state_dict lacks the side path");
  if (dir == "-") return;
  auto rank0 = model->side->proj->weight.detach().clone();
  pg->world()->broadcast(rank0, 0)->wait();
  fsdp::checkpoint::save(dir + "/ckpt", *sharded, opt);
  fsdp::checkpoint::export_full(dir + "/model.safetensors", *sharded);
  expect_error([&] { fsdp::checkpoint::save(dir + "/with_side", *sharded, side_opt); }, "ignored parameter",
               "an optimizer over ignored parameters");
  if (ctx.rank == 0) torch::save(rank0, dir + "/side_weight.pt");
}

// args: checkpoint directory. Loads the checkpoint and the export at this world size.
FSDP_WORKER(ignored_load_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string dir = ctx.args.at(0);
  WithSide model = make_model();
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().ignored_modules({model->side.ptr()}));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  at::Tensor expected;
  torch::load(expected, dir + "/side_weight.pt");
  for (const std::string what : {"checkpoint", "export"}) {
    {
      torch::NoGradGuard no_grad;
      model->side->proj->weight.zero_();
      model->side->scale.zero_();
    }
    if (what == "checkpoint")
      fsdp::checkpoint::load(dir + "/ckpt", *sharded, opt);
    else
      fsdp::checkpoint::load_full(dir + "/model.safetensors", *sharded);
    WORKER_CHECK(torch::equal(model->side->proj->weight, expected), what, ": the ignored weight is not rank 0's");
    WORKER_CHECK(model->side->scale.allclose(torch::full({3}, 0.5)), what, ": the ignored buffer ", model->side->scale);
  }
  std::cout << "loaded" << std::endl;
}

TEST(IgnoredModules, TrainLikeLocalWhenReducedAndStayRankLocalOtherwise) {
  // Every strategy at worlds 1-4 (3 forces padding); ignored modules at odd worlds, ignored
  // parameters at even ones; left rank-local (not reduced) at worlds 2 and 4.
  for (const std::string strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    for (int world = 1; world <= 4; ++world) {
      const std::string how = world % 2 ? "modules" : "parameters";
      for (const std::string reduce : {"reduce", "local"}) {
        if (reduce == "local" && world % 2) continue;
        auto r = launch("ignored_worker", world, {strategy, how, reduce, "-"});
        ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << " " << how << " " << reduce << "\n" << r.report();
      }
    }
}

TEST(IgnoredModules, CheckpointsAndExportsHoldThemAndLoadAtAnotherWorldSize) {
  TempDir dir;
  auto r = launch("ignored_worker", 2, {"FULL_SHARD", "modules", "local", dir.path});
  ASSERT_TRUE(r.all_ok()) << r.report();
  r = launch("ignored_load_worker", 3, {dir.path});
  ASSERT_TRUE(r.all_ok()) << r.report();
  TempDir other;
  r = launch("ignored_worker", 4, {"HYBRID_SHARD", "parameters", "local", other.path});
  ASSERT_TRUE(r.all_ok()) << r.report();
  r = launch("ignored_load_worker", 1, {other.path});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// args: case
FSDP_WORKER(ignored_bad_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string c = ctx.args.at(0);
  WithSide model = make_model();
  auto options = fsdp::Options();
  std::string needle;
  if (c == "both") {
    options.ignored_modules({model->side.ptr()}).ignored_parameters({model->body[0]->as<torch::nn::Linear>()->weight});
    needle = "not both";
  } else if (c == "wrapped") {
    options.ignored_modules({model->side.ptr()}).wrap_modules({model->side.ptr()});
    needle = "'side' is in both Options::ignored_modules and Options::wrap_modules";
  } else if (c == "tied") {
    model->side->proj->register_parameter("tied", model->body[2]->as<torch::nn::Linear>()->bias);
    options.ignored_modules({model->side.ptr()});
    needle = "'body.2.bias' is the same tensor as ignored parameter 'side.proj.tied'";
  } else if (c == "foreign") {
    options.ignored_modules({torch::nn::Linear(2, 2).ptr()});
    needle = "not part of the model";
  }
  expect_error([&] { fsdp::fully_shard(model, pg, options); }, needle, c);
}

TEST(IgnoredModules, BadCombinationsNameBothSides) {
  for (const std::string c : {"both", "wrapped", "tied", "foreign"}) {
    auto r = launch("ignored_bad_worker", 1, {c});
    EXPECT_TRUE(r.all_ok()) << c << "\n" << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
