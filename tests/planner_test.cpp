// The planner (include/fsdp/planner.h, cluster.h): clusters and sizes parse; predicted FSDP memory
// equals what the runtime measures; known answers for activation checkpointing, CPU offload and a
// model that fits nowhere.
#include <gtest/gtest.h>
#include <malloc.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/cluster.h"
#include "fsdp/fsdp.h"
#include "fsdp/planner.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

TEST(Planner, ParsesClustersAndSizes) {
  const fsdp::Cluster paper = fsdp::Cluster::parse("paper:16x8");
  EXPECT_EQ(paper.world(), 128);
  EXPECT_EQ(paper.ranks_per_node, 8);
  EXPECT_DOUBLE_EQ(paper.inter.bandwidth_gbps(), 25.0);  // 2 Tb/s per node over 8 GPUs
  EXPECT_DOUBLE_EQ(paper.link_for_group(8).bandwidth_gbps(), paper.intra.bandwidth_gbps());
  // Across nodes, one ring per GPU of a node, each crossing on its own GPU's link: 8 x 25 GB/s,
  // below NVLink's 8/7 x 300.
  EXPECT_DOUBLE_EQ(paper.link_for_group(16).bandwidth_gbps(), 200.0);
  EXPECT_DOUBLE_EQ(paper.link_for_group(128).bandwidth_gbps(), 200.0);
  EXPECT_DOUBLE_EQ(paper.link_for_group(16).latency_us(), paper.inter.latency_us());
  // Groups of 12 over nodes of 8 hold 4 ranks of some node: 4 x 25.
  EXPECT_DOUBLE_EQ(fsdp::Cluster::parse("paper:3x8").link_for_group(12).bandwidth_gbps(), 100.0);
  fsdp::Cluster slow_within = paper;
  slow_within.intra.bandwidth_gbps(14);  // the rings' hops within a node bound them: 8/7 x 14
  EXPECT_DOUBLE_EQ(slow_within.link_for_group(16).bandwidth_gbps(), 16.0);
  // The largest world a spec takes: the groups' pattern on the nodes, not every group, is looked at.
  EXPECT_DOUBLE_EQ(fsdp::Cluster::parse("paper:2097152x8").link_for_group(12).bandwidth_gbps(), 100.0);
  fsdp::Cluster one_per_node = fsdp::Cluster::parse("paper:4x1");
  EXPECT_DOUBLE_EQ(one_per_node.link_for_group(4).bandwidth_gbps(), one_per_node.inter.bandwidth_gbps());
  EXPECT_EQ(fsdp::Cluster::parse("a100-80g:2x8").device.memory_bytes, 80 * 1024 * kMiB);
  EXPECT_EQ(fsdp::Cluster::parse("cpu:1x4").world(), 4);
  const fsdp::Cluster custom = fsdp::Cluster::from_json(
      R"({"preset": "h100", "nodes": 4, "ranks_per_node": 8, "device": {"memory_gib": 40},
          "inter": {"bandwidth_gbps": 12.5, "latency_us": 3}})");
  EXPECT_EQ(custom.world(), 32);
  EXPECT_EQ(custom.device.memory_bytes, 40 * 1024 * kMiB);
  EXPECT_DOUBLE_EQ(custom.inter.bandwidth_gbps(), 12.5);
  EXPECT_DOUBLE_EQ(custom.inter.latency_us(), 3.0);
  EXPECT_EQ(fsdp::parse_bytes("40GiB"), 40 * 1024 * kMiB);
  EXPECT_EQ(fsdp::parse_bytes("70 GB"), int64_t(70e9));
  EXPECT_EQ(fsdp::parse_bytes("512MiB"), 512 * kMiB);
  EXPECT_EQ(fsdp::parse_bytes("2 PiB"), int64_t{2} << 50);
  EXPECT_EQ(fsdp::parse_bytes("7EiB"), int64_t{7} << 60);
  EXPECT_EQ(fsdp::parse_bytes("1.5PB"), int64_t{1500000000000000});
  EXPECT_EQ(fsdp::parse_bytes("9223372036854775807"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(fsdp::parse_bytes("9007199254740993 B"), int64_t{9007199254740993});
  EXPECT_THROW(fsdp::Cluster::parse("tpu:1x8"), fsdp::Error);
  EXPECT_THROW(fsdp::Cluster::parse("a100-80g:8"), fsdp::Error);
  EXPECT_THROW(fsdp::Cluster::from_json(R"({"intra": {"bandwidth_gbps": -1}})"), fsdp::Error);
  EXPECT_THROW(fsdp::parse_bytes("40 parsecs"), fsdp::Error);
}

// One candidate: every list of the request holds one value.
fsdp::PlanRequest single(fsdp::ShardingStrategy strategy, at::ScalarType precision, int limit,
                         fsdp::BackwardPrefetch prefetch, bool forward_prefetch, int in_flight, int reshard_size = 0,
                         int micro_batch = 2, bool no_sync = false, bool grads_kept = true,
                         bool replica_deferred = false, bool keep_unsharded = false) {
  return fsdp::PlanRequest()
      .world(4)
      .global_batch(8)
      .seq_len(8)
      .strategies({strategy})
      .hybrid_factors({2})
      .wrap_policies({{"block", fsdp::wrap::by_type<BlockImpl>()}})
      .reshard_after_forward_sizes({reshard_size})
      .activation_checkpointing({false})
      .cpu_offload({false})
      .precisions({precision})
      .all_gather_limits({limit})
      .backward_prefetch({prefetch})
      .forward_prefetch({forward_prefetch})
      .reductions_in_flight({in_flight})
      .micro_batches({micro_batch})
      .no_sync({no_sync})
      .replica_deferred({replica_deferred})
      .keep_unsharded({keep_unsharded})
      .grads_kept_between_steps(grads_kept);
}

// The planner's parameter and gradient peaks against memory_stats() after real steps.
FSDP_WORKER(planner_memory_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  using fsdp::BackwardPrefetch;
  using fsdp::ShardingStrategy;
  struct Case {
    ShardingStrategy strategy;
    at::ScalarType precision;
    int limit;
    BackwardPrefetch prefetch;
    bool forward_prefetch;
    int in_flight;
    int reshard_size = 0;  // hpZ
    int micro_batch = 2;   // of the 2 sequences per rank
    bool no_sync = false;
    bool grads_kept = true;         // false: the pieces' gradients dropped between steps (LibTorch 2's zero_grad)
    bool frozen_qkv = false;        // every block's attention input weights frozen (a frozen base, as under LoRA)
    bool replica_deferred = false;  // HYBRID_SHARD: only the last micro-batch reduces across replicas
    bool keep_unsharded = false;    // no_sync: parameters left unsharded from one micro-batch to the next
    int64_t int8_gathers = 0;       // values per scale of int8 all-gathers (0: unquantized)
    int64_t int8_reductions = 0;    // values per scale of int8 gradient reductions (0: unquantized)
    std::string reshard_policy{};   // "true", "false" or "except-last" for every block; empty: none
    bool feedback = false;          // quantized reductions with error feedback
    bool step_in_backward = false;  // the optimizer steps each unit in backward (set_step_in_backward)
    bool deterministic = false;     // exact reductions (Options::deterministic)
  };
  const auto pre = BackwardPrefetch::kBackwardPre;
  std::vector<Case> cases;
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                       ShardingStrategy::kHybridShard})
    for (const auto p : {at::kFloat, at::kBFloat16}) cases.push_back({s, p, 2, pre, true, 2});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 3, pre, true, 2});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 0, pre, true, 2});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 2, BackwardPrefetch::kBackwardPost, false, 1});
  cases.push_back({ShardingStrategy::kFullShard, at::kBFloat16, 2, BackwardPrefetch::kNone, false, 0});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 1, pre, true, 3});
  for (const auto p : {at::kFloat, at::kBFloat16})
    cases.push_back({ShardingStrategy::kFullShard, p, 2, pre, true, 2, 2});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 1, BackwardPrefetch::kBackwardPost, false, 1, 2});
  // Two micro-batches of one sequence, each reducing or (no_sync) only the last.
  for (const bool no_sync : {false, true})
    for (const auto p : {at::kFloat, at::kBFloat16})
      cases.push_back({ShardingStrategy::kFullShard, p, 2, pre, true, 2, 0, 1, no_sync});
  for (const auto s : {ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard})
    cases.push_back({s, at::kFloat, 2, pre, true, 1, 0, 1, true});
  cases.push_back({ShardingStrategy::kNoShard, at::kBFloat16, 2, pre, true, 1, 0, 1, true});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 1, 0, 1, true});
  cases.push_back({ShardingStrategy::kFullShard, at::kBFloat16, 2, pre, true, 1, 2, 1, true});
  for (const bool no_sync : {false, true})  // the first micro-batch leaves the pieces holding gradients
    cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 1, no_sync, false});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 2, false, false});
  for (const auto p : {at::kFloat, at::kBFloat16})
    cases.push_back({ShardingStrategy::kFullShard, p, 2, pre, true, 2, 0, 2, false, true, true});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 1, pre, true, 1, 0, 2, false, true, true});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 2, BackwardPrefetch::kBackwardPost, false, 1, 0, 2, false,
                   true, true});
  cases.push_back({ShardingStrategy::kShardGradOp, at::kFloat, 2, pre, true, 2, 0, 2, false, true, true});
  cases.push_back({ShardingStrategy::kHybridShard, at::kBFloat16, 2, pre, true, 2, 0, 2, false, true, true});
  // Two micro-batches, the replica all-reduce at the last only, gradients kept or dropped.
  for (const auto p : {at::kFloat, at::kBFloat16})
    for (const bool kept : {true, false})
      cases.push_back({ShardingStrategy::kHybridShard, p, 2, pre, true, 2, 0, 1, false, kept, false, true});
  cases.push_back({ShardingStrategy::kHybridShard, at::kFloat, 2, BackwardPrefetch::kBackwardPost, false, 1, 0, 1,
                   false, true, false, true});
  // Two micro-batches under no_sync, the first leaving the parameters unsharded for the second.
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kHybridShard})
    for (const auto p : {at::kFloat, at::kBFloat16})
      cases.push_back({s, p, 2, pre, true, 2, 0, 1, true, true, false, false, true});
  cases.push_back({ShardingStrategy::kFullShard, at::kFloat, 1, BackwardPrefetch::kBackwardPost, false, 1, 0, 1, true,
                   false, false, false, true});
  cases.push_back({ShardingStrategy::kFullShard, at::kBFloat16, 2, pre, true, 2, 2, 1, true, true, false, false, true});
  // Quantized collectives (every unit but the root): their packed buffers.
  auto quantized = [&](Case c, int64_t gathers, int64_t reductions) {
    c.int8_gathers = gathers;
    c.int8_reductions = reductions;
    cases.push_back(c);
  };
  for (const auto p : {at::kFloat, at::kBFloat16}) {
    quantized({ShardingStrategy::kFullShard, p, 2, pre, true, 2}, 256, 0);
    quantized({ShardingStrategy::kFullShard, p, 2, pre, true, 2}, 0, 256);
  }
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                       ShardingStrategy::kHybridShard})
    quantized({s, at::kFloat, 2, pre, true, 2}, 64, 64);
  quantized({ShardingStrategy::kFullShard, at::kBFloat16, 1, BackwardPrefetch::kBackwardPost, false, 1, 2}, 256, 256);
  quantized({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 1, true}, 256, 256);
  quantized({ShardingStrategy::kHybridShard, at::kFloat, 2, pre, true, 2, 0, 1, false, true, false, true}, 256, 256);
  // Error feedback: its residuals, by collective (reduce-scatter, NO_SHARD's and the replicas' all-reduces).
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    Case c{s, at::kBFloat16, 2, pre, true, 2};
    c.int8_reductions = 64;
    c.feedback = true;
    cases.push_back(c);
  }
  // The optimizer's step in backward: no piece gradients between steps.
  auto stepping = [&](Case c) {
    c.step_in_backward = true;
    cases.push_back(c);
  };
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                       ShardingStrategy::kHybridShard})
    stepping({s, at::kBFloat16, 2, pre, true, 2});
  stepping({ShardingStrategy::kNoShard, at::kFloat, 2, pre, true, 2});  // the flat's own storage holds its gradient
  stepping({ShardingStrategy::kNoShard, at::kFloat, 2, pre, true, 1, 0, 2, false, false});
  stepping({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 2, false, false});
  stepping({ShardingStrategy::kFullShard, at::kFloat, 1, BackwardPrefetch::kBackwardPost, false, 1, 2});
  stepping({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 2, false, true, false, false, false, 0, 256});
  // Stepping in the last of two micro-batches under no_sync; NO_SHARD in float32 accumulates in its own storage.
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard})
    for (const auto p : {at::kFloat, at::kBFloat16}) stepping({s, p, 2, pre, true, 2, 0, 1, true});
  stepping({ShardingStrategy::kHybridShard, at::kFloat, 2, pre, true, 2, 0, 1, true, false});
  stepping({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 1, true, true, false, false, true});
  // Deterministic training: each FlatParameter's exact sums, its exact collective's buffers.
  auto exact = [&](Case c) {
    c.deterministic = true;
    cases.push_back(c);
  };
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                       ShardingStrategy::kHybridShard})
    for (const auto p : {at::kFloat, at::kBFloat16}) exact({s, p, 2, pre, true, 2});
  exact({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 1, true});
  exact({ShardingStrategy::kNoShard, at::kBFloat16, 2, pre, true, 1, 0, 1, true});
  exact({ShardingStrategy::kFullShard, at::kFloat, 1, BackwardPrefetch::kBackwardPost, false, 1, 2});
  for (const auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    Case c{s, at::kBFloat16, 2, pre, true, 2};  // with the optimizer's step in backward
    c.step_in_backward = true;
    exact(c);
  }
  // A reshard-after-forward policy for every block: no unit kept for backward by the strategy.
  auto by_policy = [&](Case c, const std::string& policy) {
    c.reshard_policy = policy;
    cases.push_back(c);
  };
  for (const auto p : {at::kFloat, at::kBFloat16}) {
    by_policy({ShardingStrategy::kFullShard, p, 2, pre, true, 2}, "true");
    by_policy({ShardingStrategy::kFullShard, p, 2, pre, true, 2}, "except-last");
  }
  by_policy({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2}, "false");
  by_policy({ShardingStrategy::kShardGradOp, at::kFloat, 2, pre, true, 2}, "except-last");
  by_policy({ShardingStrategy::kHybridShard, at::kBFloat16, 2, pre, true, 2}, "except-last");
  by_policy({ShardingStrategy::kFullShard, at::kFloat, 1, BackwardPrefetch::kBackwardPost, false, 1}, "true");
  by_policy({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 2}, "except-last");
  by_policy({ShardingStrategy::kFullShard, at::kBFloat16, 2, pre, true, 2, 2}, "true");
  by_policy({ShardingStrategy::kShardGradOp, at::kFloat, 2, pre, true, 2, 2}, "true");
  by_policy({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 1, 0, 1, true}, "except-last");
  by_policy({ShardingStrategy::kFullShard, at::kFloat, 2, pre, true, 2, 0, 1, true, true, false, false, true}, "true");
  const auto cluster = fsdp::Cluster::parse("cpu:1x4");
  int checked = 0;
  for (const Case& c : cases) {
    torch::manual_seed(5);
    TinyTransformer model(50, 16, 2, 3, 8);
    if (c.frozen_qkv)
      for (auto& b : *model->blocks) b->as<BlockImpl>()->qkv->weight.requires_grad_(false);
    auto request = single(c.strategy, c.precision, c.limit, c.prefetch, c.forward_prefetch, c.in_flight, c.reshard_size,
                          c.micro_batch, c.no_sync, c.grads_kept, c.replica_deferred, c.keep_unsharded);
    if (c.int8_gathers > 0) request.all_gather_quantization(fsdp::Quantization::int8(c.int8_gathers));
    if (c.int8_reductions > 0)
      request.reduce_quantization(fsdp::Quantization::int8(c.int8_reductions).error_feedback(c.feedback));
    if (c.step_in_backward) request.step_in_backward({true});
    request.deterministic(c.deterministic);
    if (!c.reshard_policy.empty())
      request.reshard_after_forward_policy(
          [policy = c.reshard_policy](const std::string& name, const torch::nn::Module&) {
            return c10::optional<bool>(policy == "true" || (policy == "except-last" && name != "blocks.2"));
          });
    const fsdp::Plan plan = fsdp::plan(*model, cluster, request);
    WORKER_CHECK(plan.entries.size() == 1, "expected one candidate, got ", plan.entries.size());
    const fsdp::PlanEntry& e = plan.entries.front();
    auto sharded = fsdp::fully_shard(model, pg, e.candidate.options());
    torch::optim::SGD opt(sharded->parameters(), 0.01);
    WORKER_CHECK(e.candidate.step_in_backward == c.step_in_backward, e.candidate.describe());
    WORKER_CHECK(e.candidate.options().deterministic() == c.deterministic, e.candidate.describe());
    if (c.step_in_backward) sharded->set_step_in_backward(&opt);
    for (int step = 0; step < 3; ++step) {
      sharded->reset_peak_memory_stats();
      if (c.grads_kept) {
        zero_grad_in_place(opt);
      } else {
        for (auto& p : sharded->parameters()) p.mutable_grad() = at::Tensor();
      }
      const int k = e.candidate.accumulation;
      for (int m = 0; m < k; ++m) {
        std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
        if (e.candidate.no_sync && m + 1 < k) no_sync.emplace(sharded->no_sync());
        if (e.candidate.replica_deferred) sharded->set_requires_all_reduce(m + 1 == k);
        if (e.candidate.keep_unsharded) sharded->set_reshard_after_backward(m + 1 == k);
        auto x = torch::randint(50, {e.candidate.micro_batch, 8}, torch::kLong);
        lm_loss(model->forward(x), x).backward();
      }
      opt.step();
      const auto m = sharded->memory_stats();
      // The first step: forward prefetch and the pieces' gradients begin here, so its peaks stay below
      // the steady ones; but under hpZ its backward gathers the last unit from the part kept after
      // forward (the steady steps keep that unit whole), one part more (docs/planner.md).
      if (step == 0) {
        int64_t part = 0;  // hpZ: one part of the last block, in the compute dtype
        if (c.reshard_size > 0) {
          int64_t numel = 0;
          for (const auto& p : model->blocks->ptr(model->blocks->size() - 1)->parameters()) numel += p.numel();
          part = (numel + 3) / 4 * 4 / c.reshard_size * static_cast<int64_t>(c10::elementSize(c.precision));
        }
        WORKER_CHECK(m.param_peak_bytes <= e.memory.params + part && m.grad_peak_bytes <= e.memory.grads,
                     e.candidate.describe(), ": the first step's peaks ", m.param_peak_bytes, " and ",
                     m.grad_peak_bytes, " exceed the predicted ", e.memory.params, " and ", e.memory.grads);
        continue;
      }
      WORKER_CHECK(m.param_peak_bytes == e.memory.params, e.candidate.describe(), ": parameter peak measured ",
                   m.param_peak_bytes, ", predicted ", e.memory.params);
      // Residuals: rank 0 sums the first part of each all-reduce, a full one; the last ranks' may be shorter.
      WORKER_CHECK(ctx.rank == 0 ? m.feedback_bytes == e.memory.feedback : m.feedback_bytes <= e.memory.feedback,
                   e.candidate.describe(), ": error feedback's residuals measured ", m.feedback_bytes, ", predicted ",
                   e.memory.feedback);
      WORKER_CHECK(c.feedback == (e.memory.feedback > 0), e.candidate.describe(), ": residuals predicted ",
                   e.memory.feedback);
      if (c.int8_reductions == 0) {
        WORKER_CHECK(m.grad_peak_bytes == e.memory.grads, e.candidate.describe(), ": gradient peak measured ",
                     m.grad_peak_bytes, ", predicted ", e.memory.grads);
        continue;
      }
      // Quantized reductions: a replica all-reduce's packed parts differ by rank (the scales of the
      // parameters its shard cuts), and the prediction is the largest rank's. A reduce-scatter
      // chained to that all-reduce frees its packed buffers on the replica thread as the all-reduce
      // starts; the replay holds them until it lands: a bound there.
      auto measured = torch::full({1}, static_cast<double>(m.grad_peak_bytes), torch::kDouble);
      auto every = torch::empty({pg->size()}, torch::kDouble);
      pg->world()->all_gather_into(every, measured)->wait();
      const auto most = static_cast<int64_t>(every.max().item<double>());
      const bool chained = c.strategy == ShardingStrategy::kHybridShard && !c.replica_deferred;
      WORKER_CHECK(m.grad_peak_bytes <= e.memory.grads && (chained || most == e.memory.grads), e.candidate.describe(),
                   ": gradient peak measured ", m.grad_peak_bytes, " (the largest rank's ", most, "), predicted ",
                   e.memory.grads);
    }
    ++checked;
  }
  if (ctx.rank == 0) std::cout << "planner memory: " << checked << " configurations exact" << std::endl;
}

TEST(Planner, PredictsTheRuntimesParameterAndGradientPeaksExactly) {
  auto r = launch("planner_memory_worker", 4);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "configurations exact")) << r.report();
}

// A stack of MLP blocks: each keeps its input (d values per token) and its hidden layer (4d).
struct StackImpl : torch::nn::Module {
  StackImpl(int d, int depth) {
    for (int i = 0; i < depth; ++i)
      blocks->push_back(torch::nn::Sequential(torch::nn::Linear(d, 4 * d), torch::nn::Linear(4 * d, d)));
    register_module("blocks", blocks);
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(Stack);

fsdp::PlanRequest one_rank(int64_t budget) {
  return fsdp::PlanRequest()
      .memory_budget(budget)
      .global_batch(1)
      .seq_len(4096)
      .wrap_policies({{"block", fsdp::wrap::by_type<torch::nn::SequentialImpl>()}})
      .precisions({at::kFloat})
      .checkpointed_shares({1})  // every block or none; AModelThatFitsOnlyWithActivationCheckpointing tries some
      .grads_kept_between_steps(true);
}

// One FULL_SHARD candidate at 16 ranks of the paper's cluster, one sequence of 64 tokens each: for
// Stack(2048, 4), a step the network bounds.
fsdp::PlanRequest network_bound() {
  return one_rank(0)
      .world(16)
      .global_batch(16)
      .seq_len(64)
      .micro_batches({1})
      .strategies({fsdp::ShardingStrategy::kFullShard})
      .reshard_after_forward_sizes({0})
      .activation_checkpointing({false})
      .cpu_offload({false});
}

// Checkpointed candidates of a model without fsdp::Checkpointed modules cannot be applied as
// planned, and a model without parameters gives FSDP nothing: the plan says so, and says nothing
// where neither holds.
TEST(Planner, NotesModelsWithoutCheckpointedModulesOrParameters) {
  auto notes_of = [](torch::nn::Module& model) {
    std::string all;
    for (const auto& n : fsdp::plan(model, fsdp::Cluster::parse("cpu:1x1"), one_rank(0)).notes) all += n + "\n";
    return all;
  };
  fsdp::DeferredInit deferred;
  Stack plain(16, 2);
  EXPECT_TRUE(contains(notes_of(*plain), "holds no fsdp::Checkpointed module")) << notes_of(*plain);
  torch::nn::Sequential wrapped;
  for (int i = 0; i < 2; ++i)
    wrapped->push_back(fsdp::Checkpointed<torch::nn::Sequential>(torch::nn::Sequential(torch::nn::Linear(16, 16))));
  EXPECT_FALSE(contains(notes_of(*wrapped), "holds no fsdp::Checkpointed module")) << notes_of(*wrapped);
  torch::nn::Sequential empty{torch::nn::ReLU()};
  EXPECT_TRUE(contains(notes_of(*empty), "the model has no parameters")) << notes_of(*empty);
  EXPECT_FALSE(contains(notes_of(*plain), "the model has no parameters")) << notes_of(*plain);
}

// Values no run can have are refused with the setting named, not planned into absurd figures.
TEST(Planner, RefusesRequestsAndClustersNoRunCanHave) {
  expect_error([] { fsdp::Cluster::parse("a100-80g:65536x65536"); }, "at most 2^24", "a world past int");
  for (const char* size : {"99999999TiB", "inf", "nan", "-1GiB", "0x10", "8EiB", "9223372036854775808", "9.3EB"})
    expect_error([&] { fsdp::parse_bytes(size); }, "from 0 to 8 EiB", size);
  auto json = [](const std::string& text) {
    return [text] {
      fsdp::Cluster::from_json(text);
    };
  };
  expect_error(json(R"({"nodez": 4})"), "unknown key \"nodez\"", "a misspelled key");
  expect_error(json(R"({"device": {"memory_gb": 40}})"), "unknown key \"memory_gb\"", "a misspelled device key");
  expect_error(json(R"({"nodes": 2.5})"), "\"nodes\" must be a whole number", "a fractional node count");
  expect_error(json(R"({"device": {"memory_gib": 0}})"), "\"memory_gib\" must be a positive number", "no memory");
  expect_error(json(R"({"device": {"memory_gib": 1e30}})"), "\"memory_gib\" must be a positive number of at most",
               "memory past int64");
  expect_error(json(R"({"device": {"matmul_efficiency": 5}})"),
               "\"matmul_efficiency\" must be a positive number of at most 1", "an efficiency above 1");
  expect_error(json(R"({"preset": 3})"), "\"preset\" must be a preset's name", "a numeric preset");
  expect_error(json(R"({"preset": "a100-80g", "host_device_gbps": 0})"),
               "\"host_device_gbps\" must be a positive number", "no host link for offload");
  EXPECT_EQ(fsdp::Cluster::from_json(R"({"host_device_gbps": 0})").host_device_gbps, 0);  // the CPU: the host itself
  expect_error(json(R"({"nodes": 2, "nodes": 4})"), "the key \"nodes\" appears twice", "a repeated key");
  expect_error(json(R"({"intra": {"latency_us": 1, "latency_us": 2}})"), "the key \"latency_us\" appears twice",
               "a repeated key inside a link");
  EXPECT_EQ(fsdp::Cluster::from_json(R"({"intra": {"latency_us": 1}, "inter": {"latency_us": 2}})").inter.latency_us(),
            2);
  // Paths: a directory, a missing file, and a file whose name neither ends in .json nor is a preset's.
  const TempDir dir;
  expect_error([&] { fsdp::Cluster::parse(dir.path); }, "not a regular file", "a directory");
  expect_error([&] { fsdp::Cluster::parse(dir / "none.json"); }, "no such file", "a missing file");
  std::ofstream(dir / "cluster.txt") << R"({"preset": "cpu", "nodes": 1, "ranks_per_node": 3})";
  EXPECT_EQ(fsdp::Cluster::parse(dir / "cluster.txt").world(), 3);
  EXPECT_EQ(fsdp::Cluster::parse(" cpu:1x4\n").world(), 4);
  EXPECT_EQ(fsdp::Cluster::parse("h100 ").ranks_per_node, 8);
  // A preset's name alone, or JSON without a shape: one node of the preset's ranks per node.
  EXPECT_EQ(fsdp::Cluster::parse("h100").ranks_per_node, 8);
  EXPECT_EQ(fsdp::Cluster::from_json(R"({"preset": "h100", "nodes": 3})").world(), 24);
  EXPECT_EQ(fsdp::format_bytes(1023), "1023 B");
  EXPECT_EQ(fsdp::format_bytes(-5), "-5 B");
  EXPECT_EQ(fsdp::format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(fsdp::format_bytes(int64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(fsdp::format_bytes(std::numeric_limits<int64_t>::max()), "8.00 EiB");

  fsdp::DeferredInit deferred;
  Stack model(16, 2);
  const auto cluster = fsdp::Cluster::parse("cpu:1x2");
  auto plan_with = [&](std::function<void(fsdp::PlanRequest&)> change) {
    return [&model, &cluster, change] {
      auto request = one_rank(0).global_batch(4);
      change(request);
      fsdp::plan(*model, cluster, request);
    };
  };
  using R = fsdp::PlanRequest;
  expect_error(plan_with([](R& r) { r.precisions({at::kDouble}); }), "the compute precisions are",
               "a double precision");
  expect_error(plan_with([](R& r) { r.optimizer_states(-2); }), "optimizer_states is -2", "negative states");
  expect_error(plan_with([](R& r) { r.process_bytes(-1); }), "process_bytes is -1", "negative process bytes");
  expect_error(plan_with([](R& r) { r.allocator_headroom(-0.9); }), "allocator_headroom is -0.9", "negative headroom");
  expect_error(plan_with([](R& r) { r.global_batch(-4); }), "global_batch is -4", "a negative batch");
  expect_error(plan_with([](R& r) { r.memory_budget(-5); }), "memory_budget is -5", "a negative budget");
  expect_error(plan_with([](R& r) { r.world(3); }), "the cluster (1x2) has 2 ranks", "more ranks than the cluster");
  expect_error(plan_with([](R& r) { r.world(-2); }), "PlanRequest::world is -2", "a negative world");
  expect_error(plan_with([](R& r) { r.micro_batches({3}); }), "no size in PlanRequest::micro_batches divides the 2",
               "micro-batches that divide nothing");
  expect_error(plan_with([](R& r) { r.micro_batches({2, 0}); }), "micro_batches holds 0", "an empty micro-batch");
  {
    auto request = one_rank(0).global_batch(4).reshard_after_forward_sizes({0, 5});
    const auto notes = fsdp::plan(*model, cluster, request).notes;
    EXPECT_TRUE(std::any_of(notes.begin(), notes.end(), [](const std::string& n) {
      return contains(n, "sizes' 5 is planned nowhere");
    })) << "an hpZ size no shard group splits into";
  }
  expect_error(plan_with([](R& r) { r.no_sync({}); }), "PlanRequest::no_sync is empty", "no accumulation choice");
  expect_error(plan_with([](R& r) {
                 r.wrap_policies({{"same", nullptr}, {"same", fsdp::wrap::by_type<torch::nn::LinearImpl>()}});
               }),
               "names two policies 'same'", "two wrap policies of one name");
  bool half_products = true;
  try {
    at::mm(at::ones({1, 1}, at::kHalf), at::ones({1, 1}, at::kHalf));
  } catch (const std::exception&) {
    half_products = false;
  }
  if (!half_products)
    expect_error(plan_with([](R& r) {
                   r.precisions({at::kFloat, at::kHalf});
                 }),
                 "no fp16 matrix product on the CPU", "fp16 on a CPU that cannot multiply it");
  expect_error(plan_with([](R& r) { r.strategies({}); }), "PlanRequest::strategies is empty", "no strategy");
  expect_error(plan_with([](R& r) { r.all_gather_limits({-1}); }), "all_gather_limits holds -1", "a negative limit");
  expect_error(plan_with([](R& r) { r.strategies({fsdp::ShardingStrategy::kHybridShard}).hybrid_factors({3}); }),
               "nothing to plan: HYBRID_SHARD needs a sharding factor", "no hybrid factor");
  expect_error(plan_with([](R& r) {
                 r.activation_checkpointing({true}).wrap_policies({{"none", nullptr}});
               }),
               "nothing to plan: PlanRequest::activation_checkpointing holds only true", "nothing to checkpoint");
  expect_error(plan_with([](R& r) { r.checkpointed_shares({}); }), "PlanRequest::checkpointed_shares is empty",
               "no share of the units");
  expect_error(plan_with([](R& r) {
                 r.checkpointed_shares({0.5, 0});
               }),
               "checkpointed_shares holds 0", "a share of none");
  expect_error(plan_with([](R& r) { r.checkpointed_shares({1.5}); }), "checkpointed_shares holds 1.5",
               "a share above every unit");
  expect_error(plan_with([](R& r) { r.cpu_offload({true}); }), "nothing to plan: PlanRequest::cpu_offload",
               "offload where the device is the host");
}

TEST(Planner, AModelThatFitsOnlyWithActivationCheckpointing) {
  fsdp::DeferredInit deferred;
  Stack model(256, 4);
  const int64_t tokens = 4096, d = 256, block = 5 * d * tokens * 4;  // bytes one block keeps
  const int64_t input = d * tokens * 4;                              // what a checkpointed block keeps
  const int64_t params = 4 * (2 * 4 * d * d + 4 * d + d) * 4;
  // One rank: no shards to gather, gradients reduced in place; AdamW holds two states. Checkpointed
  // candidates checkpoint the first 1, 2 or 3 blocks, or all 4.
  auto request = [](int64_t budget) {
    return one_rank(budget).checkpointed_shares(fsdp::PlanRequest().checkpointed_shares());  // the default
  };
  const fsdp::Plan loose = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request(0));
  ASSERT_EQ(loose.entries.size(), 5U) << loose.table();
  std::vector<int64_t> peak(5, 0);
  std::vector<double> step(5, 0);
  for (const auto& e : loose.entries) {
    EXPECT_EQ(e.memory.params, params);
    EXPECT_EQ(e.memory.grads, params);
    EXPECT_EQ(e.memory.optimizer, 2 * params);
    const fsdp::Candidate& c = e.candidate;
    const int k = !c.activation_checkpointing ? 0 : c.checkpointed_units > 0 ? c.checkpointed_units : 4;
    // Each checkpointed block keeps its input; backward recomputes one at a time, after the later
    // blocks' backward freed theirs.
    EXPECT_EQ(e.memory.activations, k == 0 ? 4 * block : std::max((4 - k) * block + k * input, k * input + block))
        << c.describe();
    ASSERT_EQ(e.candidate.checkpointed_unit_names.size(), static_cast<size_t>(k)) << c.describe();
    for (int i = 0; i < k; ++i) EXPECT_EQ(c.checkpointed_unit_names[i], "blocks." + std::to_string(i));
    const fsdp::WrapPolicy policy = c.checkpoint_policy();
    EXPECT_EQ(static_cast<bool>(policy), k > 0);
    if (k > 0 && k < 4) {
      EXPECT_TRUE(policy("blocks." + std::to_string(k - 1), *model, 0)) << c.describe();
      EXPECT_FALSE(policy("blocks." + std::to_string(k), *model, 0)) << c.describe();
    }
    peak[k] = e.memory.peak;
    step[k] = e.time.step_s;
  }
  for (int k = 1; k < 5; ++k) {  // each block more checkpointed: more time, less memory but for the last
    EXPECT_GT(step[k], step[k - 1]) << k;
    if (k < 4) {
      EXPECT_LT(peak[k], peak[k - 1]) << k;
    }
  }
  // The last block checkpointed too saves nothing: backward recomputes it first, beside every input.
  EXPECT_EQ(peak[4] - peak[3], input);
  // Between the first block checkpointed and the first two: the first two, the fastest that fits.
  const fsdp::Plan tight = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request((peak[1] + peak[2]) / 2));
  EXPECT_EQ(tight.best().candidate.checkpointed_units, 2) << tight.table();
  for (const auto& e : tight.entries)
    EXPECT_EQ(e.fits, e.candidate.activation_checkpointing && e.candidate.checkpointed_units != 1) << tight.table();
  // Every block only: a checkpointed candidate and one without.
  const fsdp::Plan every = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank((peak[1] + peak[2]) / 2));
  EXPECT_EQ(every.entries.size(), 2U);
  EXPECT_EQ(every.best().candidate.checkpointed_units, 0);
  EXPECT_TRUE(every.best().candidate.activation_checkpointing);
}

TEST(Planner, AModelThatFitsOnlyWithCpuOffload) {
  fsdp::DeferredInit deferred;
  Stack model(512, 4);
  const int64_t params = 4 * (2 * 4 * 512 * 512 + 4 * 512 + 512) * 4;
  auto request = one_rank(0).seq_len(16).activation_checkpointing({false});
  const auto cluster = fsdp::Cluster::parse("a100-80g:1x1");
  const fsdp::Plan loose = fsdp::plan(*model, cluster, request);
  ASSERT_EQ(loose.entries.size(), 2U);
  const fsdp::PlanEntry* resident = nullptr;
  for (const auto& e : loose.entries)
    if (!e.candidate.cpu_offload) resident = &e;
  ASSERT_NE(resident, nullptr);
  EXPECT_GE(resident->memory.peak, 4 * params);  // parameters, gradients, two AdamW states
  const fsdp::Plan tight = fsdp::plan(*model, cluster, request.memory_budget(2 * params));
  EXPECT_TRUE(tight.best().candidate.cpu_offload);
  EXPECT_EQ(tight.best().memory.optimizer, 0);
  EXPECT_EQ(tight.best().memory.host, 4 * params);
  EXPECT_FALSE(tight.entries.back().fits);
}

// Across nodes the search also keeps each resharded unit's parameters sharded over one node's
// ranks until backward (hpZ): more parameter memory, backward's gathers on the node's own links.
TEST(Planner, ReshardsToOneNodesRanksWhereTheJobSpansNodes) {
  fsdp::DeferredInit deferred;
  Stack model(512, 4);
  const auto cluster = fsdp::Cluster::parse("paper:2x8");
  auto request = one_rank(0)
                     .world(16)
                     .global_batch(16)
                     .seq_len(64)
                     .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp})
                     .activation_checkpointing({false})
                     .cpu_offload({false})
                     .backward_prefetch({fsdp::BackwardPrefetch::kNone});  // backward's gathers exposed
  const fsdp::Plan plan = fsdp::plan(*model, cluster, request);
  const fsdp::PlanEntry *plain = nullptr, *hpz = nullptr;
  int others = 0;
  for (const auto& e : plan.entries) {
    const auto& c = e.candidate;
    if (c.strategy == fsdp::ShardingStrategy::kFullShard && c.reshard_after_forward_size == 0) plain = &e;
    if (c.strategy == fsdp::ShardingStrategy::kFullShard && c.reshard_after_forward_size == 8) hpz = &e;
    if (c.strategy == fsdp::ShardingStrategy::kShardGradOp) {
      EXPECT_EQ(c.reshard_after_forward_size, 0) << c.describe();  // it keeps the whole unit anyway
      ++others;
    }
  }
  ASSERT_TRUE(plain != nullptr && hpz != nullptr) << plan.table();
  EXPECT_EQ(others, 1);
  EXPECT_EQ(hpz->candidate.options().reshard_after_forward_size(), 8);
  EXPECT_TRUE(contains(hpz->candidate.describe(), "reshard to groups of 8")) << hpz->candidate.describe();
  // A block's unsharded values (2,099,712 float32, split evenly over 16 ranks): hpZ holds an eighth
  // of them for each block resharded after forward, at most the three not kept for backward.
  const int64_t block = 2099712LL * 4, part = block / 8;
  EXPECT_GT(hpz->memory.params, plain->memory.params);
  EXPECT_LE(hpz->memory.params, plain->memory.params + 3 * part);
  EXPECT_EQ((hpz->memory.params - plain->memory.params) % part, 0);
  EXPECT_EQ(hpz->memory.grads, plain->memory.grads);
  // The inter-node link is 25 GB/s per GPU and NVLink's much faster: backward's gathers, which
  // nothing hides here, take less time.
  EXPECT_LT(hpz->time.exposed_comm_s, plain->time.exposed_comm_s);
  EXPECT_LT(hpz->time.step_s, plain->time.step_s);
  // Sizes that do not apply become 0; a negative one is refused.
  const fsdp::Plan odd = fsdp::plan(*model, cluster, request.reshard_after_forward_sizes({3, 16}));
  for (const auto& e : odd.entries) EXPECT_EQ(e.candidate.reshard_after_forward_size, 0);
  EXPECT_EQ(odd.entries.size(), 2U);
  EXPECT_THROW(fsdp::plan(*model, cluster, request.reshard_after_forward_sizes({-8})), fsdp::Error);
}

// The paper's cluster, 16 ranks, two micro-batches of one sequence per step, no hpZ, checkpointing
// or offload.
fsdp::PlanRequest two_micro_batches_on_two_nodes() {
  return one_rank(0)
      .world(16)
      .global_batch(32)
      .seq_len(64)
      .micro_batches({1})
      .reshard_after_forward_sizes({0})
      .activation_checkpointing({false})
      .cpu_offload({false});
}

// HYBRID_SHARD with accumulation may reduce across replicas only at the last micro-batch
// (set_requires_all_reduce): the earlier ones keep their shard group's sums, and the inter-node
// all-reduce runs once per step.
TEST(Planner, DefersTheReplicaAllReduceToTheLastMicroBatch) {
  fsdp::DeferredInit deferred;
  Stack model(512, 4);
  const auto cluster = fsdp::Cluster::parse("paper:2x8");
  auto request = two_micro_batches_on_two_nodes()
                     .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kHybridShard})
                     .hybrid_factors({8})
                     .keep_unsharded({false});
  const fsdp::Plan plan = fsdp::plan(*model, cluster, request);
  // FULL_SHARD: reduce, no_sync; HYBRID_SHARD: reduce, replica-deferred, no_sync.
  ASSERT_EQ(plan.entries.size(), 5U) << plan.table();
  const fsdp::PlanEntry *every = nullptr, *last = nullptr;
  for (const auto& e : plan.entries) {
    const auto& c = e.candidate;
    if (c.replica_deferred) {
      EXPECT_EQ(c.strategy, fsdp::ShardingStrategy::kHybridShard) << c.describe();
      EXPECT_FALSE(c.no_sync) << c.describe();
      EXPECT_TRUE(contains(c.describe(), "replica-deferred")) << c.describe();
      last = &e;
    } else if (c.strategy == fsdp::ShardingStrategy::kHybridShard && !c.no_sync) {
      every = &e;
    }
  }
  ASSERT_TRUE(every != nullptr && last != nullptr) << plan.table();
  // The shard group's sums of a block (2,099,712 float32 over 8 ranks) held from the first
  // micro-batch to the last one's reduction: more gradient memory, at most every block's.
  const int64_t partial = 2099712LL / 8 * 4;
  EXPECT_GT(last->memory.grads, every->memory.grads);
  EXPECT_LE(last->memory.grads, every->memory.grads + 4 * partial);
  EXPECT_EQ(last->memory.params, every->memory.params);
  // One all-reduce across the nodes per step instead of one per micro-batch.
  EXPECT_LT(last->time.step_s, every->time.step_s);
  EXPECT_LT(last->time.exposed_comm_s, every->time.exposed_comm_s);
  // Asked for, it applies only where there are replicas and several micro-batches.
  const fsdp::Plan one = fsdp::plan(*model, cluster, request.micro_batches({2}).replica_deferred({true}));
  for (const auto& e : one.entries) EXPECT_FALSE(e.candidate.replica_deferred) << e.candidate.describe();
}

// no_sync accumulation may also leave the parameters unsharded from one micro-batch's backward to
// the next one's forward (set_reshard_after_backward(false)): every block's unsharded parameters
// held at the end of backward, and no gathers in the next forward.
TEST(Planner, KeepsTheParametersUnshardedBetweenMicroBatches) {
  fsdp::DeferredInit deferred;
  Stack model(512, 4);
  const auto cluster = fsdp::Cluster::parse("paper:2x8");
  auto request = two_micro_batches_on_two_nodes().strategies({fsdp::ShardingStrategy::kFullShard}).no_sync({true});
  const fsdp::Plan plan = fsdp::plan(*model, cluster, request);
  ASSERT_EQ(plan.entries.size(), 2U) << plan.table();
  const fsdp::PlanEntry *kept = nullptr, *freed = nullptr;
  for (const auto& e : plan.entries) (e.candidate.keep_unsharded ? kept : freed) = &e;
  ASSERT_TRUE(kept != nullptr && freed != nullptr) << plan.table();
  EXPECT_TRUE(contains(kept->candidate.describe(), "no_sync unsharded")) << kept->candidate.describe();
  // A block's unsharded values, 2,099,712 float32: all four held once backward has finished them.
  const int64_t block = 2099712LL * 4;
  EXPECT_GT(kept->memory.params, freed->memory.params);
  EXPECT_LE(kept->memory.params, freed->memory.params + 4 * block);
  EXPECT_EQ(kept->memory.grads, freed->memory.grads);
  // The second micro-batch's forward gathers nothing.
  EXPECT_LT(kept->time.step_s, freed->time.step_s);
  // Only no_sync candidates of strategies that gather their units keep them.
  const fsdp::Plan other = fsdp::plan(*model, cluster, request.no_sync({false}));
  for (const auto& e : other.entries) EXPECT_FALSE(e.candidate.keep_unsharded) << e.candidate.describe();
}

// Quantized collectives (PlanRequest::all_gather_quantization, reduce_quantization) go into every
// candidate: a step bound by the network moves about a quarter of float32's bytes, and the packed
// buffers add to the parameter peak.
TEST(Planner, QuantizedCollectivesShortenACommunicationBoundStep) {
  fsdp::DeferredInit deferred;
  Stack model(2048, 4);  // large enough for the links' bandwidth, not their latency, to decide
  const auto cluster = fsdp::Cluster::parse("paper:16x1");  // a GPU per node: 25 GB/s between any two
  auto request = network_bound();
  const fsdp::Plan plain = fsdp::plan(*model, cluster, request);
  const fsdp::Plan int8 = fsdp::plan(
      *model, cluster,
      request.all_gather_quantization(fsdp::Quantization::int8()).reduce_quantization(fsdp::Quantization::int8()));
  ASSERT_EQ(plain.entries.size(), 1U) << plain.table();
  ASSERT_EQ(int8.entries.size(), 1U) << int8.table();
  const auto &p = plain.entries.front(), &q = int8.entries.front();
  EXPECT_TRUE(contains(q.candidate.describe(), ", int8 gathers, int8 reductions")) << q.candidate.describe();
  EXPECT_TRUE(q.candidate.options().all_gather_quantization().enabled());
  EXPECT_TRUE(q.candidate.options().reduce_quantization().enabled());
  // Over 25 GB/s per GPU the float32 step waits on its gathers and reductions; the packed ones
  // carry 1 + 4/256 bytes per value.
  EXPECT_GT(p.time.exposed_comm_s, 0.9 * (p.time.step_s - p.time.compute_s)) << plain.table();
  EXPECT_LT(q.time.step_s, 0.4 * p.time.step_s) << plain.table() << int8.table();
  EXPECT_GT(q.time.step_s, 0.2 * p.time.step_s) << plain.table() << int8.table();
  // A float32 shard is its own gather input; the packed shard and the gathered slots are extra.
  EXPECT_GT(q.memory.params, p.memory.params);
  EXPECT_GT(q.memory.grads, p.memory.grads);
  // Error feedback keeps float32 residuals of every quantized reduction's values: more memory, the
  // same bytes on the wire, and a few more passes over each packed gradient.
  const fsdp::Plan feedback =
      fsdp::plan(*model, cluster, request.reduce_quantization(fsdp::Quantization::int8().error_feedback(true)));
  ASSERT_EQ(feedback.entries.size(), 1U) << feedback.table();
  const auto& f = feedback.entries.front();
  EXPECT_TRUE(contains(f.candidate.describe(), "int8 reductions with error feedback")) << f.candidate.describe();
  EXPECT_EQ(q.memory.feedback, 0);
  EXPECT_GT(f.memory.feedback, 0);
  EXPECT_GE(f.memory.peak, q.memory.peak + f.memory.feedback);
  EXPECT_GT(f.time.step_s, q.time.step_s);
  EXPECT_LT(f.time.step_s, 1.1 * q.time.step_s);
}

// The optimizer's step in backward (PlanRequest::step_in_backward): no gradients held between
// steps, and each unit's step runs while later reductions are in flight.
TEST(Planner, StepInBackwardDropsTheGradientsAndOverlapsTheStep) {
  fsdp::DeferredInit deferred;
  Stack model(2048, 4);
  const auto cluster = fsdp::Cluster::parse("paper:16x1");  // a GPU per node: 25 GB/s between any two
  auto request = network_bound();
  const fsdp::Plan plain = fsdp::plan(*model, cluster, request);
  const fsdp::Plan both = fsdp::plan(*model, cluster, request.step_in_backward({false, true}));
  ASSERT_EQ(plain.entries.size(), 1U) << plain.table();
  ASSERT_EQ(both.entries.size(), 2U) << both.table();
  const fsdp::PlanEntry& p = plain.entries.front();
  const fsdp::PlanEntry* stepped = nullptr;
  for (const auto& e : both.entries)
    if (e.candidate.step_in_backward) stepped = &e;
  ASSERT_NE(stepped, nullptr) << both.table();
  EXPECT_TRUE(contains(stepped->candidate.describe(), ", step in backward")) << stepped->candidate.describe();
  // The pieces' gradients (float32, a 16th of the parameters) are gone; nothing else changes.
  const int64_t pieces = 4 * (2 * 4 * 2048 * 2048 + 4 * 2048 + 2048) * 4 / 16;
  EXPECT_NEAR(static_cast<double>(p.memory.grads - stepped->memory.grads), static_cast<double>(pieces), 64.0)
      << both.table();
  EXPECT_EQ(stepped->memory.params, p.memory.params);
  // The whole process holds one block's landed pieces' gradients until their step.
  EXPECT_EQ(p.memory.peak - stepped->memory.peak, p.memory.grads - stepped->memory.grads - pieces / 4);
  // The same work; the units' steps but the last ones run while the network carries reductions.
  EXPECT_NEAR(stepped->time.compute_s, p.time.compute_s, 1e-9 * p.time.compute_s);
  EXPECT_LT(stepped->time.step_s, p.time.step_s) << both.table();
  // With several micro-batches it steps in the last one's backward, so only under no_sync.
  const fsdp::Plan accumulating =
      fsdp::plan(*model, cluster, request.global_batch(32).micro_batches({1}).no_sync({false, true}));
  bool stepped_accumulating = false;
  for (const auto& e : accumulating.entries) {
    EXPECT_TRUE(!e.candidate.step_in_backward || e.candidate.no_sync) << e.candidate.describe();
    stepped_accumulating = stepped_accumulating || e.candidate.step_in_backward;
  }
  EXPECT_TRUE(stepped_accumulating) << accumulating.table();
}

// On a host heap a checkpointed backward's recomputed activations take the space its steps free, so
// the whole process peaks no lower than stepping after backward (Note [Step in backward on a host
// heap]); FSDP's own gradient memory still drops, and a device's allocator keeps the saving.
TEST(Planner, StepInBackwardWithCheckpointingOnAHostHeapPeaksAsStepsAfterBackward) {
  fsdp::DeferredInit deferred;
  Stack model(512, 4);
  auto request = network_bound().world(4).global_batch(4).step_in_backward({false, true});
  auto pair = [&](const char* cluster, bool checkpointed) {
    const fsdp::Plan plan =
        fsdp::plan(*model, fsdp::Cluster::parse(cluster), request.activation_checkpointing({checkpointed}));
    EXPECT_EQ(plan.entries.size(), 2U) << plan.table();
    std::pair<fsdp::MemoryPrediction, fsdp::MemoryPrediction> after_and_in;
    for (const auto& e : plan.entries)
      (e.candidate.step_in_backward ? after_and_in.second : after_and_in.first) = e.memory;
    return after_and_in;
  };
  for (const char* cluster : {"cpu:1x4", "h100:1x4"}) {
    for (bool checkpointed : {false, true}) {
      const auto [after, in] = pair(cluster, checkpointed);
      const bool host = std::string(cluster) == "cpu:1x4";
      SCOPED_TRACE(std::string(cluster) + (checkpointed ? ", checkpointed" : ""));
      EXPECT_LT(in.grads, after.grads);
      EXPECT_EQ(in.params, after.params);
      if (host && checkpointed) {
        EXPECT_EQ(in.peak, after.peak);
        EXPECT_GT(in.headroom, after.headroom);  // what the heap keeps counts as the allocator's
      } else {
        EXPECT_LT(in.peak, after.peak);
      }
    }
  }
}

TEST(Planner, CalibratedTimesReplaceTheNominalRates) {
  {  // fsdp::calibrate times a real model and its step; the result survives a file round trip
    Stack real(32, 2);
    const auto input = torch::randn({64, 32});
    auto forward = [&] {
      at::Tensor x = input;
      for (const auto& block : *real->blocks) x = block->as<torch::nn::Sequential>()->forward(x);
      return x.square().mean();
    };
    const auto measured = fsdp::calibrate(
        *real, forward, 64,
        fsdp::CalibrateOptions().optimizer(
            [](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
              return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(1e-3));
            }));
    ASSERT_EQ(measured.timings.size(), 1U);
    EXPECT_GT(measured.timings[0].forward_s, 0);
    EXPECT_GT(measured.timings[0].backward_s, 0);
    EXPECT_GT(measured.step_s_per_element, 0);
    const auto back = fsdp::Calibration::from_json(measured.to_json());
    EXPECT_EQ(back.tokens, 64);
    ASSERT_NE(back.find(at::kFloat), nullptr);
    EXPECT_EQ(back.find(at::kFloat)->forward_s, measured.timings[0].forward_s);
    EXPECT_EQ(back.find(at::kBFloat16), nullptr);
    EXPECT_THROW(fsdp::Calibration::from_json("{\"tokens\": 1}"), fsdp::Error);
  }
  fsdp::DeferredInit deferred;
  Stack model(64, 4);
  const int64_t numel = 4 * (2 * 4 * 64 * 64 + 4 * 64 + 64);
  fsdp::Calibration c;
  c.tokens = 1024;
  c.timings.push_back({at::kFloat, 0.010, 0.025});
  c.step_s_per_element = 1e-9;
  // Twice the calibrated tokens: twice the time. Checkpointing recomputes every block's forward.
  auto request = one_rank(0).seq_len(2048).calibration(c);
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(plan.entries.size(), 2U);
  for (const auto& e : plan.entries) {
    const double passes = 2 * (0.010 + 0.025) + (e.candidate.activation_checkpointing ? 2 * 0.010 : 0.0);
    EXPECT_NEAR(e.time.compute_s, passes + numel * 1e-9, 1e-9) << e.candidate.describe();
    EXPECT_NEAR(e.time.step_s, e.time.compute_s, 1e-9) << e.candidate.describe();  // one rank: nothing exposed
  }
  // A precision the calibration lacks keeps the device's nominal rate.
  const fsdp::Plan bf16 =
      fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), fsdp::PlanRequest(request).precisions({at::kBFloat16}));
  const fsdp::Plan nominal =
      fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(0).seq_len(2048).precisions({at::kBFloat16}));
  const double nominal_step = numel * 7.0 * 4.0 / (fsdp::Cluster::parse("cpu:1x1").device.memory_gbps * 1e9);
  for (size_t i = 0; i < bf16.entries.size(); ++i)
    EXPECT_NEAR(bf16.entries[i].time.compute_s - numel * 1e-9, nominal.entries[i].time.compute_s - nominal_step, 1e-9);
}

// A calibration records the model it timed: a plan for another model, or for a precision it did
// not time, says so in its notes.
TEST(Planner, NotesACalibrationOfAnotherModelOrPrecision) {
  Stack real(16, 2);
  const auto input = torch::randn({8, 16});
  auto loss = [&] {
    at::Tensor x = input;
    for (const auto& block : *real->blocks) x = block->as<torch::nn::Sequential>()->forward(x);
    return x.square().mean();
  };
  const fsdp::Calibration c = fsdp::Calibration::from_json(fsdp::calibrate(*real, loss, 8).to_json());
  EXPECT_EQ(c.parameters, 2 * (2 * 4 * 16 * 16 + 4 * 16 + 16));
  auto notes = [&](int d, std::vector<at::ScalarType> precisions) {
    fsdp::DeferredInit deferred;
    Stack model(d, 2);
    std::string all;
    auto request =  // no checkpointed candidates: Stack holds no fsdp::Checkpointed module, which a note says
        one_rank(0).seq_len(8).calibration(c).precisions(std::move(precisions)).activation_checkpointing({false});
    for (const auto& note : fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request).notes) all += note + "\n";
    return all;
  };
  EXPECT_EQ(notes(16, {at::kFloat}), "");
  EXPECT_TRUE(contains(notes(32, {at::kFloat}), "the calibration timed a model of 4256 parameters, this one has 16704"))
      << notes(32, {at::kFloat});
  EXPECT_TRUE(contains(notes(16, {at::kFloat, at::kBFloat16}),
                       "bf16 candidates are predicted from the cluster's nominal rates, not measured ones"))
      << notes(16, {at::kFloat, at::kBFloat16});
}

// A smaller batch timed too: the passes at another micro-batch size lie on the line through the two
// timed sizes (a fixed cost plus a cost per token), not in proportion to the tokens; without a
// usable line (no cost per token, or a negative fixed cost), in proportion again.
TEST(Planner, ASmallerCalibratedBatchGivesThePassesFixedCost) {
  {  // fsdp::calibrate times the smaller batch too; both survive a file round trip
    Stack real(32, 2);
    const auto input = torch::randn({64, 32});
    auto forward_of = [&](int64_t rows) {
      return [&, rows] {
        at::Tensor x = input.narrow(0, 0, rows);
        for (const auto& block : *real->blocks) x = block->as<torch::nn::Sequential>()->forward(x);
        return x.square().mean();
      };
    };
    const auto measured = fsdp::calibrate(*real, forward_of(64), 64,
                                          fsdp::CalibrateOptions().smaller_loss(forward_of(16)).smaller_tokens(16));
    ASSERT_EQ(measured.timings.size(), 1U);
    EXPECT_EQ(measured.small_tokens, 16);
    EXPECT_GT(measured.timings[0].small_forward_s, 0);
    EXPECT_GT(measured.timings[0].small_backward_s, 0);
    const auto back = fsdp::Calibration::from_json(measured.to_json());
    EXPECT_EQ(back.small_tokens, 16);
    EXPECT_EQ(back.find(at::kFloat)->small_backward_s, measured.timings[0].small_backward_s);
    EXPECT_THROW(fsdp::calibrate(*real, forward_of(64), 64,
                                 fsdp::CalibrateOptions().smaller_loss(forward_of(16)).smaller_tokens(64)),
                 fsdp::Error);
    EXPECT_THROW(fsdp::Calibration::from_json(R"({"tokens": 8, "small_tokens": 8, "timings": []})"), fsdp::Error);
  }
  fsdp::DeferredInit deferred;
  Stack model(64, 4);
  const int64_t numel = 4 * (2 * 4 * 64 * 64 + 4 * 64 + 64);
  fsdp::Calibration c;
  c.tokens = 1024;
  c.small_tokens = 512;
  c.step_s_per_element = 1e-9;
  // forward: 0.002 s fixed + 0.008 s per 1024 tokens; backward: 0.003 s + 0.022 s per 1024 tokens.
  fsdp::PrecisionTiming t{at::kFloat, 0.010, 0.025};
  t.small_forward_s = 0.006;
  t.small_backward_s = 0.014;
  c.timings.push_back(t);
  for (const int64_t seq : {2048, 256}) {
    const fsdp::Plan plan =
        fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(0).seq_len(seq).calibration(c));
    const double forward = 0.002 + 0.008 * seq / 1024.0, backward = 0.003 + 0.022 * seq / 1024.0;
    for (const auto& e : plan.entries) {
      const double passes = forward + backward + (e.candidate.activation_checkpointing ? forward : 0.0);
      EXPECT_NEAR(e.time.compute_s, passes + numel * 1e-9, 1e-9) << seq << " " << e.candidate.describe();
    }
  }
  // A smaller batch no faster per token than the larger (a negative fixed cost): in proportion.
  c.timings[0].small_forward_s = 0.004;
  c.timings[0].small_backward_s = 0.025;  // and no cost per token at all
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(0).seq_len(2048).calibration(c));
  for (const auto& e : plan.entries) {
    const double passes = 2 * (0.010 + 0.025) + (e.candidate.activation_checkpointing ? 2 * 0.010 : 0.0);
    EXPECT_NEAR(e.time.compute_s, passes + numel * 1e-9, 1e-9) << e.candidate.describe();
  }
}

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int d)
      : up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  at::Tensor forward(const at::Tensor& x) { return down(torch::relu(up(x))); }
  torch::nn::Linear up, down;
};
TORCH_MODULE(Mlp);

// Short passes are timed past `repetitions` until min_timed_s is timed, ten times `repetitions` at most;
// passes that fill it sooner are timed `repetitions` times.
TEST(Planner, ShortPassesAreTimedUntilTheMinimumSpan) {
  torch::nn::Linear model(4, 4);
  const auto input = torch::randn({2, 4});
  auto calls_with = [&](double pass_s, double min_timed_s) {
    int calls = 0;
    auto loss = [&] {
      ++calls;
      std::this_thread::sleep_for(std::chrono::duration<double>(pass_s));
      return model->forward(input).sum();
    };
    fsdp::calibrate(*model, loss, 2, fsdp::CalibrateOptions().repetitions(3).min_timed_s(min_timed_s));
    return calls;
  };
  const int plain = calls_with(0.001, 0);          // one untimed, three timed, and the memory passes
  EXPECT_EQ(calls_with(0.001, 10.0), plain + 27);  // capped at thirty timed
  EXPECT_EQ(calls_with(0.050, 0.1), plain);        // three passes of 50 ms fill 0.1 s
  EXPECT_THROW(fsdp::calibrate(
                   *model, [&] { return model->forward(input).sum(); }, 2, fsdp::CalibrateOptions().min_timed_s(-1)),
               fsdp::Error);
}

TEST(Planner, CalibratedPassMemoryBecomesTheWorkspace) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "AddressSanitizer's allocator keeps freed memory in quarantine: the resident set does not follow "
                  "the live tensors";
#endif
  {  // fsdp::calibrate measures the passes' memory without and with the model's checkpointing.
    // Large blocks come straight from the system (no dynamic threshold), so the resident set
    // follows the live tensors and the two passes compare; ctest runs each test in its own process.
    mallopt(M_MMAP_THRESHOLD, 64 * 1024);
    torch::nn::ModuleList blocks;
    std::vector<fsdp::Checkpointed<Mlp>> checkpointed;
    for (int i = 0; i < 4; ++i) {
      checkpointed.emplace_back(Mlp(128));
      blocks->push_back(checkpointed.back());
    }
    checkpointed[1]->set_enabled(false);  // the caller's setting, restored afterwards
    const auto input = torch::randn({4096, 128});
    auto forward = [&] {
      at::Tensor x = input;
      for (auto& c : checkpointed) x = c->forward(x);
      return x.square().mean();
    };
    const auto c = fsdp::calibrate(*blocks, forward, 4096);
    ASSERT_EQ(c.timings.size(), 1U);
    const auto& t = c.timings[0];
    if (t.peak_bytes == 0) GTEST_SKIP() << "this kernel cannot restart the resident set's peak (/proc/self/clear_refs)";
    // Kept without checkpointing: each block's input and activated hidden layer (5 x 128 values per token).
    const int64_t kept = 4 * 5 * 128 * int64_t(4096) * 4;
    EXPECT_GT(t.peak_bytes, kept) << t.peak_bytes;
    EXPECT_GT(t.checkpointed_peak_bytes, 0);
    EXPECT_LT(t.checkpointed_peak_bytes, t.peak_bytes * 3 / 4) << t.checkpointed_peak_bytes << " vs " << t.peak_bytes;
    EXPECT_TRUE(checkpointed[0]->enabled());
    EXPECT_FALSE(checkpointed[1]->enabled());
    EXPECT_GT(t.checkpointed_forward_s, 0);
    EXPECT_GT(t.checkpointed_backward_s, 0);
    const auto back = fsdp::Calibration::from_json(c.to_json());
    EXPECT_EQ(back.timings[0].peak_bytes, t.peak_bytes);
    EXPECT_EQ(back.timings[0].checkpointed_peak_bytes, t.checkpointed_peak_bytes);
    EXPECT_EQ(back.timings[0].checkpointed_backward_s, t.checkpointed_backward_s);
  }
  // Known figures: the workspace is what the passes held beyond the activations the plan keeps,
  // per token, at the candidate's tokens; the peak includes it.
  fsdp::DeferredInit deferred;
  Stack model(64, 4);
  fsdp::Calibration c;
  c.tokens = 1024;
  c.timings.push_back({at::kFloat, 0.010, 0.025, 64 * kMiB, 16 * kMiB});
  const auto request = one_rank(0).seq_len(2048);
  const fsdp::Plan without = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  const fsdp::Plan with =
      fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), fsdp::PlanRequest(request).calibration(c));
  ASSERT_EQ(with.entries.size(), 2U);
  for (const auto& e : with.entries) {
    const int64_t measured = e.candidate.activation_checkpointing ? 16 * kMiB : 64 * kMiB;
    EXPECT_EQ(e.memory.workspace, 2 * measured - e.memory.activations) << e.candidate.describe();
    for (const auto& w : without.entries)
      if (w.candidate.describe() == e.candidate.describe()) {
        EXPECT_EQ(w.memory.workspace, 0);
        EXPECT_EQ(e.memory.peak - w.memory.peak, e.memory.workspace) << e.candidate.describe();
      }
  }
}

// Timed checkpointed passes replace "one more forward in backward": what checkpointing added to
// each pass, per second of the forward its checkpointed modules hold, charged to every stretch the
// candidate checkpoints. The share is the model's fsdp::Checkpointed modules' where it has any, else
// the candidate's checkpointed units'.
TEST(Planner, TimedCheckpointedPassesReplaceOneMoreForward) {
  fsdp::DeferredInit deferred;
  torch::nn::ModuleList half;  // four equal blocks, the first two in checkpointing wrappers
  for (int i = 0; i < 4; ++i)
    if (i < 2)
      half->push_back(fsdp::Checkpointed<Mlp>(Mlp(64)));
    else
      half->push_back(Mlp(64));
  torch::nn::ModuleList none;
  for (int i = 0; i < 4; ++i) none->push_back(Mlp(64));
  const int64_t numel = 4 * (2 * 4 * 64 * 64 + 4 * 64 + 64);
  fsdp::Calibration c;
  c.tokens = 1024;
  c.step_s_per_element = 1e-9;
  fsdp::PrecisionTiming t{at::kFloat, 0.010, 0.025};
  t.checkpointed_forward_s = 0.008;   // no graph kept: 0.002 s less
  t.checkpointed_backward_s = 0.030;  // recomputation: 0.005 s more
  c.timings.push_back(t);
  const auto request =
      one_rank(0).seq_len(2048).wrap_policies({{"block", fsdp::wrap::by_type<MlpImpl>()}}).calibration(c);
  for (const bool wrapped : {true, false}) {
    const fsdp::Plan plan = fsdp::plan(wrapped ? *half : *none, fsdp::Cluster::parse("cpu:1x1"), request);
    ASSERT_EQ(plan.entries.size(), 2U);
    // Half the model timed checkpointed: every block's share of the change is twice its FLOP share.
    const double change = (wrapped ? 2 : 1) * (0.008 + 0.030 - 0.010 - 0.025);
    for (const auto& e : plan.entries) {
      const double passes = 2 * (0.010 + 0.025 + (e.candidate.activation_checkpointing ? change : 0.0));
      EXPECT_NEAR(e.time.compute_s, passes + numel * 1e-9, 1e-9) << wrapped << " " << e.candidate.describe();
    }
  }
  auto bad = R"({"tokens": 8, "timings": [{"precision": "fp32", "forward_s": 1, "backward_s": 1,
                 "checkpointed_forward_s": -1}]})";
  EXPECT_THROW(fsdp::Calibration::from_json(bad), fsdp::Error);
}

TEST(Planner, TheMarginIsKeptFreeBeyondEachPeak) {
  fsdp::DeferredInit deferred;
  Stack model(64, 4);
  const fsdp::Plan loose = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(0));
  const int64_t smallest = loose.smallest_peak();
  // A budget of exactly the smallest peak fits it without a margin, and nothing with one.
  const fsdp::Plan exact = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(smallest));
  EXPECT_TRUE(exact.any_fits());
  const fsdp::Plan margin = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(smallest).memory_margin(0.25));
  EXPECT_FALSE(margin.any_fits());
  EXPECT_EQ(margin.smallest_peak(), static_cast<int64_t>(std::ceil(smallest * 1.25)));
  const fsdp::Plan enough =
      fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(margin.smallest_peak()).memory_margin(0.25));
  EXPECT_TRUE(enough.any_fits());
  EXPECT_TRUE(contains(enough.table(), "25% margin"));
  // A model of a few KiB is shown in KiB, not as 0.0 MiB.
  Stack small(16, 1);
  const fsdp::Plan tiny = fsdp::plan(*small, fsdp::Cluster::parse("cpu:1x1"), one_rank(0).seq_len(1));
  ASSERT_LT(tiny.entries.front().memory.peak, 1024 * 1024);
  EXPECT_TRUE(contains(tiny.table(), "| peak KiB | fits |")) << tiny.table();
  EXPECT_FALSE(contains(tiny.table(), "| 0.0 | yes |")) << tiny.table();
  EXPECT_TRUE(contains(loose.table(), "| peak MiB | fits |")) << loose.table();
  EXPECT_THROW(fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(0).memory_margin(-0.1)), fsdp::Error);
}

// The message best() throws when nothing fits ("" and a failure when it does not throw).
std::string best_refusal(const fsdp::Plan& plan) {
  try {
    plan.best();
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "best() must throw when nothing fits";
  return "";
}

TEST(Planner, AModelThatFitsNowhereNamesTheSmallestBudget) {
  fsdp::DeferredInit deferred;
  Stack model(256, 4);
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(kMiB));
  EXPECT_FALSE(plan.any_fits());
  const std::string what = best_refusal(plan);
  EXPECT_TRUE(contains(what, "no configuration fits in 1.00 MiB")) << what;
  EXPECT_TRUE(contains(plan.table(), "| peak MiB | fits |")) << plan.table();
  EXPECT_TRUE(contains(what, "the smallest needs " + fsdp::format_bytes(plan.smallest_peak()))) << what;
  EXPECT_TRUE(contains(what, "checkpointed")) << what;
  EXPECT_TRUE(contains(what, "or add ranks")) << what;
  EXPECT_TRUE(contains(plan.table(), "| no |"));
  // A budget below what the process holds outside tensors: more ranks would not help.
  const std::string process_bound =
      best_refusal(fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), one_rank(kMiB).process_bytes(2 * kMiB)));
  EXPECT_TRUE(contains(process_bound, "the process alone holds 2.00 MiB outside tensors")) << process_bound;
  EXPECT_FALSE(contains(process_bound, "or add ranks")) << process_bound;
}

}  // namespace
}  // namespace fsdp_test
