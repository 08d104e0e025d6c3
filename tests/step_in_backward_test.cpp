// The optimizer step in backward (FullyShardedModule::set_step_in_backward): the same parameters
// as a step after backward, bit for bit, and as local training; what it refuses.
#include <gtest/gtest.h>

#include <memory>

#include "fsdp/grad_scaler.h"
#include "fsdp/optim.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

std::unique_ptr<torch::optim::Optimizer> optimizer_of_kind(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.1));
  if (kind == "fused") return std::make_unique<fsdp::FusedAdamW>(params, torch::optim::AdamWOptions(0.01));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

void set_lr(torch::optim::Optimizer& opt, const std::string& kind, double lr) {
  for (auto& group : opt.param_groups()) {
    if (kind == "sgd")
      static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
    else
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

// Local training (ref), FSDP with a step after backward (after) and FSDP stepping in backward
// (during), on the same batches: step 1 accumulates two micro-batches (the first under no_sync),
// step 2 changes the learning rate (as a scheduler would), and `during` also calls step() after
// every other backward, which must change nothing.
FSDP_WORKER(equal_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const bool own = ctx.args.at(1) == "own";  // the steps on a thread of their own
  const std::string track = own ? "optimizer thread" : "compute";
  const int factor = strategy == "HYBRID_SHARD" ? 2 : 0;
  for (const std::string kind : {"adamw", "sgd", "fused"}) {
    const auto dtype = kind == "fused" ? at::kFloat : at::kDouble;  // FusedAdamW's own kernel is float32's
    auto build = [&] {
      torch::manual_seed(7);
      MLP m(6, 10, 3, 3);
      m->to(dtype);
      return m;
    };
    MLP ref = build(), after = build(), during = build();
    const auto options = fsdp::Options()
                             .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                             .sharding_factor(factor)
                             .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
    auto sharded_after = fsdp::fully_shard(after, pg, options);
    auto sharded_during = fsdp::fully_shard(during, pg, fsdp::Options(options).trace(true));
    auto ref_opt = optimizer_of_kind(kind, ref->parameters());
    auto after_opt = optimizer_of_kind(kind, sharded_after->parameters());
    auto during_opt = optimizer_of_kind(kind, sharded_during->parameters());
    sharded_during->set_step_in_backward(during_opt.get(), own ? fsdp::StepThread::kOwn : fsdp::StepThread::kAuto);
    const int rows = 2;
    for (int step = 0; step < 5; ++step) {
      if (step == 2)
        for (auto* o : {ref_opt.get(), after_opt.get(), during_opt.get()}) set_lr(*o, kind, 0.02);
      ref_opt->zero_grad();
      after_opt->zero_grad();
      during_opt->zero_grad();
      const int micro_batches = step == 1 ? 2 : 1;
      for (int micro = 0; micro < micro_batches; ++micro) {
        const auto x =
            at::randn({rows * ctx.world, 6}, at::detail::createCPUGenerator(100 + 10 * step + micro)).to(dtype);
        const auto mine = x.narrow(0, ctx.rank * rows, rows);
        ref->forward(x).pow(2).mean().backward();
        const bool last = micro + 1 == micro_batches;  // earlier micro-batches: no communication
        sharded_after->set_requires_gradient_sync(last);
        sharded_during->set_requires_gradient_sync(last);
        after->forward(mine).pow(2).mean().backward();
        during->forward(mine).pow(2).mean().backward();
      }
      ref_opt->step();
      after_opt->step();
      for (const auto& p : sharded_during->parameters())
        WORKER_CHECK(!p.grad().defined(), strategy, "/", kind,
                     ": a piece still has a gradient after the step in backward");
      WORKER_CHECK(sharded_during->memory_stats().grad_bytes == 0, strategy, "/", kind, ": ",
                   sharded_during->memory_stats().grad_bytes, " bytes of gradients held after the step in backward");
      if (step % 2 == 0) during_opt->step();  // every piece was stepped already: nothing happens
    }
    int steps_traced = 0;
    for (const auto& e : sharded_during->last_trace().events)
      if (e.kind == fsdp::TraceEvent::Kind::kStep) {
        WORKER_CHECK(e.track == track, strategy, "/", kind, ": a step ran on '", e.track, "', not '", track, "'");
        ++steps_traced;
      }
    WORKER_CHECK(steps_traced > 0, strategy, "/", kind, ": the trace shows no optimizer step in backward");
    // Bit for bit against the step after backward; against local training within rounding.
    auto full_after = sharded_after->full_state_dict();
    auto full_during = sharded_during->full_state_dict();
    for (const auto& [name, value] : full_after)
      WORKER_CHECK(torch::equal(full_during.at(name), value), strategy, "/", kind, ": parameter ", name,
                   " differs from a step after backward by rel ", rel_diff(full_during.at(name), value));
    expect_same_parameters(*ref, *sharded_during, dtype == at::kDouble ? 1e-10 : 1e-5,
                           strategy + "/" + kind + " against local training");
  }
  if (ctx.rank == 0) std::cout << strategy << " step in backward ok on " << track << std::endl;
}

void expect_equal_runs(const std::string& thread) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    auto r = launch("equal_worker", 3, {strategy, thread});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(strategy) + " step in backward ok")) << r.report();
  }
  auto r = launch("equal_worker", 4, {"HYBRID_SHARD", thread});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "HYBRID_SHARD step in backward ok")) << r.report();
}

TEST(StepInBackward, EqualsAStepAfterBackwardAndLocalTraining) { expect_equal_runs("backward"); }

// The same on the step's own thread (StepThread::kOwn), where backward goes on while units step.
TEST(StepInBackward, OnItsOwnThreadEqualsAStepAfterBackward) { expect_equal_runs("own"); }

// Modules used in unusual ways (an unused one, one used in two graphs, one called twice).
FSDP_WORKER(usage_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const std::string name : {"unused", "two_forwards", "called_twice"}) {
    auto loss = [&](BranchyImpl& m, const at::Tensor& x) {
      if (name == "unused") return m.b(torch::tanh(m.a(x))).pow(2).mean();
      if (name == "two_forwards") return m.b(m.a(x)).pow(2).mean() + m.a(x * 2).pow(2).mean();
      return m.b(m.a(m.a(x))).pow(2).mean();
    };
    torch::manual_seed(5);
    Branchy ref;
    torch::manual_seed(5);
    Branchy model;
    auto sharded =
        fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
    auto ref_opt = optimizer_of_kind("adamw", ref->parameters());
    auto opt = optimizer_of_kind("adamw", sharded->parameters());
    sharded->set_step_in_backward(opt.get(),
                                  ctx.args.at(0) == "own" ? fsdp::StepThread::kOwn : fsdp::StepThread::kBackward);
    for (int step = 0; step < 3; ++step) {
      auto x = at::randn({3 * ctx.world, 5}, at::detail::createCPUGenerator(60 + step));
      ref_opt->zero_grad();
      loss(*ref, x).backward();
      ref_opt->step();
      loss(*model, x.narrow(0, ctx.rank * 3, 3)).backward();
    }
    expect_same_parameters(*ref, *sharded, 1e-5, name + " against local training");
    if (ctx.rank == 0) std::cout << name << " ok" << std::endl;
  }
}

TEST(StepInBackward, ModulesUsedInUnusualWaysMatchLocalTraining) {
  for (const char* thread : {"backward", "own"}) {
    auto r = launch("usage_worker", 3, {thread});
    ASSERT_TRUE(r.all_ok()) << thread << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "called_twice ok")) << r.report();
  }
}

FSDP_WORKER(refusals_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(3);
  MLP model(6, 10, 3, 3);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  auto pieces = sharded->parameters();
  torch::optim::SGD partial({pieces.front()}, torch::optim::SGDOptions(0.1));
  expect_error([&] { sharded->set_step_in_backward(&partial); }, "does not hold the shard piece", "partial optimizer");
  torch::optim::SGD originals(model->parameters(), torch::optim::SGDOptions(0.1));
  expect_error([&] { sharded->set_step_in_backward(&originals); }, "original parameter", "original parameters");
  torch::optim::LBFGS lbfgs(pieces, torch::optim::LBFGSOptions(0.1));
  expect_error([&] { sharded->set_step_in_backward(&lbfgs); }, "LBFGS", "LBFGS");
  // Its own thread only with nothing but this module's pieces: autograd writes other tensors'
  // gradients while the thread would read them. Automatic: backward's thread then.
  std::vector<at::Tensor> with_extra = pieces;
  with_extra.push_back(torch::zeros({3}, torch::requires_grad()));
  torch::optim::SGD extra(with_extra, torch::optim::SGDOptions(0.1));
  expect_error([&] { sharded->set_step_in_backward(&extra, fsdp::StepThread::kOwn); },
               "holds a tensor that is not a shard piece", "own thread with a foreign tensor");
  sharded->set_step_in_backward(&extra, fsdp::StepThread::kAuto);
  sharded->set_step_in_backward(nullptr);

  torch::optim::AdamW opt(pieces, torch::optim::AdamWOptions(0.01));
  sharded->set_step_in_backward(&opt);
  const auto x = at::randn({2, 6}, at::detail::createCPUGenerator(9 + ctx.rank));
  model->forward(x).pow(2).mean().backward();
  expect_error([&] { sharded->clip_grad_norm_(1.0); }, "clip_grad_norm_: the module steps its optimizer in backward",
               "clipping");
  fsdp::GradScaler scaler(*sharded);
  expect_error([&] { scaler.scale(torch::ones({})); }, "GradScaler: the module steps its optimizer", "GradScaler");
  // Off again: a step after backward, with clipping, works as before.
  sharded->set_step_in_backward(nullptr);
  opt.zero_grad();
  model->forward(x).pow(2).mean().backward();
  sharded->clip_grad_norm_(1.0);
  opt.step();
  if (ctx.rank == 0) std::cout << "refusals ok" << std::endl;
}

// An optimizer whose step fails on its third call: the error reaches backward's caller on every
// rank, naming the unit, on either thread; nothing hangs.
class FailingSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  at::Tensor step(LossClosure closure = nullptr) override {
    if (++calls_ == 3) throw std::runtime_error("out of host memory (injected)");
    return torch::optim::SGD::step(std::move(closure));
  }

 private:
  int calls_ = 0;
};

FSDP_WORKER(failing_step_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(3);
  MLP model(6, 10, 3, 3);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  FailingSGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  sharded->set_step_in_backward(&opt, ctx.args.at(0) == "own" ? fsdp::StepThread::kOwn : fsdp::StepThread::kBackward);
  const auto x = at::randn({2, 6}, at::detail::createCPUGenerator(9 + ctx.rank));
  expect_error([&] { model->forward(x).pow(2).mean().backward(); }, "out of host memory (injected)", "a failing step");
  if (ctx.rank == 0) std::cout << "failure reported" << std::endl;
}

TEST(StepInBackward, AFailingStepFailsBackwardOnEitherThread) {
  for (const char* thread : {"backward", "own"}) {
    auto r = launch("failing_step_worker", 2, {thread});
    ASSERT_TRUE(r.all_ok()) << thread << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "failure reported")) << r.report();
  }
}

TEST(StepInBackward, RefusesWhatItCannotDoAndNamesTheFix) {
  auto r = launch("refusals_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "refusals ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
