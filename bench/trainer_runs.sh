# Sourced by the trainer benchmarks (training_controls.sh, accumulation.sh) after `set -euo pipefail`,
# with their arguments: BUILD_DIR [REPEATS] [EXTRA FLAGS...]. Sets BUILD, REPEATS, TRAINER, RUN and
# EXTRA (the flags after REPEATS), one OpenMP thread per rank, and defines median.
usage="usage: $0 BUILD_DIR [REPEATS] [EXTRA FLAGS...]"
BUILD=${1:?$usage}
REPEATS=${2:-3}
shift $(($# >= 2 ? 2 : 1))
EXTRA=("$@")
TRAINER=$BUILD/examples/gpt/fsdp_gpt
RUN=$BUILD/tools/fsdp-run
export OMP_NUM_THREADS=1
# The median of the whitespace-separated numbers on stdin.
median() { tr ' ' '\n' | grep . | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }
