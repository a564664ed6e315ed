#!/usr/bin/env bash
# Per-step host costs per rank of sharded MPI runs (docs/results/benchmarks.md):
# route, count exchange, compile, verify, prepare, next to the launch, at
# P = 2 and 4 on the shared-memory and the network (TCP) paths, each with
# the count exchange both ways (collective, one-sided).
#   bench/sharded_host.sh [OUTDIR]
set -uo pipefail
hpmoe=${HPMOE:-build/hpmoe}
out=${1:-sharded-host}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source "$(dirname "$0")/record_header.sh"
record_header "$0 $*" | tee "$out/cpu.txt"
for np in 2 4; do for variant in shared network shared-one-sided network-one-sided; do
  path=${variant%%-*} btl=() exchange=collective
  [ "$path" = network ] && btl=(--mca btl self,tcp)
  [ "${variant#*-}" = one-sided ] && exchange=one-sided
  mpirun -np "$np" --oversubscribe "${btl[@]}" "$hpmoe" run -P "$np" --transport mpi --mpi-path "$path" \
    --count-exchange "$exchange" --preset deepseek-v2-lite -T 128 --backward --iters 5 --warmup 1 --verify sample \
    --sample 4 --no-pin --json "$out/p$np-$variant.json" > "$out/p$np-$variant.txt" 2>&1
  echo "P=$np $variant: exit $?"
  grep -E "host side|^interleaved" "$out/p$np-$variant.txt"
done; done
