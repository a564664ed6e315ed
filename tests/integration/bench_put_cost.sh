#!/usr/bin/env bash
# bench_put_cost (what the MPI transport's puts cost a computing core; it
# feeds bench/cluster_sweep.sh's model): a short run prints a line per put
# size and the fit, with finite figures; and every bad flag gets one line
# naming the flag and exit code 2, on every rank, no hang.
set -euo pipefail
: "${BENCH:?}" "${MPIRUN:?}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"  # Open MPI's own allocations at exit
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/ompi"
export OMPI_MCA_orte_tmpdir_base="$tmp/ompi"
bench() { timeout 120 "$MPIRUN" -np "${NP:-2}" --oversubscribe --mca btl self,tcp "$BENCH" "$@"; }

# A stream and bursts (with the transport's kept buffers and with fresh ones),
# one way and both ways, 1 MiB each; the prefix scripts/cluster.sh puts in front is accepted.
for shape in "--window 4" "--burst 4" "--burst 4 --buffers fresh" "--window 4 --direction both" "--burst 4 --direction both"; do
  # shellcheck disable=SC2086
  bench run -P 2 --transport mpi --mpi-path network --bytes 1048576 --put-bytes 65536,8192 --reps 1 $shape > "$tmp/out.txt"
  python3 - "$tmp/out.txt" "$shape" <<'PY'
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
sizes = [l["put_bytes"] for l in lines if not l.get("fit")]
assert sizes == [65536, 8192], sizes
fit = [l for l in lines if l.get("fit")]
assert len(fit) == 1, lines
for l in lines:
    for k, v in l.items():
        if isinstance(v, float):
            assert math.isfinite(v) and v >= 0, (k, v)
assert all(l["goodput_bytes_per_s"] > 0 for l in lines if not l.get("fit"))
both = "--direction both" in sys.argv[2]
assert all(l["direction"] == ("both" if both else "one-way") for l in lines), lines
if both:  # each core's cost, sending and receiving, is in the sender's fields
    assert all(l["receiver_s_per_put"] == 0 for l in lines), lines
PY
done

bad() {  # bad EXPECTED ARGS...: fails with exit code 2 and one line naming it
  local expected=$1; shift
  local rc=0
  bench "$@" > "$tmp/bad.txt" 2>&1 || rc=$?
  [ "$rc" = 2 ] || { cat "$tmp/bad.txt"; echo "bench_put_cost $*: exit code $rc, not 2"; exit 1; }
  grep -q -- "$expected" "$tmp/bad.txt" || { cat "$tmp/bad.txt"; echo "bench_put_cost $*: no '$expected'"; exit 1; }
}
bad "--bytes takes a whole number" --bytes 12
bad "--bytes takes a number" --bytes lots
bad "--put-bytes (each size) takes a whole number" --put-bytes 65536,100
bad "--put-bytes (each size) takes a number" --put-bytes 65536,
bad "--reps takes a whole number" --reps 0
bad "--window takes a whole number" --window 1.5
bad "--burst takes a number" --burst nan
bad "--peer-timeout takes a number" --peer-timeout inf
bad "--peer-timeout takes a positive number" --peer-timeout -1
bad "unknown flag --brust" --brust 16
bad "--buffers takes reuse or fresh" --buffers pooled
bad "--direction takes one-way or both" --direction two
bad "--reps needs a value" --reps
bad "unknown flag -P" -P 2
NP=3 bad "run with 2 processes" --bytes 1048576
echo "bench_put_cost: all passed"
