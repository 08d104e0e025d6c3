#pragma once
// SIGTERM with --save-dir: finish the step, save, and stop, on every rank after the same step.
#include <fsdp/fsdp.h>

namespace fsdp_gpt {

// Preemption (Slurm, Kubernetes) sends SIGTERM before killing: finish the step, save, exit.
void install_stop_handler();

// True on every rank when any rank got SIGTERM, so that all stop after the same step.
bool stop_requested_anywhere(fsdp::ProcessGroup& pg);

}  // namespace fsdp_gpt
