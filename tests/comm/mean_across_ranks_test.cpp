// fsdp::mean_across_ranks: the mean of a scalar or a tensor over the ranks, against the mean
// computed locally from every rank's value, the same bits on every rank, at worlds 1, 2 and 3.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

#include "harness.h"

namespace fsdp_test {
namespace {

// What rank r contributes: a scalar with no short binary expansion, and a tensor.
double scalar_of(int r) { return 1.0 / (r + 3) + r; }
at::Tensor tensor_of(int r) { return at::arange(6, at::kFloat).reshape({2, 3}) * (r + 1) + 0.25f * r; }

FSDP_WORKER(mean_across_ranks_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  double scalar_sum = 0;
  at::Tensor tensor_sum = at::zeros({2, 3}, at::kFloat);
  for (int r = 0; r < ctx.world; ++r) {
    scalar_sum += scalar_of(r);
    tensor_sum += tensor_of(r);
  }
  const double mean = fsdp::mean_across_ranks(*pg, scalar_of(ctx.rank));
  const double expected = scalar_sum / ctx.world;
  WORKER_CHECK(std::abs(mean - expected) <= 1e-15 * std::abs(expected), "mean ", mean, ", expected ", expected);
  if (ctx.world == 1) WORKER_CHECK(mean == scalar_of(0), "a world of one changed the value: ", mean);

  const at::Tensor mine = tensor_of(ctx.rank);
  const at::Tensor before = mine.clone();
  const at::Tensor t = fsdp::mean_across_ranks(*pg, mine);
  WORKER_CHECK(torch::equal(mine, before), "the argument changed");
  WORKER_CHECK(t.sizes() == mine.sizes() && t.scalar_type() == at::kFloat, "result ", t.sizes(), " ", t.scalar_type());
  WORKER_CHECK(torch::allclose(t, tensor_sum / ctx.world, 1e-6, 0), "tensor mean ", t, " expected ",
               tensor_sum / ctx.world);
  const at::Tensor counts = fsdp::mean_across_ranks(*pg, at::full({3}, ctx.rank, at::kLong));
  WORKER_CHECK(counts.is_floating_point() && counts.allclose(at::full({3}, (ctx.world - 1) / 2.0, counts.options())),
               "integer mean ", counts);

  // Every rank got the same bits.
  auto all = at::empty({ctx.world}, at::kDouble);
  pg->world()->all_gather_into(all, at::tensor({mean}, at::kDouble))->wait();
  for (int r = 0; r < ctx.world; ++r)
    WORKER_CHECK(all[r].item<double>() == mean, "rank ", r, "'s mean is ", all[r].item<double>(), ", this rank's ",
                 mean);
  if (ctx.rank == 0) std::cout << "mean " << mean << " ok" << std::endl;
}

TEST(MeanAcrossRanks, EqualsTheLocalMeanOnEveryRankAtWorlds1To3) {
  for (int world : {1, 2, 3}) {
    auto r = launch("mean_across_ranks_worker", world);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, " ok")) << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
