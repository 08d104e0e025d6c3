// Gradient accumulation without communication (no_sync, set_requires_gradient_sync,
// set_requires_all_reduce, set_reshard_after_backward): equal to local training of the same model on
// the same batches, with the communication and memory each control promises.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Two AdamW steps of three micro-batches each: the reference accumulates each global micro-batch's
// gradient; body(m, rows) runs the sharded model's part of micro-batch m (this rank's rows, whose
// backward it runs and checks around); then both step, and the parameters must agree.
template <class Body>
void accumulate_side_by_side(TinyTransformer& ref, TinyTransformer& model, fsdp::FullyShardedModule& sharded,
                             const WorkerContext& ctx, const std::string& what, Body body) {
  torch::optim::AdamW ref_opt(unique_parameters(*ref), torch::optim::AdamWOptions(0.01)),
      opt(sharded.parameters(), torch::optim::AdamWOptions(0.01));
  const int rows = 2, micro = 3;
  for (int step = 0; step < 2; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(100 * step + m));
      loss_of(ref, x).backward();
      body(m, m + 1 == micro, x.narrow(0, ctx.rank * rows, rows));
    }
    ref_opt.step();
    opt.step();
  }
  expect_same_parameters(*ref, sharded, 1e-12, what);
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

// args: strategy. Two micro-batches under no_sync, one synced, then a step: equal to local training
// that accumulates the three global micro-batches' gradients.
FSDP_WORKER(no_sync_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  accumulate_side_by_side(
      ref, model, *sharded, ctx, strategy + " no_sync", [&](int m, bool last, const at::Tensor& mine) {
        if (!last) {
          auto guard = sharded->no_sync();
          loss_of(model, mine).backward();
          WORKER_CHECK(!sharded->requires_gradient_sync(), "no_sync is on inside its scope");
        } else {
          WORKER_CHECK(sharded->requires_gradient_sync(), "no_sync is off after its scope");
          loss_of(model, mine).backward();
        }
        if (m == 0 && strategy != "NO_SHARD") {
          // Nothing reduced yet: the pieces have no gradient, and the unsharded gradients are held.
          for (const auto& p : sharded->parameters())
            WORKER_CHECK(!p.grad().defined() || p.grad().abs().sum().item<double>() == 0,
                         "a piece got a gradient under no_sync");
          WORKER_CHECK(sharded->memory_stats().grad_bytes > 0, "no_sync holds the unsharded gradients");
        }
      });
}

TEST(NoSync, MicroBatchesWithoutCommunicationEqualLocalTraining) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    auto r = launch("no_sync_worker", strategy == std::string("HYBRID_SHARD") ? 4 : 3, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

int count_events(const fsdp::IterationTrace& trace, fsdp::TraceEvent::Kind kind, const std::string& label = "") {
  int n = 0;
  for (const auto& e : trace.events) n += e.kind == kind && (label.empty() || e.label == label);
  return n;
}

// HYBRID_SHARD (F=2 at world 4): two micro-batches reduce-scatter within their shard groups only
// (set_requires_all_reduce(false)), the third all-reduces across replicas too; equal to local
// training on the three global micro-batches. The trace shows no replica all-reduce before the last.
FSDP_WORKER(hybrid_accumulation_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("HYBRID_SHARD").trace(true));
  accumulate_side_by_side(
      ref, model, *sharded, ctx, "hybrid accumulation", [&](int m, bool last, const at::Tensor& mine) {
        sharded->set_requires_all_reduce(last);
        loss_of(model, mine).backward();
        const int across =
            count_events(sharded->last_trace(), fsdp::TraceEvent::Kind::kReduceIssued, "all-reduce across replicas");
        WORKER_CHECK(last ? across > 0 : across == 0, "micro-batch ", m, ": ", across, " all-reduces across replicas");
        if (!last)
          WORKER_CHECK(sharded->memory_stats().grad_bytes > 0, "the shard groups' sums are kept between micro-batches");
      });
}

TEST(NoSync, HybridReducesWithinShardGroupsAndAcrossReplicasOnlyAtTheLastMicroBatch) {
  auto r = launch("hybrid_accumulation_worker", 4);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// SHARD_GRAD_OP with no_sync and set_reshard_after_backward(false): after the first micro-batch no
// unit is gathered again until the optimizer step changed the shards; equal to local training.
FSDP_WORKER(keep_unsharded_accumulation_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("SHARD_GRAD_OP").trace(true));
  int64_t all_unsharded = 0;
  for (const auto& u : sharded->units()) all_unsharded += u.padded_bytes + u.shard_bytes;
  accumulate_side_by_side(ref, model, *sharded, ctx, "accumulation with units kept unsharded",
                          [&](int m, bool last, const at::Tensor& mine) {
                            sharded->set_reshard_after_backward(last);
                            sharded->set_requires_gradient_sync(last);
                            loss_of(model, mine).backward();
                            const int gathers =
                                count_events(sharded->last_trace(), fsdp::TraceEvent::Kind::kUnshardIssued);
                            if (m > 0) WORKER_CHECK(gathers == 0, "micro-batch ", m, " gathered ", gathers, " times");
                            if (!last)
                              WORKER_CHECK(sharded->memory_stats().param_bytes == all_unsharded, "micro-batch ", m,
                                           ": ", sharded->memory_stats().param_bytes,
                                           " bytes of parameters, expected every unit unsharded ", all_unsharded);
                          });
}

TEST(NoSync, ReshardAfterBackwardOffGathersNothingBetweenMicroBatches) {
  auto r = launch("keep_unsharded_accumulation_worker", 3);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// FULL_SHARD with set_reshard_after_backward(false): the next micro-batch's forward uses the units
// backward left unsharded, gathering nothing, and reshards each after its forward as usual, so its
// backward gathers them again; equal to local training.
FSDP_WORKER(keep_unsharded_full_shard_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("FULL_SHARD").trace(true));
  accumulate_side_by_side(ref, model, *sharded, ctx, "FULL_SHARD accumulation with units kept unsharded",
                          [&](int m, bool last, const at::Tensor& mine) {
                            sharded->set_reshard_after_backward(last);
                            sharded->set_requires_gradient_sync(last);
                            loss_of(model, mine).backward();
                            int forward_gathers = 0, backward_gathers = 0;
                            for (const auto& e : sharded->last_trace().events) {
                              if (e.kind != fsdp::TraceEvent::Kind::kUnshardIssued) continue;
                              ++(e.label.find("backward") != std::string::npos ? backward_gathers : forward_gathers);
                            }
                            if (m > 0)
                              WORKER_CHECK(forward_gathers == 0, "micro-batch ", m, "'s forward gathered ",
                                           forward_gathers, " times");
                            WORKER_CHECK(backward_gathers > 0, "micro-batch ", m,
                                         "'s backward gathered nothing: its forward did not reshard");
                          });
}

TEST(NoSync, ReshardAfterBackwardOffLetsTheNextForwardUseTheUnshardedUnits) {
  auto r = launch("keep_unsharded_full_shard_worker", 3);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// args: strategy, mode ("no_sync" or "replica_deferred"). Gradients zeroed in place or set to none
// between micro-batches whose gradients are held unreduced are gone, with the held ones, as in
// local training: micro-batch 0 is dropped, 1 and 2 are summed.
FSDP_WORKER(held_gradients_dropped_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), mode = ctx.args.at(1);
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  torch::optim::AdamW ref_opt(unique_parameters(*ref), torch::optim::AdamWOptions(0.01)),
      opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
  const int rows = 2, micro = 3;
  for (int step = 0; step < 2; ++step) {
    const bool in_place = step == 0;
    for (int m = 0; m < micro; ++m) {
      if (m < 2) {  // before micro-batches 0 and 1: every gradient zeroed or dropped
        if (in_place) {
          zero_grad_in_place(ref_opt);
          zero_grad_in_place(opt);
        } else {
          for (auto& p : unique_parameters(*ref)) p.mutable_grad().reset();
          for (auto& p : sharded->parameters()) p.mutable_grad().reset();
        }
      }
      const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(100 * step + m));
      loss_of(ref, x).backward();
      const bool last = m + 1 == micro;
      if (mode == "no_sync")
        sharded->set_requires_gradient_sync(last);
      else
        sharded->set_requires_all_reduce(last);
      loss_of(model, x.narrow(0, ctx.rank * rows, rows)).backward();
    }
    ref_opt.step();
    opt.step();
  }
  expect_same_parameters(*ref, *sharded, 1e-12, strategy + " " + mode + ": held gradients dropped");
  if (ctx.rank == 0) std::cout << strategy << " " << mode << " ok" << std::endl;
}

// A model so small that rank 3 of 4 holds only padding in every FlatParameter: it sees no piece,
// so it learns from its peers that the gradients were dropped (one all-reduce of a flag).
FSDP_WORKER(held_gradients_dropped_padding_rank_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto make = [] {
    torch::manual_seed(8);
    torch::nn::Sequential m(torch::nn::Linear(2, 1), torch::nn::Tanh(), torch::nn::Linear(1, 1));
    m->to(at::kDouble);
    return m;
  };
  auto ref = make(), model = make();
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  WORKER_CHECK(ctx.rank != 3 || sharded->shard_pieces().empty(), "rank 3 holds a piece");
  torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(sharded->parameters(), 0.1);
  for (int step = 0; step < 2; ++step) {
    for (int m = 0; m < 3; ++m) {
      if (m == 1) {
        for (auto& p : ref->parameters()) p.mutable_grad().reset();
        for (auto& p : sharded->parameters()) p.mutable_grad().reset();
      }
      const auto x = at::randn({2 * ctx.world, 2}, at::detail::createCPUGenerator(10 * step + m)).to(at::kDouble);
      ref->forward(x).pow(2).mean().backward();
      sharded->set_requires_gradient_sync(m == 2);
      model->forward(x.narrow(0, 2 * ctx.rank, 2)).pow(2).mean().backward();
    }
    ref_opt.step();
    opt.step();
  }
  expect_same_parameters(*ref, *sharded, 1e-12, "held gradients dropped, a rank with only padding");
}

// args: strategy. After a backward without sync, clip_grad_norm_ and grad_norms are refused (there
// is no reduced gradient to measure) and change nothing: the accumulation still equals local training.
FSDP_WORKER(norms_refused_while_held_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  accumulate_side_by_side(
      ref, model, *sharded, ctx, strategy + " norms refused while held", [&](int m, bool last, const at::Tensor& mine) {
        sharded->set_requires_gradient_sync(last);
        loss_of(model, mine).backward();
        if (last) return;
        expect_error([&] { (void)sharded->clip_grad_norm_(1e-3); }, "not reduced yet",
                     "clip_grad_norm_ between micro-batches");
        expect_error([&] { (void)sharded->grad_norms(); }, "not reduced yet", "grad_norms between micro-batches");
        (void)m;
      });
}

TEST(NoSync, NormsOfGradientsNotYetReducedAreRefused) {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    auto r = launch("norms_refused_while_held_worker", 3, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// args: strategy, the switch left off ("sync" or "all_reduce"). An optimizer step after a backward
// whose gradients were held, with no synchronizing backward between, is refused at the next backward.
FSDP_WORKER(step_while_held_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), off = ctx.args.at(1);
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  const auto x = token_batch(ctx.world, 3).narrow(0, ctx.rank * 2, 2);
  if (off == "sync")
    sharded->set_requires_gradient_sync(false);
  else
    sharded->set_requires_all_reduce(false);
  opt.zero_grad();
  loss_of(model, x).backward();
  opt.step();  // the switch was never turned back on
  opt.zero_grad();
  expect_error([&] { loss_of(model, x).backward(); }, "the optimizer stepped the shards after a backward without",
               strategy + ": a step while gradients were held");
}

TEST(NoSync, AnOptimizerStepWhileGradientsAreHeldIsRefused) {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    auto r = launch("step_while_held_worker", 3, {strategy, "sync"});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
  auto r = launch("step_while_held_worker", 4, {"HYBRID_SHARD", "all_reduce"});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

TEST(NoSync, ZeroingOrDroppingGradientsBetweenMicroBatchesDropsTheHeldOnes) {
  {
    auto r = launch("held_gradients_dropped_padding_rank_worker", 4);
    ASSERT_TRUE(r.all_ok()) << r.report();
  }
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    auto r =
        launch("held_gradients_dropped_worker", strategy == std::string("HYBRID_SHARD") ? 4 : 3, {strategy, "no_sync"});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
  auto r = launch("held_gradients_dropped_worker", 4, {"HYBRID_SHARD", "replica_deferred"});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
