#!/usr/bin/env bash
# Sharded expert parallelism over MPI end to end: each process holds only
# its rank's tokens and experts (the serialized baseline runs operator by
# operator over the same transport): 2, 3 and 4 processes, shared-memory
# windows and the network path (forced onto TCP), fp32/bf16,
# forward+backward, every scheduler policy; each run checks every rank's
# tokens against the oracle, and with --check-inprocess every output and
# gradient bit for bit against the whole layer run in process on rank 0.
# Then faults on purpose: a rank that dies, one that freezes, one that stalls
# must end the job with an error within seconds, never hang.
set -Eeuo pipefail
: "${HPMOE:?}" "${HPMOE_SOURCE_DIR:?}" "${MPIRUN:?}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"  # Open MPI's own allocations at exit
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# A failed assertion (a grep -q, a test) says which line failed and shows the
# run it looked at, instead of ending the script silently.
trap 'rc=$?; echo "cli_mpi.sh: line $LINENO failed (exit $rc): $BASH_COMMAND"; for f in "$tmp"/*.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 60 "$f"; }; done; exit $rc' ERR
# Session directories apart from other mpiruns on this machine (tests/integration/cluster.sh runs alongside).
mkdir -p "$tmp/ompi"
export OMPI_MCA_orte_tmpdir_base="$tmp/ompi"
trace="trace:$HPMOE_SOURCE_DIR/data/routing/mixtral-8x7b/coding.json:8"

mpi() {  # mpi NP PATH ARGS...
  local np=$1 path=$2; shift 2
  local btl=()
  # network: no shared memory at all between the processes; hybrid: the messages across nodes over TCP too
  [ "$path" = network ] || [ "$path" = hybrid ] && btl=(--mca btl self,tcp)
  timeout 120 "$MPIRUN" -np "$np" --oversubscribe "${btl[@]}" "$HPMOE" run -P "$np" --transport mpi --mpi-path "$path" --check-inprocess "$@"
}

check() {  # check NP PATH ARGS...: passes, and the bit-identity checks ran
  mpi "$@" > "$tmp/out.txt" 2>&1 || { cat "$tmp/out.txt"; echo "FAILED: $*"; exit 1; }
  grep -q "verify   PASS" "$tmp/out.txt"
  grep -q "interleaved (mpi) = in-process serialized: bit-identical, all" "$tmp/out.txt"
  grep -q "interleaved over mpi" "$tmp/out.txt"
  # The serialized baseline ran phased over the same transport, and both match the in-process executor.
  test "$(grep -c "= in-process serialized: bit-identical, all" "$tmp/out.txt")" -eq 2
}

for path in shared network; do
  check 2 $path -T 96 --backward --routing zipf:1.2
  check 4 $path -T 64 --backward --dtype bf16 --routing "$trace"
done
for policy in fill rank-rotated critical-path interleave-wgrad ratr; do
  check 2 network -T 80 -W 2 --backward --routing uniform --schedule $policy --iters 1 --warmup 0
done
check 4 shared --preset qwen3-30b-a3b --set hidden=256 --set expert_inter=64 --set routed_experts=16 \
  -T 64 --backward --dtype bf16 --routing zipf:1.2 --iters 1
grep -q "bit-identical, all 35 tensors" "$tmp/out.txt"  # out, dx, router, 16 x (w1, w2); no shared experts
# Placement as data over MPI: 8 experts on 3 processes (2, 3, 3), and a random permutation.
check 3 shared --set routed_experts=8 -T 40 --backward --routing "$trace" --placement round-robin --iters 1
check 3 network --set routed_experts=8 -T 40 --backward --dtype bf16 --placement random:5 --iters 1

# Replicated experts (the hot expert 0 on every rank, expert 5 on two, a
# budget of 4 slots): per-step quotas, replica gradients summed into the owner
# in rank order; bit for bit against the same placement in process.
echo '{"experts_of_rank": [[0, 1, 2], [0, 3, 4, 5], [0, 5, 6, 7]], "replicas": true, "slots_per_rank": 4}' > "$tmp/replicas.json"
check 3 shared --set routed_experts=8 -T 64 --backward --routing hot:0.45 --placement "$tmp/replicas.json" --iters 2
check 3 network --set routed_experts=8 -T 64 --backward --dtype bf16 --routing "$trace" --placement "$tmp/replicas.json" --iters 1
# Tensor-parallel splits over MPI: expert 0 in three column parts (one per
# process, uneven), next to a replicated expert; each process packs only its
# part, the sources reduce the partials, the owner gathers the split
# expert's gradient in rank order; bit for bit against the same placement in
# process, with the per-rank proof and with the whole-set audit.
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 3, 4, 5], [0, 5, 6, 7]], "replicas": true, "splits": [{"expert": 0, "columns": [0, 8, 12, 16]}]}' > "$tmp/splits.json"
check 3 shared --set routed_experts=8 -T 64 --backward --routing hot:0.45 --placement "$tmp/splits.json" --iters 2
check 3 network --set routed_experts=8 -T 64 --backward --dtype bf16 --routing "$trace" --placement "$tmp/splits.json" --iters 1
check 3 shared --set routed_experts=8 -T 64 --backward --routing zipf:1.2 --placement "$tmp/splits.json" --iters 1 --verify-all-ranks

# A rank that owns no expert (it receives nothing, and all its tokens go
# elsewhere), and a hot expert that takes most of the rows.
echo '{"experts_of_rank": [[0, 1, 2, 3, 4, 5, 6, 7], [], []], "allow_empty_ranks": true}' > "$tmp/one-rank.json"
check 3 shared --set routed_experts=8 -T 40 --backward --placement "$tmp/one-rank.json" --iters 1
grep -Eq "^ +1 +0 +0 " "$tmp/out.txt"  # rank 1: no experts, no rows in
check 3 network --set routed_experts=8 -T 40 --backward --dtype bf16 --routing hot:0.45 --iters 1
check 2 shared -T 64 --backward --routing uniform --iters 1

# The dispatch encoded on the way (fp8 codes and scales, bf16 under an fp32
# layer): the staged rows travel as bytes over both paths; bit for bit
# against the same encoding in process, and the oracle encodes the same way.
check 3 shared --set hidden=256 -T 64 --backward --routing zipf:1.2 --dispatch-dtype fp8 --iters 1
check 2 network --set hidden=256 -T 64 --backward --dtype bf16 --routing "$trace" --dispatch-dtype fp8 --iters 1
check 2 network -T 64 --backward --routing uniform --dispatch-dtype bf16 --iters 1

# The per-rank exchange: token blocks and routes travel once per (token,
# rank), gathered on arrival; the token counts per destination take a second
# count exchange each step (one-sided and collective). With replicas and
# splits, encoded, and the per-rank proof audited against the whole set.
check 3 shared -T 64 --set top_k=4 --set routed_experts=16 --backward --routing zipf:1.2 --exchange rank --iters 2
check 3 network -T 64 --backward --dtype bf16 --routing "$trace" --exchange rank --iters 2
check 3 shared --set routed_experts=8 -T 64 --backward --routing hot:0.45 --placement "$tmp/splits.json" --exchange rank \
  --iters 2 --count-exchange collective
check 3 network --set hidden=256 -T 64 --backward --routing zipf:1.2 --dispatch-dtype fp8 --exchange rank --iters 1 \
  --count-exchange one-sided --verify-all-ranks
# The per-node exchange: 4 ranks in 2 nodes, a token once per node through
# the forwarder there, its sums back through it (checked against the
# in-process run bit for bit), with bf16 sums on the network path.
check 4 network --set hidden=256 -T 48 --set top_k=4 --set routed_experts=16 --set ranks_per_node=2 --backward \
  --routing zipf:1.2 --dispatch-dtype fp8 --combine-dtype bf16 --exchange rank --iters 2 --verify-all-ranks
check 4 shared -T 48 --set ranks_per_node=2 --backward --dtype bf16 --routing "$trace" --exchange rank --iters 1
# Several steps whose routing changes (a new one every step), per rank and
# per node, with lent weights: nothing of one step's exchange may reach the
# next (the per-rank exchange stopped at step 2 here once).
check 3 network -T 48 --set top_k=3 --set routed_experts=12 --backward --routing mixed --exchange rank --iters 4 --warmup 0
check 4 shared -T 48 --set top_k=3 --set routed_experts=16 --set ranks_per_node=2 --backward --routing mixed \
  --exchange rank --lend 12 --iters 4 --warmup 0
# The hybrid path: shared windows inside each node of the layer's 2 ranks,
# messages across (the per-node exchange's two hops, and the per-assignment
# exchange over the same split).
check 4 hybrid -T 48 --set top_k=4 --set routed_experts=16 --set ranks_per_node=2 --backward --routing zipf:1.2 \
  --exchange rank --iters 2
grep -q "hybrid: shared-memory windows inside nodes of 2" "$tmp/out.txt"
check 4 hybrid -T 48 --set ranks_per_node=2 --backward --dtype bf16 --routing "$trace" --iters 1

# Weights instead of tokens: hot experts' weights lent to the ranks whose own
# rows of them reach 20, the lent copies' GEMMs on weights that came by puts
# (a process holds only its own experts), bit for bit as in process; the
# per-assignment exchange on the network path, the per-node one on shared memory.
check 4 network --set hidden=128 --set expert_inter=64 -T 96 --backward --routing zipf:1.5 --lend 20 --iters 2
grep -q "lent weights:" "$tmp/out.txt"
check 4 shared --set hidden=128 --set expert_inter=64 -T 96 --backward --dtype bf16 --routing zipf:1.5 --lend 20 \
  --exchange rank --set ranks_per_node=2 --iters 1 --verify-all-ranks

# Replicas that fetch their weights from their owners every step (a process holds only its own experts).
printf '{"experts_of_rank": [[0, 1, 2, 7], [3, 4, 5, 0], [6, 7, 1]], "replicas": true, "fetch_replicas": true}' > "$tmp/fetch.json"
check 3 network --set routed_experts=8 -T 64 --backward --routing hot:0.45 --placement "$tmp/fetch.json" --iters 2
# Owners that are not their experts' first homes: expert 7's owner is rank 2 (its replica on rank 0 sits
# below it), expert 0's rank 1; each process holds the experts it owns and fetches the rest.
printf '{"experts_of_rank": [[0, 1, 2, 7], [3, 4, 5, 0], [6, 7, 1]], "replicas": true, "fetch_replicas": true, "owners": [1, 0, 0, 1, 1, 1, 2, 2]}' > "$tmp/owners.json"
check 3 network --set routed_experts=8 -T 64 --backward --routing hot:0.45 --placement "$tmp/owners.json" --iters 2

# The count exchange as a collective (the default on shared memory is one-sided stores).
check 3 shared -T 64 --backward --routing zipf:1.2 --iters 3 --count-exchange collective
# ... and on the network path sent straight to every peer (the default there is the collective).
check 3 network -T 64 --backward --routing zipf:1.2 --iters 3 --count-exchange one-sided
# The audit: every process regenerates and verifies all ranks' programs.
check 3 network -T 64 --backward --routing zipf:1.2 --iters 2 --verify-all-ranks

# Backpressure: an outbox of 4 KiB makes nearly every put wait for room.
check 3 network -T 96 --backward --routing zipf:1.2 --iters 1 --mpi-outbox 4096

# A checkpoint: each rank reads only its experts and its rows of the inputs.
"$HPMOE" run -T 48 --backward --iters 1 --warmup 0 --save "$tmp/ckpt" > /dev/null
check 2 shared -T 48 --backward --iters 1 --load "$tmp/ckpt"
# Saving over MPI: each rank writes what it owns, rank 0 the index; the set
# loads back in process and over MPI (bit for bit against the in-process run).
check 3 network -T 40 --set routed_experts=8 --placement round-robin --backward --iters 1 --save "$tmp/sharded"
for f in model.safetensors.index.json weights-rank2-of-3.safetensors inputs-rank1-of-3.safetensors \
         outputs-rank0-of-3.safetensors routing-rank2-of-3.safetensors; do test -s "$tmp/sharded/$f"; done
"$HPMOE" run -P 3 -T 40 --set routed_experts=8 --backward --iters 1 --warmup 0 --load "$tmp/sharded" > "$tmp/load.txt"
grep -q "verify   PASS" "$tmp/load.txt"
check 3 shared -T 40 --set routed_experts=8 --backward --iters 1 --load "$tmp/sharded"
# ... and at another rank count (the rows are read across the saved files).
check 2 shared -T 60 --set routed_experts=8 --backward --iters 1 --load "$tmp/sharded"
# A sharded save into a folder that held a single-process save replaces it
# whole: the single save's files are gone, so a load reads the new tokens.
"$HPMOE" run -T 40 -P 3 --set routed_experts=8 --seed 9 --backward --iters 1 --warmup 0 --save "$tmp/mixed" > /dev/null
check 3 shared -T 40 --set routed_experts=8 --backward --iters 1 --save "$tmp/mixed"
for f in weights inputs routing outputs; do test ! -e "$tmp/mixed/$f.safetensors"; done
cmp "$tmp/mixed/inputs-rank1-of-3.safetensors" "$tmp/sharded/inputs-rank1-of-3.safetensors"
# A rank that cannot write its part (the file-size limit on rank 1) fails
# the save on every rank, and the earlier sharded checkpoint stays whole.
cp -r "$tmp/sharded" "$tmp/sharded_before"
cat > "$tmp/fsize.sh" <<'EOS'
#!/usr/bin/env bash
[ "${OMPI_COMM_WORLD_RANK:-}" = 1 ] && ulimit -f 8
exec "$@"
EOS
chmod +x "$tmp/fsize.sh"
# (The network path: a file-size limit also stops MPI's shared-memory files.)
if timeout 120 "$MPIRUN" -np 3 --oversubscribe --mca btl self,tcp "$tmp/fsize.sh" "$HPMOE" run -P 3 --transport mpi \
     --mpi-path network -T 40 --set routed_experts=8 \
     --seed 4 --backward --iters 1 --warmup 0 --save "$tmp/sharded" > "$tmp/fsave.txt" 2>&1; then
  echo "a save that rank 1 could not write succeeded"; exit 1
fi
# Every rank's line names rank 1's reason; which ranks print before mpirun
# ends the job is a race, so any one of them will do.
grep -Eq "^error: rank (1: |[02]: rank 1 could not write its part of the save to .*: ).*File too large.*checkpoint there before is unchanged" \
  "$tmp/fsave.txt" || { cat "$tmp/fsave.txt"; exit 1; }
! ls "$tmp/sharded"/*.partial-* > /dev/null 2>&1
diff -r "$tmp/sharded_before" "$tmp/sharded"

# Ranks started with different options (other seeds, so other router
# weights; one pass or two; the in-process check on one rank only; another
# routing; a save on one rank only or to another folder; another step
# count) are caught before anything runs: every rank stops with one line
# naming the option and exit 2, no hang.
disagree() {  # disagree OPTION ARGS-OF-RANK-0 -- ARGS-OF-RANK-1
  local name=$1; shift
  local a=() b=()
  while [ "$1" != "--" ]; do a+=("$1"); shift; done; shift
  b=("$@")
  if timeout 60 "$MPIRUN" --oversubscribe -np 1 "$HPMOE" run -P 2 --transport mpi -T 32 "${a[@]}" : \
       -np 1 "$HPMOE" run -P 2 --transport mpi -T 32 "${b[@]}" > "$tmp/fp.txt" 2>&1; then
    echo "ranks disagreeing on $name ran"; exit 1
  fi
  test "$(grep -c "^error: rank [01]: rank 1 was started with another $name than rank 0" "$tmp/fp.txt")" -eq 2 ||
    { cat "$tmp/fp.txt"; echo "disagreeing on $name: not two error lines naming it"; exit 1; }
}
disagree --seed --seed 1 -- --seed 2
disagree --backward --backward --
disagree --check-inprocess -- --check-inprocess
disagree --routing --routing zipf:1.2 -- --routing uniform
disagree --save --save "$tmp/s0" --
disagree --save --save "$tmp/s0" -- --save "$tmp/s1"
disagree --iters --iters 2 -- --iters 3
# The transport's own options are compared before the transport is built
# from them (they hung in the agreement, which travelled by the path in
# dispute), and the worker count before any launch (a watchdog named a barrier).
disagree "--mpi-path (module: mpi_path)" --mpi-path shared -- --mpi-path network
disagree --count-exchange --count-exchange one-sided -- --count-exchange collective
disagree "--workers (-W)" -W 1 -- -W 2
test ! -e "$tmp/s0" && test ! -e "$tmp/s1"  # nothing saved by ranks that disagreed

# One rank per process: the process count must match P.
if "$MPIRUN" -np 2 --oversubscribe "$HPMOE" run -P 4 --transport mpi > "$tmp/np.txt" 2>&1; then exit 1; fi
grep -q "launch with mpirun -np 4" "$tmp/np.txt"

fault() {  # fault PATH KIND EXPECTED: the job ends with an error within 30 s
  local start=$SECONDS
  if mpi 2 "$1" -T 64 --iters 1 --warmup 0 --watchdog 3 --peer-timeout 1 --inject-fault "$2:1" > "$tmp/f.txt" 2>&1; then
    echo "fault $2 did not fail the run"; exit 1
  fi
  [ $((SECONDS - start)) -lt 30 ] || { echo "fault $2 took $((SECONDS - start)) s"; exit 1; }
  grep -q "$3" "$tmp/f.txt" || { cat "$tmp/f.txt"; echo "fault $2: no '$3'"; exit 1; }
}
# A rank that freezes in its first fraction of a second (in MPI_Init, or
# while the first shared window is allocated): the others stop with an
# error, never a hang.
freeze_early() {  # freeze_early PATH DELAY: rank 1 is stopped DELAY s after it starts
  cat > "$tmp/freeze.sh" <<'EOS'
#!/usr/bin/env bash
"$@" &
pid=$!
if [ "${OMPI_COMM_WORLD_RANK:-}" = 1 ]; then sleep "$FREEZE_DELAY"; kill -STOP $pid; sleep 60; kill -KILL $pid; fi
wait $pid
EOS
  chmod +x "$tmp/freeze.sh"
  local start=$SECONDS
  if FREEZE_DELAY=$2 timeout 90 "$MPIRUN" --oversubscribe -np 2 -x FREEZE_DELAY "$tmp/freeze.sh" "$HPMOE" run -P 2 \
       --transport mpi --mpi-path "$1" -T 512 --backward --iters 2000 --warmup 0 --verify off --watchdog 3 --peer-timeout 1 \
       > "$tmp/fe.txt" 2>&1; then
    echo "an early freeze ($1, $2 s) did not fail the run"; exit 1
  fi
  [ $((SECONDS - start)) -lt 45 ] || { echo "an early freeze ($1, $2 s) took $((SECONDS - start)) s"; exit 1; }
  grep -q "^error: .*\(MPI start-up did not finish\|has not been heard from\)" "$tmp/fe.txt" ||
    { cat "$tmp/fe.txt"; echo "an early freeze ($1, $2 s): no error naming it"; exit 1; }
}
for delay in 0.05 0.25 0.45; do freeze_early shared $delay; done  # the run takes seconds: each lands before its end
freeze_early network 0.25
for path in shared network; do
  fault $path exit "exited"
  fault $path freeze "rank 1 has not been heard from"
  fault $path stall "watchdog: no progress"
done
echo "mpi: all passed"
