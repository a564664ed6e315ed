#!/usr/bin/env bash
# Table-driven bad-input test of the CLI: every case must exit with code 2
# and print exactly one line, starting with "error:", on stderr.
set -uo pipefail
: "${HPMOE:?}" "${HPMOE_SOURCE_DIR:?}"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
trace="$HPMOE_SOURCE_DIR/data/routing/mixtral-8x7b/coding.json"
echo '{"0": [[0, 9], [1, 2]]}' > "$tmp/out_of_range.json"
echo '{"0": [[0, 1], [1, 2' > "$tmp/truncated.json"
echo '{"0": [[0, 1, 2]]}' > "$tmp/wide.json"
echo '{"foo": 1}' > "$tmp/unknown_format.json"
echo '{"hidden_size": "big", "moe_intermediate_size": 8, "num_experts": 8, "num_experts_per_tok": 2}' > "$tmp/bad_type.json"
echo '{"hidden": 32, "expert_inter": 16, "routed_experts": 6, "top_k": 2, "ranks": 4}' > "$tmp/indivisible.json"
printf 'garbage' > "$tmp/garbage.json"
"$HPMOE" run --save "$tmp/saved" > /dev/null
mkdir -p "$tmp/badst" && printf '\x10\x00\x00\x00\x00\x00\x00\x00{"x": 1}' > "$tmp/badst/weights.safetensors"

cases=(
  "run --preset nope"
  "run --preset tiny --config $tmp/unknown_format.json"
  "run --set top_k=100"
  "run --set routed_experts=6 --ranks 4"
  "run --set groups=3"
  "run --set hidden=0"
  "run --set hidden=abc"
  "run --set nofield=1"
  "run --set hidden"
  "run --set tokens_per_rank=-5"
  "run --set route_scale=inf"
  "run --dtype fp16"
  "run --dtype bf16 --set hidden=33"
  "run --ranks 0"
  "run --tokens abc"
  "run --workers 0"
  "run --iters -1"
  "run --iters abc"
  "run --bogus-flag"
  "run --verify maybe"
  "run --mode sideways"
  "run --schedule random"
  "run --transport carrier-pigeon"
  "run --mpi-path shared"
  "run --transport mpi --mpi-path telepathy"
  "run --inject-fault explode:1"
  "run --inject-fault exit:7"
  "run --watchdog 0"
  "run --mode interleaved --schedule fill -W 0"
  "run --routing bogus"
  "run --routing zipf:abc"
  "run --routing hot:0.9"
  "run --routing trace:/nonexistent/trace.json"
  "run --routing trace:$trace:99"
  "run --routing trace:$trace --set top_k=3"
  "run --routing trace:$tmp/out_of_range.json"
  "run --routing trace:$tmp/truncated.json"
  "run --routing trace:$tmp/wide.json"
  "run --config /nonexistent/config.json"
  "run --config $tmp/garbage.json"
  "run --config $tmp/unknown_format.json"
  "run --config $tmp/bad_type.json"
  "run --config $tmp/indivisible.json"
  "run --load /nonexistent/dir"
  "run --load $tmp/saved --set hidden=64"
  "run --load $tmp/badst"
  "run --json /nonexistent/dir/out.json"
  "run --trace /nonexistent/dir/trace.json"
  "run --timeline /nonexistent/dir/timeline.svg"
  "compile --machine gpu:4"
  "compile --machine cpu:0"
  "compile --machine cpu:2:64"
  "compile --schedule random"
  "compile --pass sideways"
  "compile -P 2 --rank 5"
  "compile --routing bogus"
  "compile --preset deepseek-v3 -P 64 -T 4096"
  "verify /nonexistent/prog.json"
  "verify $tmp/garbage.json"
  "verify $tmp/unknown_format.json"
  "verify $tmp/truncated.json"
  "verify"
  "config --preset nope"
  "config --set top_k=0"
  "nosuchcommand"
  ""
)
failed=0
for c in "${cases[@]}"; do
  # shellcheck disable=SC2086
  "$HPMOE" $c > "$tmp/stdout" 2> "$tmp/stderr"
  rc=$?
  lines=$(wc -l < "$tmp/stderr")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -q '^error: ' "$tmp/stderr"; then
    echo "FAIL: hpmoe $c -> exit $rc, $lines stderr lines:"; sed 's/^/    /' "$tmp/stderr"
    failed=$((failed + 1))
  fi
done
echo "bad input: $((${#cases[@]} - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
