#pragma once
// Glue between fsdp::Checkpointed (src/activation_checkpoint.cpp) and the runtime: a checkpointed
// forward runs without grad but counts as a forward with grad, and a recompute in backward starts
// the runtime's backward on the caller's graph task. See Note [Activation checkpointing] in
// docs/design.md.
#include <torch/torch.h>

namespace fsdp::detail {

// True on a thread inside a Checkpointed forward (run without grad; its backward recomputes it with grad).
bool in_checkpointed_forward();

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

// Called by a Checkpointed backward before it recomputes: every live runtime that manages a
// parameter of `module` begins its backward now, so its end-of-backward callback is queued on the
// backward running the checkpoint, not on the nested one that the recompute's backward runs.
void before_recompute(const torch::nn::Module& module);

}  // namespace fsdp::detail
