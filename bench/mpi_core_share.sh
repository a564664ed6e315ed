#!/usr/bin/env bash
# What sharing a core with the MPI transport costs a rank's workers: the same
# layer step in process, and as one MPI process pinned to one core (its
# progress thread on the workers' core, as on scripts/cluster.sh's hosts) and
# unpinned (the thread free to run on another core), alternating, ROUNDS
# times. Prints the serialized and interleaved dispatch-to-combine medians.
#   bench/mpi_core_share.sh [build/hpmoe] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
hpmoe=${1:-build/hpmoe}
rounds=${2:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
layer=(--preset deepseek-v2-lite --set routed_experts=16 -T 256 --routing uniform --iters 4 --warmup 1 --verify off --mode both)
medians() { grep -oE 'dispatch-to-combine [0-9.]+' | awk '{printf "%s ms  ", $2}'; }
source bench/record_header.sh  # from the repository root (the cd above)
record_header "$0 $*"
echo "serialized / interleaved forward, deepseek-v2-lite (16 experts), 256 tokens, one rank, one worker"
for i in $(seq "$rounds"); do
  echo "round $i"
  echo "  in process, core 0:        $(taskset -c 0 "$hpmoe" run -P 1 -W 1 "${layer[@]}" 2>&1 | medians)"
  echo "  mpirun --bind-to core:     $(mpirun -np 1 --bind-to core "$hpmoe" run -P 1 --transport mpi --mpi-path network "${layer[@]}" 2>&1 | medians)"
  echo "  mpirun --bind-to none:     $(mpirun -np 1 --bind-to none "$hpmoe" run -P 1 --transport mpi --mpi-path network "${layer[@]}" 2>&1 | medians)"
done
