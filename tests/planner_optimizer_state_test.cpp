// The planner's optimizer state (PlanRequest::optimizer_state, src/planner/optimizer_state.cpp)
// against the state AdamW, LAMB, Adafactor and Muon hold after a step, at world 4 under every
// strategy: rank 0's, which the planner predicts, equal to the byte.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/adafactor.h"
#include "fsdp/fsdp.h"
#include "fsdp/lamb.h"
#include "fsdp/muon.h"
#include "fsdp/planner.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// Bytes of every tensor in `optimizer`'s state.
int64_t state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t total = 0;
  for (const auto& entry : optimizer.state()) {
    const auto* state = entry.second.get();
    if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      total += bytes_of(s->exp_avg()) + bytes_of(s->exp_avg_sq()) + bytes_of(s->max_exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const fsdp::AdafactorParamState*>(state)) {
      total += bytes_of(s->exp_avg_sq_row()) + bytes_of(s->exp_avg_sq_col()) + bytes_of(s->exp_avg_sq()) +
               bytes_of(s->exp_avg());
    } else if (const auto* s = dynamic_cast<const fsdp::MuonParamState*>(state)) {
      total += bytes_of(s->momentum_buffer()) + bytes_of(s->exp_avg()) + bytes_of(s->exp_avg_sq());
    } else {
      WORKER_CHECK(false, "an optimizer state of an unexpected type");
    }
  }
  return total;
}

bool in_blocks(const std::string& name) { return name.rfind("blocks.", 0) == 0; }

struct Kind {
  std::string name;
  fsdp::OptimizerStateFn state;
  std::function<std::unique_ptr<torch::optim::Optimizer>(fsdp::FullyShardedModule&)> make;
};

std::vector<Kind> kinds() {
  auto pieces = [](fsdp::FullyShardedModule& m) {
    std::vector<at::Tensor> ps;
    for (const auto& p : m.shard_pieces())
      if (p.piece.requires_grad()) ps.push_back(p.piece);
    return ps;
  };
  std::vector<Kind> out;
  out.push_back({"adamw", fsdp::per_element_state(2), [pieces](fsdp::FullyShardedModule& m) {
                   return std::make_unique<torch::optim::AdamW>(pieces(m), torch::optim::AdamWOptions(1e-3));
                 }});
  out.push_back({"lamb", fsdp::per_element_state(2), [](fsdp::FullyShardedModule& m) {
                   return std::make_unique<fsdp::Lamb>(m, fsdp::LambOptions(1e-3));
                 }});
  for (const double beta1 : {0.0, 0.9})
    out.push_back({beta1 > 0 ? "adafactor with a first moment" : "adafactor", fsdp::adafactor_state(beta1 > 0),
                   [beta1](fsdp::FullyShardedModule& m) {
                     return std::make_unique<fsdp::Adafactor>(m, fsdp::AdafactorOptions().beta1(beta1));
                   }});
  // Muon for the blocks' matrices, AdamW for the rest (the embedding and the vectors).
  out.push_back({"muon", fsdp::muon_state(in_blocks), [](fsdp::FullyShardedModule& m) {
                   std::vector<at::Tensor> blocks, rest;
                   for (const auto& p : m.shard_pieces())
                     if (p.piece.requires_grad()) (in_blocks(p.name) ? blocks : rest).push_back(p.piece);
                   std::vector<torch::optim::OptimizerParamGroup> groups;
                   groups.emplace_back(blocks, std::make_unique<fsdp::MuonOptions>(fsdp::MuonOptions(1e-3)));
                   groups.emplace_back(rest,
                                       std::make_unique<fsdp::MuonOptions>(fsdp::MuonOptions(1e-3).use_muon(false)));
                   return std::make_unique<fsdp::Muon>(m, std::move(groups), fsdp::MuonOptions(1e-3));
                 }});
  return out;
}

FSDP_WORKER(planner_optimizer_state_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  using fsdp::ShardingStrategy;
  int checked = 0;
  for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                              ShardingStrategy::kHybridShard})
    for (const auto& kind : kinds()) {
      torch::manual_seed(5);
      TinyTransformer model(50, 12, 2, 3, 8);  // widths that do not divide by 4: pieces straddle parameters
      const auto request = fsdp::PlanRequest()
                               .global_batch(4)
                               .seq_len(8)
                               .optimizer_state(kind.state)
                               .strategies({strategy})
                               .hybrid_factors({2})
                               .wrap_policies({{"block", fsdp::wrap::by_type<BlockImpl>()}})
                               .activation_checkpointing({false})
                               .cpu_offload({false})
                               .precisions({at::kFloat})
                               .micro_batches({1})
                               .no_sync({false});
      const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x4"), request);
      WORKER_CHECK(plan.entries.size() == 1, "expected one candidate, got ", plan.entries.size());
      const fsdp::PlanEntry& e = plan.entries.front();
      auto sharded = fsdp::fully_shard(model, pg, e.candidate.options());
      auto optimizer = kind.make(*sharded);
      auto x = torch::randint(50, {1, 8}, torch::kLong);
      lm_loss(model->forward(x), x).backward();
      optimizer->step();
      if (pg->rank() == 0)
        WORKER_CHECK(state_bytes(*optimizer) == e.memory.optimizer, kind.name, ", ", e.candidate.describe(),
                     ": optimizer state measured ", state_bytes(*optimizer), " bytes, predicted ", e.memory.optimizer);
      ++checked;
    }
  if (pg->rank() == 0) std::cout << "planner optimizer state: " << checked << " configurations exact" << std::endl;
}

TEST(PlannerOptimizerState, EqualsTheStateAdamWLambAdafactorAndMuonHoldUnderEveryStrategy) {
  auto r = launch("planner_optimizer_state_worker", 4);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "20 configurations exact")) << r.report();
}

TEST(PlannerOptimizerState, RefusesANegativeCountAndAMissingPredicate) {
  EXPECT_THROW(fsdp::per_element_state(-1), fsdp::Error);
  EXPECT_THROW(fsdp::muon_state(nullptr), fsdp::Error);
  const auto adafactor = fsdp::adafactor_state(true);
  EXPECT_EQ(adafactor("w", {6, 4}, 5), 6 + 4 + 5);  // rows and columns whole, the first moment per element
  EXPECT_EQ(adafactor("b", {6}, 5), 5 + 5);
}

}  // namespace
}  // namespace fsdp_test
