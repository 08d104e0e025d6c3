// A candidate's fully_shard options and its one-line description (include/fsdp/plan_request.h).
#include <algorithm>
#include <sstream>

#include "fsdp/plan_request.h"

namespace fsdp {

Options Candidate::options() const {
  Options o;
  o.sharding_strategy(strategy)
      .sharding_factor(strategy == ShardingStrategy::kHybridShard ? sharding_factor : 0)
      .auto_wrap_policy(wrap.policy)
      .backward_prefetch(backward_prefetch)
      .forward_prefetch(forward_prefetch)
      .limit_all_gathers(all_gather_limit > 0)
      .all_gather_limit(std::max(1, all_gather_limit))
      .reductions_in_flight(reductions_in_flight)
      .reshard_after_forward_size(reshard_after_forward_size)
      .reshard_after_forward_policy(reshard_after_forward_policy)
      .all_gather_quantization(all_gather_quantization)
      .reduce_quantization(reduce_quantization)
      .deterministic(deterministic);
  if (precision != at::kFloat) o.mixed_precision(MixedPrecision().param_dtype(precision).reduce_dtype(at::kFloat));
  if (cpu_offload) o.offload(CpuOffload().params(true));
  return o;
}

WrapPolicy Candidate::checkpoint_policy() const {
  if (!activation_checkpointing) return nullptr;
  return checkpointed_unit_names.empty() ? wrap.policy : wrap::by_names(checkpointed_unit_names);
}

std::string Candidate::describe() const {
  std::ostringstream o;
  o << to_string(strategy);
  if (strategy == ShardingStrategy::kHybridShard) o << "/" << sharding_factor;
  if (reshard_after_forward_policy) o << ", reshard after forward by policy";
  if (reshard_after_forward_size > 0) o << ", reshard to groups of " << reshard_after_forward_size;
  o << ", wrap " << wrap.name << (activation_checkpointing ? ", checkpointed" : "");
  if (activation_checkpointing && checkpointed_units > 0) o << " first " << checkpointed_units;
  o << (cpu_offload ? ", offload" : "") << ", "
    << (precision == at::kFloat      ? "fp32"
        : precision == at::kBFloat16 ? "bf16"
                                     : "fp16")
    << ", micro-batch " << micro_batch << " x " << accumulation
    << (no_sync ? (keep_unsharded ? " no_sync unsharded" : " no_sync") : "")
    << (replica_deferred ? " replica-deferred" : "") << (step_in_backward ? ", step in backward" : "");
  auto quantized = [&o](const Quantization& q, const char* what) {
    if (!q.enabled()) return;
    o << ", " << to_string(q.dtype()) << " " << what;
    if (q.block_size() != Quantization().block_size()) o << " in blocks of " << q.block_size();
    if (q.error_feedback()) o << " with error feedback";
  };
  quantized(all_gather_quantization, "gathers");
  quantized(reduce_quantization, "reductions");
  if (deterministic) o << ", deterministic";
  if (all_gather_limit != 2) o << ", all-gather limit " << all_gather_limit;
  if (backward_prefetch != BackwardPrefetch::kBackwardPre) o << ", " << to_string(backward_prefetch);
  if (!forward_prefetch) o << ", no forward prefetch";
  if (reductions_in_flight != 2) o << ", " << reductions_in_flight << " reductions in flight";
  return o.str();
}

}  // namespace fsdp
