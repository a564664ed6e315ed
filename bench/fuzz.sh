#!/usr/bin/env bash
# Builds hpmoe's libFuzzer targets (one per parser: layer config, Hugging
# Face config import, routing trace, program dump + verifier, the compiler
# (every program it makes must be proved safe), the runtime (interleaved =
# serialized bit for bit on small layers), machine model,
# safetensors reader, checkpoint index, placement, sweep --vary specs) with clang under ASan +
# UBSan, and runs each for a while from its seed corpus (fuzz/corpus/TARGET).
# A crash, a sanitizer report, a timeout or an exception other than
# hpmoe::Error fails the run; the input that caused it is left in build-fuzz/.
#   bench/fuzz.sh [SECONDS_PER_TARGET [TARGET ...]]    (default 30 s, all targets)
# Prints one line per target (executions, coverage, features, corpus) and
# writes them to build-fuzz/fuzz-summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(layer_config hf_config trace program compile runtime machine safetensors checkpoint_index placement vary)
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHPMOE_FUZZ=ON \
  -DHPMOE_BUILD_TESTS=OFF -DHPMOE_BUILD_BENCH=OFF -DHPMOE_MPI=OFF -DHPMOE_PYTHON=OFF > /dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]/#/fuzz_}"
source bench/record_header.sh
cpu=$(machine_line)
summary=build-fuzz/fuzz-summary.txt
echo "# $(date -u +%F) $cpu; $seconds s per target" > "$summary"
for target in "${targets[@]}"; do
  work=build-fuzz/corpus-$target
  mkdir -p "$work"
  log=build-fuzz/fuzz-$target.log
  (cd build-fuzz && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./fuzz_$target \
     -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
     "corpus-$target" "../fuzz/corpus/$target" > "fuzz-$target.log" 2>&1) || true
  # libFuzzer writes crash-*/leak-*/timeout-*/oom-* on a failure.
  if ls build-fuzz/crash-* build-fuzz/leak-* build-fuzz/timeout-* build-fuzz/oom-* > /dev/null 2>&1; then
    grep -E "^(==|SUMMARY)" "$log" | head -20 || true
    echo "fuzz_$target found a failing input:"; ls build-fuzz/crash-* build-fuzz/leak-* build-fuzz/timeout-* build-fuzz/oom-* 2>/dev/null
    exit 1
  fi
  execs=$(grep -oE "stat::number_of_executed_units: [0-9]+" "$log" | grep -oE "[0-9]+$" || echo "?")
  done_line=$(grep -E "^#[0-9]+[[:space:]].*cov: [0-9]+" "$log" | tail -1 || true)
  cov=$(grep -oE "cov: [0-9]+" <<< "$done_line" | grep -oE "[0-9]+" || echo "?")
  ft=$(grep -oE "ft: [0-9]+" <<< "$done_line" | grep -oE "[0-9]+" || echo "?")
  corp=$(grep -oE "corp: [0-9]+" <<< "$done_line" | grep -oE "[0-9]+" || echo "?")
  line="fuzz_$target: $execs executions in $seconds s, coverage $cov edges, $ft features, corpus $corp inputs, no failure"
  echo "$line" | tee -a "$summary"
done
echo "fuzz: all targets ran clean ($summary)"
