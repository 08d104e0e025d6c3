#pragma once
// Loading a sharded checkpoint at any world size, strategy and wrap policy: the manifest is read
// and checked against the model, and each rank reads only the saved byte ranges its shard pieces
// (and their optimizer state) overlap. See Note [Checkpoint format] in docs/design.md.
#include <torch/torch.h>

#include <string>

#include "checkpoint/manifest.h"
#include "runtime/fsdp_state.h"

namespace fsdp::checkpoint::detail {

// The manifest of a complete checkpoint at `dir`; throws fsdp::Error naming what is missing.
Manifest read_manifest(const std::string& dir);
// Whether `dir` holds a complete checkpoint (manifest and every file at its size); its manifest in `out`.
bool complete_manifest(const std::string& dir, Manifest* out);
// This rank's part of a load (local; the caller agrees failures across ranks): `m` receives the
// manifest. The optimizer, if any, holds only this model's shard pieces.
void load_local(const std::string& dir, FsdpState& state, torch::optim::Optimizer* optimizer, Manifest& m);

}  // namespace fsdp::checkpoint::detail
