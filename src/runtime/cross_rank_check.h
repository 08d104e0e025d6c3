#pragma once
// The cross-rank check of fully_shard(): every rank describes the Options that decide which
// collectives run, and the model it built (units, parameters, shapes, dtypes), and every rank
// fails naming the first difference, instead of hanging in, or mixing up, collectives. See Note
// [Cross-rank model check] in docs/design.md.
#include <string>
#include <vector>

#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "unit_plan.h"

namespace fsdp {

// The Options that decide which collectives run, one per line.
std::string describe_options(const Options& options);
// The model as sharded: strategy, factor F, mixed precision, each unit's reshard after forward,
// and the unit plan, one item per line.
std::string describe_model(const Options& options, int sharding_factor, const std::vector<bool>& reshard_after_forward,
                           const UnitPlan& plan);
// Collective over the process group: publishes `mine` through its store and compares every
// rank's; fails with "rank A and rank B <differ>; first difference ...  <fix>" on every rank, or
// names a rank that never arrived or exited.
void check_same_on_all_ranks(ProcessGroup& pg, const std::string& mine, const char* differ, const char* fix);

}  // namespace fsdp
