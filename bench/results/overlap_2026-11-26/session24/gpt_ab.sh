#!/bin/bash
# A/B: the last block kept for backward (default) vs. not (FSDP_AB_NO_KEEP=1, a local switch), interleaved.
set -e
cd /work/main
B=build/bench/gpt_bench
export OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864
for size in "compute 4 256 4 64 4" "comm 4 512 8 32 1"; do
  set -- $size; name=$1; L=$2; W=$3; H=$4; C=$5; B1=$6
  for world in 2 4; do
    args="--layers $L --width $W --heads $H --context $C --global-batch $((B1*world)) --warmup 2 --steps 6"
    $B --write-inputs /tmp/abg/in-$name-$world.bin $args >/dev/null
    for rep in 1 2 3 4 5; do
      for v in keep nokeep; do
        envs=""; [ $v = nokeep ] && envs="FSDP_AB_NO_KEEP=1"
        env $envs build/tools/fsdp-run --nproc-per-node $world --threads-per-rank 1 --no-prefix $B $args --inputs /tmp/abg/in-$name-$world.bin --result /tmp/abg/r-$name-$world-$v-$rep.json --label $v >/dev/null 2>&1 || echo "FAIL $name $world $v $rep"
      done
    done
  done
done
