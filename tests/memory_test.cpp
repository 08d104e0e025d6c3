// Memory accounting: peak parameter and gradient storage equal their formulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

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
      {"per-linear+both-prefetch+limit-3", full, per_linear, BackwardPrefetch::kBackwardPre, true, 3},
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
    // BACKWARD_PRE and forward prefetch keep the next K - 1 units unsharded beside the current one
    // (K: the limiter's, 2 without it; Note [Prefetch depth]): the largest K units adjacent in
    // execution order (module order here) count instead. BACKWARD_POST gathers the next unit after
    // resharding the current one.
    const int window = c.all_gather_limit >= 2 ? c.all_gather_limit : 2;
    int64_t shards = 0, largest = 0, all_padded = 0, largest_window = 0;
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
      if (i >= size_t(window)) {
        int64_t sum = 0;
        for (int k = 0; k < window; ++k) sum += units[i - k].padded_bytes;
        largest_window = std::max(largest_window, sum);
      }
    }
    const std::string name = c.name;
    const bool flat = name != "by-size-150";
    if (flat && units[0].padded_bytes == 0 && c.strategy == full) {
      int64_t max_unit = 0;
      for (const auto& u : units) max_unit = std::max(max_unit, u.padded_bytes);
      WORKER_CHECK(largest == max_unit, "flat wrapping: the chain figure must equal the largest unit");
    }
    const bool prefetching = units.size() > size_t(window) && c.all_gather_limit != 1 &&
                             (c.prefetch == BackwardPrefetch::kBackwardPre || c.forward_prefetch);
    if (prefetching) WORKER_CHECK(units[0].padded_bytes == 0, "the prefetch formula assumes an empty root");
    int64_t expected = 0;
    switch (c.strategy) {
      case fsdp::ShardingStrategy::kFullShard: expected = shards + (prefetching ? largest_window : largest); break;
      case fsdp::ShardingStrategy::kShardGradOp: expected = shards + all_padded; break;
      default: expected = all_padded; break;  // NO_SHARD: the flat buffer is the replica
    }
    WORKER_CHECK(
        sharded->memory_stats().param_bytes == (c.strategy == fsdp::ShardingStrategy::kNoShard ? all_padded : shards),
        c.name, ": resting parameter bytes ", sharded->memory_stats().param_bytes);
    for (int step = 0; step < 3; ++step) {  // forward prefetch starts in the second iteration
      sharded->reset_peak_memory_stats();
      opt.zero_grad();
      model->forward(torch::randn({4, 7})).pow(2).mean().backward();
      opt.step();
      const auto m = sharded->memory_stats();
      WORKER_CHECK(m.param_peak_bytes == expected, fsdp::to_string(c.strategy), " ", c.name, ": peak parameter bytes ",
                   m.param_peak_bytes, " != expected ", expected, " (shards ", shards, ", largest unit ", largest,
                   ", largest ", window, " adjacent units ", largest_window, ", all units ", all_padded, ")");
    }
    if (ctx.rank == 0)
      std::cout << fsdp::to_string(c.strategy) << " " << c.name << " units " << sharded->units().size() << " peak "
                << expected << " bytes ok" << std::endl;
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
          zero_grad_in_place(opt);  // the pieces' gradients stay, zeroed
          model->forward(torch::randn({4, 7})).pow(2).mean().backward();
          opt.step();
          const auto m = sharded->memory_stats();
          if (step == 0) continue;  // the pieces' gradients are created during the first backward
          const int64_t expected = m.grad_bytes + transient;
          WORKER_CHECK(m.grad_peak_bytes == expected, fsdp::to_string(strategy), ", ", in_flight,
                       " reductions in flight, ", slow_network ? "slow modeled" : "loopback", " network, step ", step,
                       ": peak gradient bytes ", m.grad_peak_bytes, " != expected ", expected, " (pieces ",
                       m.grad_bytes, " + transient ", transient, ")");
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

}  // namespace
}  // namespace fsdp_test
