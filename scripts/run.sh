#!/usr/bin/env bash
# The main job: sets up (Debian packages), builds, then trains the example GPT on real text
# (Debian's fortunes) with 4 local ranks, FULL_SHARD, through the fsdp-run launcher.
# Extra arguments go to the trainer, e.g. scripts/run.sh --steps 50 --strategy SHARD_GRAD_OP
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
exec build/tools/fsdp-run --nproc-per-node "${NPROC:-4}" build/examples/gpt/fsdp_gpt "$@"
