// FlatParam (src/flat_param.h) with its collectives (src/flat_param_collectives.h) and gradient
// (src/flat_grad.h): flatten, pad, shard, unshard in place, reshard, and the gradient path, on one
// rank playing rank r of F through a communicator that stands in for the others.
#include <gtest/gtest.h>

#include "buffer_pool.h"
#include "flat_param.h"
#include "flat_param_collectives.h"
#include "memory_tracker.h"

namespace {

class DoneWork : public fsdp::Work {
 public:
  void wait() override {}
  bool completed() const override { return true; }
};

// Rank `rank` of `size` ranks whose every member holds the same full values: an all-gather writes
// `full` (the padded flat values every rank agrees on) and keeps this rank's part as given; a
// reduce-scatter returns size() times this rank's part (every rank had the same gradient).
class StandInCommunicator : public fsdp::Communicator {
 public:
  StandInCommunicator(int rank, int size, at::Tensor full) : rank_(rank), size_(size), full_(std::move(full)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "stand-in"; }
  std::string transport() const override { return "none"; }
  fsdp::WorkPtr all_gather_into(at::Tensor out, at::Tensor in, fsdp::CollectiveOptions) override {
    ++gathers;
    out.copy_(full_);
    out.narrow(0, rank_ * in.numel(), in.numel()).copy_(in);
    return std::make_shared<DoneWork>();
  }
  fsdp::WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, fsdp::CollectiveOptions) override {
    out.copy_(in.narrow(0, rank_ * out.numel(), out.numel()) * size_);
    return std::make_shared<DoneWork>();
  }
  fsdp::WorkPtr all_reduce(at::Tensor t, fsdp::CollectiveOptions) override {
    t.mul_(size_);
    return std::make_shared<DoneWork>();
  }
  fsdp::WorkPtr broadcast(at::Tensor, int, fsdp::CollectiveOptions) override { return std::make_shared<DoneWork>(); }
  void barrier() override {}
  int gathers = 0;

 private:
  int rank_, size_;
  at::Tensor full_;
};

struct Fixture {
  // Two parameters of 6 and 5 elements: 11 elements, padded to 12 for F = 4 (3 per shard).
  Fixture(int rank, int F) {
    a = torch::arange(6, torch::kFloat64).view({2, 3}).clone();
    a.set_requires_grad(true);
    b = torch::arange(5, torch::kFloat64) + 100;
    b.set_requires_grad(true);
    at::Tensor full =
        torch::cat({a.detach().view(-1), b.detach(), torch::zeros({(11 + F - 1) / F * F - 11}, torch::kFloat64)});
    comm = std::make_shared<StandInCommunicator>(rank, F, full);
    groups.shard_comm = comm;
    groups.world_comm = comm;
    groups.world_size = F;
    groups.sharding_factor = F;
    groups.keep_unsharded = F == 1;
    std::vector<fsdp::ParamSlot> slots(2);
    slots[0].name = "a";
    slots[0].param = a;
    slots[1].name = "b";
    slots[1].param = b;
    fp = std::make_unique<fsdp::FlatParam>(0, 0, std::move(slots), groups, fsdp::MixedPrecision(), &memory, &pool);
  }
  at::Tensor a, b;
  std::shared_ptr<StandInCommunicator> comm;
  fsdp::ShardingGroups groups;
  fsdp::MemoryTracker memory;
  fsdp::BufferPool pool;
  std::unique_ptr<fsdp::FlatParam> fp;
};

TEST(FlatParam, PadsToAMultipleOfFAndGivesEachParameterThePieceInThisShard) {
  for (int rank = 0; rank < 4; ++rank) {
    Fixture f(rank, 4);
    EXPECT_EQ(f.fp->numel(), 11);
    EXPECT_EQ(f.fp->padded_numel(), 12);
    EXPECT_EQ(f.fp->shard_numel(), 3);
    const auto& slots = f.fp->slots();
    // Shard r holds flat elements [3r, 3r + 3): a is [0, 6), b is [6, 11).
    const int64_t lo = 3 * rank, hi = lo + 3;
    const int64_t a_n = std::max<int64_t>(0, std::min<int64_t>(hi, 6) - lo);
    const int64_t b_n = std::max<int64_t>(0, std::min<int64_t>(hi, 11) - std::max<int64_t>(lo, 6));
    EXPECT_EQ(slots[0].piece.defined() ? slots[0].piece.numel() : 0, a_n) << "rank " << rank;
    EXPECT_EQ(slots[1].piece.defined() ? slots[1].piece.numel() : 0, b_n) << "rank " << rank;
    // The pieces hold this rank's values: a's flat values are 0..5, b's are 100..104.
    if (a_n) {
      EXPECT_EQ(slots[0].piece[0].item<double>(), double(lo));
    }
    if (b_n) {
      EXPECT_EQ(slots[1].piece[0].item<double>(), 100.0 + std::max<int64_t>(lo, 6) - 6);
    }
    EXPECT_TRUE(slots[0].param.is_same(f.a));  // the module keeps its parameter objects
  }
}

TEST(FlatParam, ReshardFreesTheStorageAndUnshardRefillsItInPlace) {
  Fixture f(1, 4);
  f.fp->reshard();
  EXPECT_FALSE(f.fp->is_unsharded());
  EXPECT_EQ(f.a.storage().nbytes(), 0u);
  const void* impl = f.a.unsafeGetTensorImpl();
  fsdp::unshard(*f.fp);
  EXPECT_TRUE(f.fp->is_unsharded());
  EXPECT_EQ(f.a.unsafeGetTensorImpl(), impl);
  EXPECT_TRUE(torch::equal(f.a, torch::arange(6, torch::kFloat64).view({2, 3})));
  EXPECT_TRUE(torch::equal(f.b, torch::arange(5, torch::kFloat64) + 100));
  // Changing the shard (an optimizer step) makes the unsharded copy stale until gathered again.
  {
    torch::NoGradGuard no_grad;
    f.fp->slots()[0].piece.add_(1);  // rank 1 holds a's flat elements 3..5
  }
  EXPECT_TRUE(f.fp->unsharded_is_stale());
  fsdp::unshard(*f.fp);
  EXPECT_FALSE(f.fp->unsharded_is_stale());
  EXPECT_EQ(f.a.view(-1)[3].item<double>(), 4.0);
  EXPECT_EQ(f.comm->gathers, 2);
}

TEST(FlatParam, GradientsReachThePiecesAveragedOverTheWorld) {
  Fixture f(2, 4);  // shard 2: flat elements 6..8, all in b
  fsdp::unshard(*f.fp);
  f.fp->grad().ensure_buffer();
  f.b.mutable_grad() = torch::full({5}, 3.0, torch::kFloat64);  // as AccumulateGrad leaves it
  f.fp->grad().take(1);
  f.fp->slots()[1].got_grad = true;
  // Moved into the flat buffer; .grad is left a zero with stride 0 (Note [Gradient sentinel]),
  // which the reduction does not take for a gradient.
  ASSERT_TRUE(f.b.grad().defined());
  EXPECT_EQ(f.b.grad().stride(0), 0);
  EXPECT_EQ(f.b.grad().abs().sum().item<double>(), 0.0);
  fsdp::start_reduction(*f.fp);
  fsdp::finish_reduction(*f.fp);
  const auto& piece = f.fp->slots()[1].piece;
  ASSERT_TRUE(piece.grad().defined());
  // Every rank had gradient 3: the sum over 4 ranks, averaged, is 3 again.
  EXPECT_TRUE(torch::allclose(piece.grad(), torch::full({3}, 3.0, torch::kFloat64)));
  EXPECT_FALSE(f.fp->slots()[0].piece.defined());  // a has no elements in shard 2
  EXPECT_EQ(f.memory.stats().grad_bytes, 0);       // the pieces' gradients are the user's
}

TEST(FlatParam, AWorldOfOneKeepsTheParametersUnshardedAndTheGradientsAliasOneBuffer) {
  Fixture f(0, 1);
  EXPECT_TRUE(f.fp->keep_unsharded());
  EXPECT_EQ(f.fp->padded_numel(), 11);
  f.fp->reshard();  // nothing to free
  EXPECT_GT(f.a.storage().nbytes(), 0u);
  EXPECT_EQ(fsdp::start_all_gather(*f.fp), nullptr);
  f.fp->grad().ensure_buffer();
  f.a.mutable_grad() = torch::ones({2, 3}, torch::kFloat64);
  f.fp->grad().take(0);
  f.fp->slots()[0].got_grad = true;
  fsdp::start_reduction(*f.fp);
  fsdp::finish_reduction(*f.fp);
  const auto& g = f.fp->slots()[0].piece.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_TRUE(torch::equal(g, torch::ones({6}, torch::kFloat64)));
  EXPECT_FALSE(f.fp->slots()[1].piece.grad().defined());  // b got no gradient: none, as in local training
}

}  // namespace
