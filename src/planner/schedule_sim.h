#pragma once
// The planner's replay of one training iteration as the runtime schedules it (src/runtime/
// scheduler.cpp, gradient_reducer.cpp): unshard, prefetch under the rate limiter, reshard, gradient
// buffers, reductions in flight; every allocation and free FSDP's memory tracker counts, and the
// compute thread and communication lanes in modeled time. See Note [Planner schedule simulation].
#include <cstdint>
#include <vector>

#include "planner/sim_input.h"

namespace fsdp::planner {

struct SimResult {
  int64_t param_transient_peak = 0;  // over the resting shards
  int64_t grad_transient_peak = 0;   // over the shard pieces' gradients
  int64_t activation_peak = 0;
  int64_t total_transient_peak = 0;  // params + grads + activations at one moment
  // What the runtime's buffer pool holds once warm (Note [Buffer reuse]): per byte size, the most
  // transient FSDP buffers of that size alive at once, times the size.
  int64_t pool_bytes = 0;
  double step_s = 0;
  double forward_s = 0;  // when the forward's last stretch ends
  double compute_s = 0;
  double exposed_s = 0;
  int collectives = 0;     // gathers and reductions issued
  double wait_weight = 0;  // their waits on peers blocked, counted in world-wide collectives'
  int max_unsharded_units = 0;
};

// Replays a steady-state iteration (the second and later: forward prefetch follows the previous
// forward's order, the unit backward needs first is kept from forward).
SimResult simulate(const SimInput& input);

}  // namespace fsdp::planner
