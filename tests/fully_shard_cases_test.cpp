// Memory accounting, the special cases of the core issue, and bad input.
#include <gtest/gtest.h>

#include <cstdlib>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// ---------------------------------------------------------------------------------------------
// Peak parameter storage: FULL_SHARD = sum of padded shards + largest padded unsharded unit.

FSDP_WORKER(memory_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  using fsdp::BackwardPrefetch;
  struct Case {
    const char* name;
    fsdp::ShardingStrategy strategy;
    fsdp::WrapPolicy policy;
    BackwardPrefetch prefetch;
    bool forward_prefetch;
    int all_gather_limit;  // 0: limiter off
  };
  const auto per_linear = fsdp::wrap::by_type<torch::nn::LinearImpl>();
  const auto full = fsdp::ShardingStrategy::kFullShard;
  std::vector<Case> cases{
      {"per-linear", full, per_linear, BackwardPrefetch::kNone, false, 2},
      {"per-linear+backward-pre", full, per_linear, BackwardPrefetch::kBackwardPre, false, 2},
      {"per-linear+backward-post", full, per_linear, BackwardPrefetch::kBackwardPost, false, 2},
      {"per-linear+both-prefetch", full, per_linear, BackwardPrefetch::kBackwardPre, true, 2},
      {"per-linear+both-prefetch-unlimited", full, per_linear, BackwardPrefetch::kBackwardPre, true, 0},
      {"per-linear+both-prefetch+limit-1", full, per_linear, BackwardPrefetch::kBackwardPre, true, 1},
      {"by-size-150", full, fsdp::wrap::by_size(150), BackwardPrefetch::kNone, false, 2},
      {"whole-model", full, nullptr, BackwardPrefetch::kBackwardPre, true, 2},
      {"per-linear", fsdp::ShardingStrategy::kShardGradOp, per_linear, BackwardPrefetch::kBackwardPre, true, 2},
      {"per-linear", fsdp::ShardingStrategy::kNoShard, per_linear, BackwardPrefetch::kBackwardPre, true, 2},
  };
  for (const auto& c : cases) {
    torch::manual_seed(3);
    MLP model(7, 13, 5, 4);  // odd sizes: every unit needs padding at world 4
    auto sharded = fsdp::fully_shard(model, pg,
                                     fsdp::Options()
                                         .sharding_strategy(c.strategy)
                                         .auto_wrap_policy(c.policy)
                                         .backward_prefetch(c.prefetch)
                                         .forward_prefetch(c.forward_prefetch)
                                         .limit_all_gathers(c.all_gather_limit > 0)
                                         .all_gather_limit(std::max(1, c.all_gather_limit)));
    torch::optim::SGD opt(sharded->parameters(), 0.1);
    // Flat wrapping: sum of shards + the largest unit (the paper's formula). Nested units: a
    // parent stays unsharded while its children run, so the largest root-to-unit chain counts.
    // BACKWARD_PRE and forward prefetch (limit >= 2) keep the next unit unsharded beside the
    // current one: the largest pair of units adjacent in execution order (module order here)
    // counts instead. BACKWARD_POST gathers the next unit after resharding the current one.
    int64_t shards = 0, largest = 0, all_padded = 0, largest_pair = 0;
    const auto& units = sharded->units();
    for (size_t i = 0; i < units.size(); ++i) {
      const auto& u = units[i];
      shards += u.shard_bytes;
      all_padded += u.padded_bytes;
      int64_t chain = 0;
      for (const fsdp::UnitInfo* v = &u;; v = &units[v->parent]) {
        chain += v->padded_bytes;
        if (v->parent < 0) break;
      }
      largest = std::max(largest, chain);
      if (i >= 2) largest_pair = std::max(largest_pair, u.padded_bytes + units[i - 1].padded_bytes);
    }
    const std::string name = c.name;
    const bool flat = name != "by-size-150";
    if (flat && units[0].padded_bytes == 0 && c.strategy == full) {
      int64_t max_unit = 0;
      for (const auto& u : units) max_unit = std::max(max_unit, u.padded_bytes);
      WORKER_CHECK(largest == max_unit, "flat wrapping: the chain figure must equal the largest unit");
    }
    const bool prefetching = units.size() > 2 && c.all_gather_limit != 1 &&
                             (c.prefetch == BackwardPrefetch::kBackwardPre || c.forward_prefetch);
    if (prefetching) WORKER_CHECK(units[0].padded_bytes == 0, "the prefetch formula assumes an empty root");
    int64_t expected = 0;
    switch (c.strategy) {
      case fsdp::ShardingStrategy::kFullShard: expected = shards + (prefetching ? largest_pair : largest); break;
      case fsdp::ShardingStrategy::kShardGradOp: expected = shards + all_padded; break;
      default: expected = all_padded; break;  // NO_SHARD: the flat buffer is the replica
    }
    WORKER_CHECK(sharded->memory_stats().param_bytes == (c.strategy == fsdp::ShardingStrategy::kNoShard ? all_padded : shards),
                 c.name, ": resting parameter bytes ", sharded->memory_stats().param_bytes);
    for (int step = 0; step < 3; ++step) {  // forward prefetch starts in the second iteration
      sharded->reset_peak_memory_stats();
      opt.zero_grad();
      model->forward(torch::randn({4, 7})).pow(2).mean().backward();
      opt.step();
      const auto m = sharded->memory_stats();
      WORKER_CHECK(m.param_peak_bytes == expected, fsdp::to_string(c.strategy), " ", c.name, ": peak parameter bytes ",
                   m.param_peak_bytes, " != expected ", expected, " (shards ", shards, ", largest unit ", largest,
                   ", largest adjacent pair ", largest_pair, ", all units ", all_padded, ")");
    }
    if (ctx.rank == 0)
      std::cout << fsdp::to_string(c.strategy) << " " << c.name << " units " << sharded->units().size()
                << " peak " << expected << " bytes ok" << std::endl;
  }
}

TEST(Memory, PeakParameterStorageMatchesTheFormulaAtWorld4) {
  auto r = launch("memory_worker", 4);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "FULL_SHARD whole-model")) << r.report();
}

// Peak gradient storage: the shard pieces' gradients + the unsharded gradient buffer of the unit
// computing + Options::reductions_in_flight earlier units' reductions (unsharded gradient and
// reduce-scatter output each), whether the reductions finish at once (loopback) or late (a slow
// modeled network): the runtime frees a reduction's buffers at a fixed point, not when it happens
// to complete, so the peak is the same in every run. NO_SHARD has no transient gradient memory: it
// reduces in place in the flat buffer that the pieces' gradients alias.
FSDP_WORKER(grad_memory_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const auto slow = fsdp::NetworkModel()
                        .intra(fsdp::Link().bandwidth_gbps(0.001).latency_us(3000))
                        .inter(fsdp::Link().bandwidth_gbps(0.001).latency_us(3000))
                        .ranks_per_host(ctx.world);
  for (const auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kNoShard})
    for (const bool slow_network : {false, true})
      for (const int in_flight : {0, 1, 2, 3}) {
        pg->set_network_model(slow_network ? std::optional<fsdp::NetworkModel>(slow) : std::nullopt);
        torch::manual_seed(3);
        MLP model(7, 13, 5, 4);  // odd sizes: every unit needs padding at world 3
        auto sharded = fsdp::fully_shard(model, pg,
                                         fsdp::Options()
                                             .sharding_strategy(strategy)
                                             .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>())
                                             .reductions_in_flight(in_flight));
        const auto& units = sharded->units();
        WORKER_CHECK(units.size() == 6 && units[0].padded_bytes == 0, "expected an empty root and 5 Linear units");
        const bool no_shard = strategy == fsdp::ShardingStrategy::kNoShard;
        // Backward reduces the units in reverse forward order.
        int64_t current = 0, transient = 0;
        std::vector<const fsdp::UnitInfo*> pending;
        for (size_t i = units.size() - 1; i >= 1; --i) {
          const fsdp::UnitInfo& u = units[i];
          const int64_t output = no_shard ? 0 : u.shard_bytes;  // NO_SHARD all-reduces in place
          current += u.padded_bytes;
          transient = std::max(transient, current);
          while (!pending.empty() && pending.size() > size_t(std::max(in_flight - 1, 0))) {
            current -= pending.front()->padded_bytes + (no_shard ? 0 : pending.front()->shard_bytes);
            pending.erase(pending.begin());
          }
          current += output;
          transient = std::max(transient, current);
          pending.push_back(&u);
          if (in_flight == 0) {
            current -= u.padded_bytes + output;
            pending.clear();
          }
        }
        // NO_SHARD reduces in place in the persistent buffer the pieces' gradients alias: nothing transient.
        if (no_shard) transient = 0;
        torch::optim::SGD opt(sharded->parameters(), 0.1);
        std::vector<int64_t> peaks;
        for (int step = 0; step < 3; ++step) {
          sharded->reset_peak_memory_stats();
          opt.zero_grad();  // LibTorch 1.13: zeroes the pieces' gradients in place, keeps them
          model->forward(torch::randn({4, 7})).pow(2).mean().backward();
          opt.step();
          const auto m = sharded->memory_stats();
          if (step == 0) continue;  // the pieces' gradients are created during the first backward
          const int64_t expected = m.grad_bytes + transient;
          WORKER_CHECK(m.grad_peak_bytes == expected, fsdp::to_string(strategy), ", ", in_flight,
                       " reductions in flight, ", slow_network ? "slow modeled" : "loopback", " network, step ", step,
                       ": peak gradient bytes ", m.grad_peak_bytes, " != expected ", expected, " (pieces ", m.grad_bytes,
                       " + transient ", transient, ")");
        }
      }
  pg->set_network_model(std::nullopt);
  if (ctx.rank == 0) std::cout << "gradient peaks ok" << std::endl;
}

TEST(Memory, PeakGradientStorageMatchesTheFormulaWhateverTheNetworkSpeed) {
  auto r = launch("grad_memory_worker", 3);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "gradient peaks ok")) << r.report();
}

// ---------------------------------------------------------------------------------------------
// Special cases, each compared with local training on the same global batch.

struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    a = register_module("a", torch::nn::Linear(5, 5));
    b = register_module("b", torch::nn::Linear(5, 5));
    unused = register_module("unused", torch::nn::Linear(5, 5));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Branchy);

// Each case: a loss over (model, inputs) using the model in a particular way.
at::Tensor case_loss(const std::string& name, BranchyImpl& m, const at::Tensor& x) {
  if (name == "unused") return m.b(torch::tanh(m.a(x))).pow(2).mean();                    // 'unused' never read
  if (name == "two_forwards") return m.b(m.a(x)).pow(2).mean() + m.a(x * 2).pow(2).mean();  // a used in two graphs
  if (name == "called_twice") return m.b(m.a(m.a(x))).pow(2).mean();                     // unit module twice
  if (name == "direct_submodule") return m.a->forward(x).sin().mean();                    // only a submodule
  if (name == "eval_bn") return m.b(m.bn(m.a(x))).pow(2).mean();                          // BN with running stats
  throw std::runtime_error("unknown case " + name);
}

FSDP_WORKER(cases_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const auto& name : ctx.args) {
    for (const char* optim : {"sgd", "adamw"}) {
      torch::manual_seed(5);
      Branchy ref;
      torch::manual_seed(5);
      Branchy model;
      if (name == "eval_bn") {  // running statistics are used, so the result is independent of the split
        ref->bn->eval();
        model->bn->eval();
      }
      auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
      auto make = [&](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
        if (std::string(optim) == "sgd") return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
        return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
      };
      auto ref_opt = make(ref->parameters());
      auto opt = make(sharded->parameters());
      const int per_rank = 3;
      for (int step = 0; step < 4; ++step) {
        auto gen = at::detail::createCPUGenerator(50 + step);
        auto x = at::randn({per_rank * ctx.world, 5}, gen);
        ref_opt->zero_grad();
        case_loss(name, *ref, x).backward();
        ref_opt->step();
        opt->zero_grad();
        case_loss(name, *model, x.narrow(0, ctx.rank * per_rank, per_rank)).backward();
        opt->step();
      }
      auto full = sharded->full_state_dict();
      for (const auto& kv : ref->named_parameters()) {
        const double d = rel_diff(full.at(kv.key()), kv.value().detach());
        WORKER_CHECK(d <= 1e-5, name, "/", optim, ": parameter ", kv.key(), " differs from local training by rel ", d);
      }
      if (name == "unused")
        for (const auto& kv : sharded->named_parameters())
          if (kv.first.rfind("unused.", 0) == 0)
            WORKER_CHECK(!kv.second.grad().defined(), "unused parameter ", kv.first, " got a gradient");
    }
    if (ctx.rank == 0) std::cout << name << " ok" << std::endl;
  }
}

TEST(Cases, UnusedTwoForwardsCalledTwiceDirectSubmoduleAndBuffersMatchLocalTraining) {
  auto r = launch("cases_worker", 3, {"unused", "two_forwards", "called_twice", "direct_submodule", "eval_bn"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "eval_bn ok")) << r.report();
}

// Train-mode BatchNorm: running statistics differ per rank's batch; FSDP keeps them replicated
// (rank 0's, broadcast after every backward).
FSDP_WORKER(buffers_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(5);
  Branchy model;
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto x = torch::randn({4, 5}) + ctx.rank;  // different data per rank
    model->b(model->bn(model->a(x))).pow(2).mean().backward();
    opt.step();
  }
  at::Tensor mean = model->bn->running_mean.clone();
  at::Tensor from_rank0 = mean.clone();
  pg->world()->broadcast(from_rank0, 0)->wait();
  WORKER_CHECK(torch::equal(mean, from_rank0), "BatchNorm running_mean differs from rank 0's");
  WORKER_CHECK(mean.abs().sum().item<double>() > 0, "running_mean never updated");
}

TEST(Cases, BuffersStayReplicated) {
  auto r = launch("buffers_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// Gradient accumulation over micro-batches (backward twice, one step) and the ways a user handles
// gradients between steps: zeroed in place (LibTorch 1.13's zero_grad), dropped (set to none),
// scaled in place between micro-batches (as gradient clipping does), replaced by the user's own
// tensor. Each is mirrored on the local model, elementwise (a piece is a slice of the parameter).
FSDP_WORKER(accumulation_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  torch::manual_seed(4);
  MLP ref(6, 10, 3, 3);
  ref->to(at::kDouble);
  torch::manual_seed(4);
  MLP model(6, 10, 3, 3);
  model->to(at::kDouble);
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                                       .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD ref_opt(ref->parameters(), sgd), opt(sharded->parameters(), sgd);
  auto for_each_grad = [&](const std::function<void(at::Tensor& param, at::Tensor& grad)>& fn) {
    for (auto& p : ref->parameters()) fn(p, p.mutable_grad());
    for (auto& p : sharded->parameters()) fn(p, p.mutable_grad());
  };
  const int per_rank = 2;
  const char* clearing[] = {"zero_grad", "set_to_none", "keep", "user_tensor", "zero_grad"};
  for (int step = 0; step < 5; ++step) {
    const std::string clear = clearing[step];
    at::NoGradGuard no_grad;
    if (clear == "zero_grad") {
      ref_opt.zero_grad();
      opt.zero_grad();
    } else if (clear == "set_to_none") {
      for_each_grad([](at::Tensor&, at::Tensor& g) { g.reset(); });
      WORKER_CHECK(sharded->memory_stats().grad_bytes == 0, strategy, ": gradients dropped by the user are still held: ",
                   sharded->memory_stats().grad_bytes, " bytes");
    } else if (clear == "user_tensor") {
      for_each_grad([](at::Tensor& p, at::Tensor& g) { g = p.detach() * 0.01; });
    }  // "keep": the previous step's gradients stay and the new ones add to them
    for (int micro = 0; micro < 2; ++micro) {
      if (micro == 1 && step == 3) for_each_grad([](at::Tensor&, at::Tensor& g) { if (g.defined()) g.mul_(0.5); });
      const auto gen_x = at::randn({per_rank * ctx.world, 6}, at::detail::createCPUGenerator(10 * step + micro)).to(at::kDouble);
      at::AutoGradMode grad_on(true);
      ref->forward(gen_x).pow(2).mean().backward();
      model->forward(gen_x.narrow(0, ctx.rank * per_rank, per_rank)).pow(2).mean().backward();
    }
    ref_opt.step();
    opt.step();
  }
  auto full = sharded->full_state_dict();
  for (const auto& kv : ref->named_parameters()) {
    const double d = rel_diff(full.at(kv.key()), kv.value().detach());
    WORKER_CHECK(d <= 1e-10, strategy, ": parameter ", kv.key(), " differs from local training by rel ", d);
  }
  if (ctx.rank == 0) std::cout << strategy << " accumulation ok" << std::endl;
}

TEST(Cases, GradientAccumulationAndUserHandledGradientsMatchLocalTraining) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    auto r = launch("accumulation_worker", 3, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(strategy) + " accumulation ok")) << r.report();
  }
}

// Mixed dtypes inside one unit: one FlatParameter per dtype.
struct MixedImpl : torch::nn::Module {
  MixedImpl() {
    lo = register_module("lo", torch::nn::Linear(4, 4));
    hi = register_module("hi", torch::nn::Linear(4, 4));
    hi->to(torch::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return hi(lo(x).to(torch::kDouble)); }
  torch::nn::Linear lo{nullptr}, hi{nullptr};
};
TORCH_MODULE(Mixed);

FSDP_WORKER(mixed_dtype_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(9);
  Mixed ref;
  torch::manual_seed(9);
  Mixed model;
  auto sharded = fsdp::fully_shard(model, pg);  // one unit holding float and double parameters
  torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(sharded->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randn({2 * ctx.world, 4}, at::detail::createCPUGenerator(step));
    step_side_by_side(ref, ref_opt, model, opt, x, ctx.rank, 2);
  }
  auto full = sharded->full_state_dict();
  for (const auto& kv : ref->named_parameters())
    WORKER_CHECK(rel_diff(full.at(kv.key()), kv.value().detach()) <= 1e-5, "mixed dtype parameter ", kv.key());
}

TEST(Cases, MixedDtypesInOneUnit) {
  auto r = launch("mixed_dtype_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// ---------------------------------------------------------------------------------------------
// Bad input: a clear error, never a hang.

FSDP_WORKER(different_models_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, ctx.rank == 1 ? 11 : 10, 3, 2);  // rank 1 built a different hidden size
  fsdp::fully_shard(model, pg);
}

TEST(BadInput, RanksWithDifferentModelsFailWithTheFirstDifference) {
  auto r = launch("different_models_worker", 2, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_NE(rank.exit_code, 0);
    EXPECT_TRUE(contains(rank.output, "built different models")) << rank.output;
    EXPECT_TRUE(contains(rank.output, "layers.0.weight")) << rank.output;
  }
}

FSDP_WORKER(hybrid_factor_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  // Every rank finishes connecting before any of them fails: rank 0 hosts the store, and a rank
  // still connecting when it exits would report the lost connection instead of the check (seen
  // once on a loaded machine).
  pg->world()->barrier();
  MLP model(6, 10, 3, 2);
  fsdp::fully_shard(model, pg, fsdp::Options().sharding_strategy(fsdp::ShardingStrategy::kHybridShard).sharding_factor(2));
}

TEST(BadInput, HybridFactorMustDivideWorldSize) {
  auto r = launch("hybrid_factor_worker", 3, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) EXPECT_TRUE(contains(rank.output, "world size 3 is not divisible by the sharding factor 2")) << rank.output;
}

FSDP_WORKER(shared_param_error_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  TinyTransformer model(32, 16, 2, 1, 8);
  fsdp::fully_shard(model, pg, fsdp::Options().wrap_modules({model->tok.ptr(), model->head.ptr()})
                                   .shared_parameters(fsdp::SharedParameterPolicy::kError));
}

TEST(BadInput, SharedParameterAcrossUnitsRefusedWhenAskedTo) {
  auto r = launch("shared_param_error_worker", 1, {}, 120);
  EXPECT_TRUE(contains(r.ranks[0].output, "'tok.weight', 'head.weight' is shared by modules of different FSDP units"))
      << r.report();
}

FSDP_WORKER(wrong_optimizer_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD wrong(model->parameters(), 0.1);
  try {
    sharded->check_optimizer(wrong);
    throw std::runtime_error("check_optimizer accepted the original parameters");
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "Build the optimizer over FullyShardedModule::parameters()"), e.what());
  }
  // An in-place update of an original parameter is refused at the next backward.
  {
    torch::NoGradGuard no_grad;
    model->parameters()[0].mul_(0.5);
  }
  try {
    model->forward(torch::randn({2, 6})).sum().backward();
    throw std::runtime_error("the in-place update of an original parameter was not reported");
  } catch (const std::exception& e) {
    WORKER_CHECK(contains(e.what(), "in-place operation aten::mul_ on parameter 'layers.0.weight'"), e.what());
  }
  std::cout << "wrong optimizer detected" << std::endl;
}

TEST(BadInput, OptimizerOverOriginalParametersIsDetected) {
  auto r = launch("wrong_optimizer_worker", 2, {}, 120);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

class EnvGuard {
 public:
  explicit EnvGuard(std::vector<std::pair<std::string, const char*>> vars) {
    for (const char* n : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
      unsetenv(n);
    for (auto& kv : vars) setenv(kv.first.c_str(), kv.second, 1);
  }
  ~EnvGuard() {
    for (const char* n : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(n);
  }
};

std::string env_error(std::vector<std::pair<std::string, const char*>> vars) {
  EnvGuard g(std::move(vars));
  try {
    fsdp::RankEnv::from_env();
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "";
}

TEST(BadInput, RankEnvironmentErrorsNameTheVariable) {
  EXPECT_TRUE(contains(env_error({{"RANK", "0"}}), "WORLD_SIZE"));
  EXPECT_TRUE(contains(env_error({{"WORLD_SIZE", "2"}}), "RANK is not"));
  EXPECT_TRUE(contains(env_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK=2 is not below WORLD_SIZE=2"));
  EXPECT_TRUE(contains(env_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK='x' is not an integer"));
  EXPECT_TRUE(contains(env_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}), "MASTER_ADDR is not set"));
  EXPECT_TRUE(contains(env_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), "MASTER_PORT"));
  EnvGuard none({});
  EXPECT_EQ(fsdp::RankEnv::from_env().world_size, 1);  // no launcher: a world of one
}

TEST(BadInput, UnknownStrategyName) {
  try {
    fsdp::parse_sharding_strategy("FULLSHARD");
    FAIL();
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD"));
  }
}

// A rank that dies mid-training makes the others fail fast (TCP: the connection closes; shared
// memory: its liveness lock is released by the kernel), not hang.
FSDP_WORKER(dead_rank_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  for (int step = 0; step < 50; ++step) {
    if (step == 2 && ctx.rank == 1) _exit(3);
    opt.zero_grad();
    model->forward(torch::randn({2, 6})).sum().backward();
    opt.step();
  }
}

class DeadRankTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeadRankTest, MakesTheOthersFailFast) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = launch("dead_rank_worker", 3, {}, 60, {"FSDP_TRANSPORT=" + GetParam()});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.timed_out) << r.report();
  EXPECT_EQ(r.ranks[1].exit_code, 3);
  EXPECT_NE(r.ranks[0].exit_code, 0) << r.report();
  EXPECT_NE(r.ranks[2].exit_code, 0) << r.report();
  EXPECT_LT(seconds, 30) << r.report();
}

INSTANTIATE_TEST_SUITE_P(BadInput, DeadRankTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace fsdp_test
