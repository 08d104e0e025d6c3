// CPU offload (Options::offload): refused with the fix where it means nothing (a CPU process
// group); the model is left usable, as if fully_shard() had not been called.
#include <gtest/gtest.h>

#include <cmath>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

FSDP_WORKER(offload_on_cpu_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 1, 8);
  bool refused = false;
  try {
    fsdp::fully_shard(model, pg, fsdp::Options().offload(fsdp::CpuOffload().params(true)));
  } catch (const fsdp::Error& e) {
    refused = true;
    WORKER_CHECK(contains(e.what(), "nothing to offload") && contains(e.what(), "remove .offload(...)"),
                 "message: ", e.what());
  }
  WORKER_CHECK(refused, "offload on a CPU process group was accepted");
  // Off (the default) changes nothing: the same model shards and trains.
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().offload(fsdp::CpuOffload().params(false)));
  auto loss = model->forward(torch::randint(0, 32, {2, 8})).sum();
  loss.backward();
  WORKER_CHECK(std::isfinite(loss.item<double>()), "loss ", loss.item<double>());
}

TEST(Offload, OnACpuProcessGroupIsAClearErrorOnEveryRank) {
  auto r = launch("offload_on_cpu_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
