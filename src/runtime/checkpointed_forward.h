#pragma once
// Whether this thread runs a Checkpointed forward (fsdp::Checkpointed, src/activation_checkpoint.cpp):
// it runs without grad, yet its parameter reads count as a forward with grad, since its backward
// recomputes it with grad. See Note [Activation checkpointing] in docs/design.md.
#include <torch/torch.h>

namespace fsdp::detail {

// True on a thread inside a Checkpointed forward.
bool in_checkpointed_forward();

// Marks this thread as inside a Checkpointed forward for its lifetime.
class CheckpointedForwardScope {
 public:
  CheckpointedForwardScope();
  ~CheckpointedForwardScope();
  CheckpointedForwardScope(const CheckpointedForwardScope&) = delete;
  CheckpointedForwardScope& operator=(const CheckpointedForwardScope&) = delete;

 private:
  bool previous_;
};

// A forward whose parameter reads will have a backward: grad mode is on, or a Checkpointed forward runs.
inline bool forward_with_grad() { return at::GradMode::is_enabled() || in_checkpointed_forward(); }

}  // namespace fsdp::detail
