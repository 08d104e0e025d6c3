#include "runtime/checkpointed_forward.h"

namespace fsdp::detail {

namespace {
thread_local bool t_checkpointed_forward = false;
}  // namespace

bool in_checkpointed_forward() { return t_checkpointed_forward; }

CheckpointedForwardScope::CheckpointedForwardScope() : previous_(t_checkpointed_forward) {
  t_checkpointed_forward = true;
}

CheckpointedForwardScope::~CheckpointedForwardScope() { t_checkpointed_forward = previous_; }

}  // namespace fsdp::detail
