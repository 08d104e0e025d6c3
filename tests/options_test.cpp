// Options: sharding strategy names are parsed, and an unknown one is refused naming the choices.
#include <gtest/gtest.h>

#include "harness.h"

namespace fsdp_test {
namespace {

TEST(Options, UnknownStrategyName) {
  try {
    fsdp::parse_sharding_strategy("FULLSHARD");
    FAIL();
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD"));
  }
}

}  // namespace
}  // namespace fsdp_test
