#pragma once
// Process spawning and supervision: one process per local rank, all stopped as soon as one
// fails or the launcher is interrupted.
#include "options.h"

namespace fsdp_run {

// Starts the ranks `options` describes and supervises them until all are gone and their output is
// forwarded; returns fsdp-run's exit code.
int launch(Options options);

}  // namespace fsdp_run
