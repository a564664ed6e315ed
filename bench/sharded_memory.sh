#!/usr/bin/env bash
# Peak resident memory per process of sharded MPI runs (docs/results/benchmarks.md,
# "Sharded expert parallelism"): qwen3-235b-a22b at its real sizes, one rank
# per process, each holding its own experts. Needs about 20 GB free; a run
# that does not fit is killed by the kernel (exit 137) and reported so.
#   bench/sharded_memory.sh [OUTDIR]
set -uo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-sharded-memory}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source "$(dirname "$0")/record_header.sh"
record_header "$0 $*" | tee "$out/cpu.txt"
run() {  # NAME NP ARGS...
  local name=$1 np=$2; shift 2
  mpirun -np "$np" --oversubscribe "$hpmoe" run -P "$np" --transport mpi -T 256 --mode interleaved --iters 1 \
    --warmup 0 --verify sample --sample 4 --no-pin --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $?"
  grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ " "$out/$name.txt" | awk '{print "  rank " $1 ": peak RSS " $NF " MB"}'
}
for np in 1 2 4; do run fwd-fp32-p$np $np --preset qwen3-235b-a22b; done
for np in 1 2 4; do run bwd-fp32-e64-p$np $np --preset qwen3-235b-a22b --set routed_experts=64 --backward; done
for np in 1 2 4; do run bwd-bf16-p$np $np --preset qwen3-235b-a22b --dtype bf16 --backward; done
