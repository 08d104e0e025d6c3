#pragma once
// fsdp-run --nnodes MIN:MAX: node 0's fsdp-run hosts a rendezvous store; every node's fsdp-run
// joins numbered rounds there, runs its ranks in the world the round agreed on, and on a failure
// anywhere stops them and joins the next round with the nodes still present. See Note [Elastic
// rendezvous across nodes] in docs/design.md.
#include "options.h"

namespace fsdp_run {

// Runs this node's part of an elastic job across nodes; returns fsdp-run's exit code.
int launch_elastic(const Options& options);

}  // namespace fsdp_run
