// PlanRequest's values checked before a plan (request_checks.h).
#include "planner/request_checks.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "fsdp/check.h"

namespace fsdp::planner {

void check_request(const PlanRequest& r, const Cluster& cluster) {
  FSDP_CHECK(r.world() >= 0 && r.world() <= cluster.world(), "PlanRequest::world is ", r.world(), "; the cluster (",
             cluster.nodes, "x", cluster.ranks_per_node, ") has ", cluster.world(),
             " ranks: give 0 (all of them) or fewer, or a cluster of that shape (NAME:NODESxRANKS_PER_NODE)");
  for (const auto& [value, what] : {std::pair<double, const char*>{double(r.memory_budget()), "memory_budget"},
                                    {double(r.global_batch()), "global_batch"},
                                    {double(r.optimizer_states()), "optimizer_states"},
                                    {double(r.process_bytes()), "process_bytes"},
                                    {r.allocator_headroom(), "allocator_headroom"}})
    FSDP_CHECK(value >= 0, "PlanRequest::", what, " is ", value, "; it must be >= 0");
  FSDP_CHECK(r.batch_per_rank() >= 1, "PlanRequest::batch_per_rank must be >= 1, got ", r.batch_per_rank());
  FSDP_CHECK(r.trace_sequences() >= 1, "PlanRequest::trace_sequences must be >= 1, got ", r.trace_sequences());
  auto nonempty = [](size_t n, const char* what) {
    FSDP_CHECK(n > 0, "PlanRequest::", what, " is empty: nothing to plan; give it at least one value");
  };
  nonempty(r.strategies().size(), "strategies");
  nonempty(r.wrap_policies().size(), "wrap_policies");
  nonempty(r.activation_checkpointing().size(), "activation_checkpointing");
  nonempty(r.checkpointed_shares().size(), "checkpointed_shares");
  for (const double share : r.checkpointed_shares())
    FSDP_CHECK(share > 0 && share <= 1, "PlanRequest::checkpointed_shares holds ", share,
               "; a share of the units is above 0 and at most 1");
  nonempty(r.cpu_offload().size(), "cpu_offload");
  nonempty(r.precisions().size(), "precisions");
  nonempty(r.all_gather_limits().size(), "all_gather_limits");
  nonempty(r.backward_prefetch().size(), "backward_prefetch");
  nonempty(r.forward_prefetch().size(), "forward_prefetch");
  nonempty(r.reductions_in_flight().size(), "reductions_in_flight");
  nonempty(r.no_sync().size(), "no_sync");
  nonempty(r.replica_deferred().size(), "replica_deferred");
  nonempty(r.keep_unsharded().size(), "keep_unsharded");
  nonempty(r.step_in_backward().size(), "step_in_backward");
  for (const int m : r.micro_batches())
    FSDP_CHECK(m >= 1, "PlanRequest::micro_batches holds ", m, "; a micro-batch is 1 or more sequences");
  for (size_t i = 0; i < r.wrap_policies().size(); ++i)
    for (size_t j = 0; j < i; ++j)
      FSDP_CHECK(r.wrap_policies()[i].name != r.wrap_policies()[j].name,
                 "PlanRequest::wrap_policies names two policies '", r.wrap_policies()[i].name,
                 "': give each its own name, which the plan's candidates carry");
  for (const at::ScalarType p : r.precisions())
    FSDP_CHECK(p == at::kFloat || p == at::kBFloat16 || p == at::kHalf, "PlanRequest::precisions holds ",
               c10::toString(p), "; the compute precisions are kFloat, kBFloat16 and kHalf");
  if (cluster.device_is_host &&
      std::find(r.precisions().begin(), r.precisions().end(), at::kHalf) != r.precisions().end()) {
    bool products = true;
    try {
      at::mm(at::ones({1, 1}, at::kHalf), at::ones({1, 1}, at::kHalf));
    } catch (const std::exception&) {
      products = false;
    }
    FSDP_CHECK(products, "PlanRequest::precisions holds kHalf for a CPU cluster, and this LibTorch has no fp16 matrix "
                         "product on the CPU: no fp16 candidate could run; plan kBFloat16 instead");
  }
  for (const int l : r.all_gather_limits())
    FSDP_CHECK(l >= 0, "PlanRequest::all_gather_limits holds ", l, "; a limit is 0 (none) or more gathers");
  for (const int n : r.reductions_in_flight())
    FSDP_CHECK(n >= 0, "PlanRequest::reductions_in_flight holds ", n, "; give 0 or more");
}

}  // namespace fsdp::planner
