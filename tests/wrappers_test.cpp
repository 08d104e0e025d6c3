// The module types the wrappers and wrap policies accept: wrap::by_type with module holders as with
// module classes; fsdp::Sharded and fsdp::Checkpointed around torch::nn::Sequential (inside another
// Sequential, trained exactly like the same model without them), around modules with an overloaded,
// const or defaulted forward (the forward named), and around module classes. What they refuse at
// compile time: tests/wrappers_compile_errors.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

std::vector<std::string> unit_names(const fsdp::FullyShardedModule& sharded) {
  std::vector<std::string> names;
  for (const auto& u : sharded.units()) names.push_back(u.name);
  return names;
}

// Two checkpointed blocks in a Sequential (Checkpointed's forward is not a template).
torch::nn::Sequential checkpointed_blocks() {
  return torch::nn::Sequential(fsdp::Checkpointed<Block>(Block(16, 2)), fsdp::Checkpointed<Block>(Block(16, 2)));
}

FSDP_WORKER(by_type_holder_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  // The units a policy makes of a fresh model.
  auto units_of = [&](const std::shared_ptr<torch::nn::Module>& model, const fsdp::WrapPolicy& policy) {
    return unit_names(*fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(policy)));
  };
  auto tiny = [] {
    return TinyTransformer(32, 16, 2, 3, 8).ptr();
  };
  const std::vector<std::string> blocks{"", "blocks.0", "blocks.1", "blocks.2"};
  WORKER_CHECK(units_of(tiny(), fsdp::wrap::by_type<BlockImpl>()) == blocks, "by_type<BlockImpl>");
  WORKER_CHECK(units_of(tiny(), fsdp::wrap::by_type<Block>()) == blocks, "by_type<Block> (the holder)");
  const auto linears = units_of(tiny(), fsdp::wrap::by_type<torch::nn::LinearImpl>());
  WORKER_CHECK(linears.size() == 1 + 3 * 4, "by_type<LinearImpl>: ", linears.size(), " units");
  WORKER_CHECK(units_of(tiny(), fsdp::wrap::by_type<torch::nn::Linear>()) == linears, "by_type<Linear>");
  WORKER_CHECK(units_of(tiny(), fsdp::wrap::by_type<Block, torch::nn::EmbeddingImpl>()) ==
                   units_of(tiny(), fsdp::wrap::by_type<BlockImpl, torch::nn::Embedding>()),
               "holders and module classes mixed");
  // Through a wrapper.
  const std::vector<std::string> wrapped{"", "0", "1"};
  WORKER_CHECK(units_of(checkpointed_blocks().ptr(), fsdp::wrap::by_type<Block>()) == wrapped,
               "by_type<Block> through Checkpointed");
  WORKER_CHECK(units_of(checkpointed_blocks().ptr(), fsdp::wrap::by_type<BlockImpl>()) == wrapped,
               "by_type<BlockImpl> through Checkpointed");
  if (ctx.rank == 0) std::cout << "by_type ok" << std::endl;
}

TEST(Wrappers, ByTypeTakesAModuleHolderAsItsModuleClass) {
  auto r = launch("by_type_holder_worker", 1);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "by_type ok")) << r.report();
}

TEST(Wrappers, ApplyActivationCheckpointingTakesAModuleHolder) {
  auto model = checkpointed_blocks();
  model->push_back(fsdp::Checkpointed<torch::nn::Linear>(torch::nn::Linear(16, 4)));
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*model, fsdp::wrap::by_type<Block>()), 2);
  EXPECT_FALSE(model[2]->as<fsdp::CheckpointedImpl<torch::nn::Linear>>()->enabled());
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*model, fsdp::wrap::by_type<torch::nn::Linear>()), 1);
  EXPECT_TRUE(model[2]->as<fsdp::CheckpointedImpl<torch::nn::Linear>>()->enabled());
}

// ---------------------------------------------------------------------------------------------
// torch::nn::Sequential wrapped: a Sequential of Linear, two wrapped Sequentials, and a Linear.

enum class SeqForm {
  kSharded,              // Sharded<Sequential> (explicit units)
  kCheckpointed,         // Checkpointed<Sequential> (units by wrap::by_type<torch::nn::Sequential>)
  kShardedCheckpointed,  // Sharded<Checkpointed<Sequential>> (explicit units)
};

SeqForm parse_seq_form(const std::string& s) {
  if (s == "sharded") return SeqForm::kSharded;
  if (s == "checkpointed") return SeqForm::kCheckpointed;
  if (s == "sharded_checkpointed") return SeqForm::kShardedCheckpointed;
  throw std::runtime_error("unknown form " + s);
}

torch::nn::Sequential inner_stack() {
  return torch::nn::Sequential(torch::nn::Linear(12, 12), torch::nn::Tanh(), torch::nn::Linear(12, 12),
                               torch::nn::GELU());
}

// The model without wrappers: a LibTorch Sequential cannot hold a Sequential (its forward is a
// template), so this calls its children, named as the Sequential's, in order.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    torch::manual_seed(21);
    add("0", torch::nn::Linear(6, 12));
    add("1", inner_stack());
    add("2", inner_stack());
    add("3", torch::nn::Linear(12, 4));
  }
  template <typename Holder>
  void add(const std::string& name, Holder module) {
    register_module(name, module);
    calls.emplace_back([module](const at::Tensor& x) mutable { return module->forward(x); });
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& call : calls) x = call(x);
    return x;
  }
  std::vector<std::function<at::Tensor(const at::Tensor&)>> calls;
};
TORCH_MODULE(Chain);

// The same model, the inner Sequentials wrapped, as one Sequential.
torch::nn::Sequential wrapped_chain(SeqForm form) {
  torch::manual_seed(21);
  torch::nn::Sequential model;
  model->push_back(torch::nn::Linear(6, 12));
  for (int i = 0; i < 2; ++i) {
    auto stack = inner_stack();
    if (form == SeqForm::kSharded)
      model->push_back(fsdp::Sharded<torch::nn::Sequential>(stack));
    else if (form == SeqForm::kCheckpointed)
      model->push_back(fsdp::Checkpointed<torch::nn::Sequential>(stack));
    else
      model->push_back(
          fsdp::Sharded<fsdp::Checkpointed<torch::nn::Sequential>>(fsdp::Checkpointed<torch::nn::Sequential>(stack)));
  }
  model->push_back(torch::nn::Linear(12, 4));
  return model;
}

FSDP_WORKER(wrapped_sequential_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const auto& combo : ctx.args) {  // "FORM:STRATEGY"
    const auto colon = combo.find(':');
    const SeqForm form = parse_seq_form(combo.substr(0, colon));
    const auto strategy = fsdp::parse_sharding_strategy(combo.substr(colon + 1));
    Chain ref;
    auto model = wrapped_chain(form);
    ref->to(at::kDouble);
    model->to(at::kDouble);
    WORKER_CHECK(model->named_parameters().keys() == ref->named_parameters().keys(), combo, ": names changed");
    auto opts = fsdp::Options().sharding_strategy(strategy);
    if (form == SeqForm::kCheckpointed) opts.auto_wrap_policy(fsdp::wrap::by_type<torch::nn::Sequential>());
    auto sharded = fsdp::fully_shard(model, pg, opts);
    WORKER_CHECK((unit_names(*sharded) == std::vector<std::string>{"", "1", "2"}), combo,
                 ": the wrapped Sequentials must be units: ", sharded->describe());
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.01));
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    const int rows = 3;
    for (int step = 0; step < 4; ++step) {
      auto gen = at::detail::createCPUGenerator(600 + step);
      const auto x = at::randn({rows * ctx.world, 6}, gen).to(at::kDouble);
      step_side_by_side(ref, ref_opt, model, opt, x, ctx.rank, rows);
    }
    expect_same_parameters(*ref, *sharded, 1e-12, combo);
    if (ctx.rank == 0) std::cout << combo << " ok" << std::endl;
  }
}

TEST(Wrappers, WrappedSequentialsInASequentialTrainLikeTheUnwrappedModel) {
  for (int world : {1, 2}) {
    std::vector<std::string> combos;
    for (const char* form : {"sharded", "checkpointed", "sharded_checkpointed"})
      for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
        combos.push_back(std::string(form) + ":" + strategy);
    auto r = launch("wrapped_sequential_worker", world, combos);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "sharded_checkpointed:NO_SHARD ok")) << r.report();
  }
}

// Without FSDP: a checkpointed Sequential with dropout equals the plain one (the recompute replays
// the random numbers) and keeps only its input.
TEST(Wrappers, CheckpointedSequentialEqualsThePlainSequential) {
  auto stack = [] {
    torch::manual_seed(5);
    return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Dropout(0.5), torch::nn::Tanh(),
                                 torch::nn::Linear(8, 3));
  };
  torch::nn::Sequential plain = stack();
  fsdp::Checkpointed<torch::nn::Sequential> checkpointed(stack());
  fsdp::Sharded<torch::nn::Sequential> sharded(stack());
  ASSERT_EQ(checkpointed->named_parameters().keys(), plain->named_parameters().keys());
  ASSERT_EQ(sharded->named_parameters().keys(), plain->named_parameters().keys());
  const auto x = torch::randn({4, 6});
  auto x1 = x.clone().requires_grad_(), x2 = x.clone().requires_grad_(), x3 = x.clone().requires_grad_();
  torch::manual_seed(8);
  plain->forward(x1).pow(2).sum().backward();
  torch::manual_seed(8);
  auto out = checkpointed->forward(x2);
  ASSERT_TRUE(out.grad_fn() && contains(out.grad_fn()->name(), "CheckpointFunction")) << out.grad_fn()->name();
  out.pow(2).sum().backward();
  torch::manual_seed(8);
  sharded->forward(x3).pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(x2.grad(), x1.grad()));
  EXPECT_TRUE(torch::equal(x3.grad(), x1.grad()));
  auto plain_params = plain->named_parameters();
  for (const auto& kv : checkpointed->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value().grad(), plain_params[kv.key()].grad())) << kv.key();
  for (const auto& kv : sharded->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value().grad(), plain_params[kv.key()].grad())) << kv.key();
}

// ---------------------------------------------------------------------------------------------
// Forwards a wrapper cannot take over unnamed, and module classes.

// A forward with a default argument, declared to LibTorch (FORWARD_HAS_DEFAULT_ARGS).
struct ScaledImpl : torch::nn::Module {
  ScaledImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x, double scale = 3.0) { return lin(x) * scale; }
  torch::nn::Linear lin{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(3.0)})
};
TORCH_MODULE(Scaled);

// An overloaded forward.
struct TwoWayImpl : torch::nn::Module {
  TwoWayImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) { return lin(x); }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) { return lin(x) * y; }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(TwoWay);

// A const forward.
struct ConstForwardImpl : torch::nn::Module {
  ConstForwardImpl() { w = register_parameter("w", torch::randn({4, 4})); }
  at::Tensor forward(const at::Tensor& x) const { return torch::tanh(torch::matmul(x, w)); }
  at::Tensor w;
};
TORCH_MODULE(ConstForward);

// `module`'s output on x and every parameter's gradient of its sum, the random numbers seeded.
std::vector<at::Tensor> output_and_grads(const std::function<at::Tensor(const at::Tensor&)>& forward,
                                         torch::nn::Module& module, const at::Tensor& x) {
  for (auto& p : module.parameters()) p.mutable_grad().reset();
  torch::manual_seed(4);
  auto out = forward(x);
  out.sum().backward();
  std::vector<at::Tensor> result{out.detach()};
  for (const auto& p : module.parameters()) result.push_back(p.grad());
  return result;
}

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ": tensor " << i;
}

template <typename Holder>
Holder seeded() {
  torch::manual_seed(9);
  return Holder();
}

TEST(Wrappers, DefaultArgumentsOmittedThroughASequentialOrANamedForward) {
  Scaled plain = seeded<Scaled>();
  const auto x = torch::randn({2, 4});
  const auto expected = output_and_grads([&](const at::Tensor& t) { return plain->forward(t); }, *plain, x);
  // The wrapper's forward is M's: every argument passed.
  fsdp::Sharded<Scaled> sharded(seeded<Scaled>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return sharded->forward(t, 3.0); }, *sharded, x), expected,
               "Sharded<Scaled>, every argument");
  // In a Sequential, the defaults M declares to LibTorch fill in the omitted arguments.
  auto seq = torch::nn::Sequential(fsdp::Sharded<Scaled>(seeded<Scaled>()));
  expect_equal(output_and_grads([&](const at::Tensor& t) { return seq->forward(t); }, *seq, x), expected,
               "Sequential(Sharded<Scaled>)");
  auto seq_checkpointed = torch::nn::Sequential(fsdp::Checkpointed<Scaled>(seeded<Scaled>()));
  expect_equal(
      output_and_grads([&](const at::Tensor& t) { return seq_checkpointed->forward(t); }, *seq_checkpointed, x),
      expected, "Sequential(Checkpointed<Scaled>)");
  auto seq_both =
      torch::nn::Sequential(fsdp::Sharded<fsdp::Checkpointed<Scaled>>(fsdp::Checkpointed<Scaled>(seeded<Scaled>())));
  expect_equal(output_and_grads([&](const at::Tensor& t) { return seq_both->forward(t); }, *seq_both, x), expected,
               "Sequential(Sharded<Checkpointed<Scaled>>)");
  // A named forward without the defaulted argument: M's default applies.
  fsdp::Sharded<Scaled, at::Tensor(const at::Tensor&)> short_sharded(seeded<Scaled>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return short_sharded->forward(t); }, *short_sharded, x),
               expected, "Sharded<Scaled, Tensor(const Tensor&)>");
  fsdp::Checkpointed<Scaled, at::Tensor(at::Tensor)> short_checkpointed(seeded<Scaled>());
  auto out = short_checkpointed->forward(x.clone().requires_grad_());
  EXPECT_TRUE(contains(out.grad_fn()->name(), "CheckpointFunction")) << out.grad_fn()->name();
  expect_equal(
      output_and_grads([&](const at::Tensor& t) { return short_checkpointed->forward(t); }, *short_checkpointed, x),
      expected, "Checkpointed<Scaled, Tensor(Tensor)>");
  // A Sequential call passing more arguments than the named forward takes is refused by LibTorch.
  auto seq_short = torch::nn::Sequential(fsdp::Sharded<Scaled, at::Tensor(const at::Tensor&)>(seeded<Scaled>()));
  EXPECT_THROW(seq_short->forward(x, 3.0), c10::Error);
}

TEST(Wrappers, AnOverloadedForwardNamed) {
  TwoWay plain = seeded<TwoWay>();
  const auto x = torch::randn({2, 4}), y = torch::randn({2, 4});
  fsdp::Sharded<TwoWay, at::Tensor(const at::Tensor&)> one(seeded<TwoWay>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return one->forward(t); }, *one, x),
               output_and_grads([&](const at::Tensor& t) { return plain->forward(t); }, *plain, x), "one argument");
  fsdp::Checkpointed<TwoWay, at::Tensor(const at::Tensor&, const at::Tensor&)> two(seeded<TwoWay>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return two->forward(t, y); }, *two, x),
               output_and_grads([&](const at::Tensor& t) { return plain->forward(t, y); }, *plain, x), "two arguments");
  auto seq = torch::nn::Sequential(fsdp::Sharded<TwoWay, at::Tensor(const at::Tensor&)>(seeded<TwoWay>()));
  EXPECT_TRUE(torch::equal(seq->forward(x), plain->forward(x)));
}

TEST(Wrappers, AConstForwardAndModuleClasses) {
  ConstForward plain = seeded<ConstForward>();
  const auto x = torch::randn({2, 4});
  const auto expected = output_and_grads([&](const at::Tensor& t) { return plain->forward(t); }, *plain, x);
  fsdp::Sharded<ConstForward> sharded(seeded<ConstForward>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return sharded->forward(t); }, *sharded, x), expected,
               "Sharded<ConstForward>");
  // A module class in place of its holder, given the holder or the module.
  fsdp::Checkpointed<ConstForwardImpl> checkpointed(seeded<ConstForward>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return checkpointed->forward(t); }, *checkpointed, x),
               expected, "Checkpointed<ConstForwardImpl>");
  torch::manual_seed(9);
  fsdp::Sharded<ConstForwardImpl> from_module(std::make_shared<ConstForwardImpl>());
  expect_equal(output_and_grads([&](const at::Tensor& t) { return from_module->forward(t); }, *from_module, x),
               expected, "Sharded<ConstForwardImpl>");
  EXPECT_EQ(from_module->named_parameters().keys(), plain->named_parameters().keys());
}

}  // namespace
}  // namespace fsdp_test
