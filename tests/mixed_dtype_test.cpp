// Mixed dtypes: one unit holding float and double parameters trains as local training does.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

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

TEST(MixedDtype, FloatAndDoubleInOneUnitMatchLocalTraining) {
  auto r = launch("mixed_dtype_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
