#!/usr/bin/env bash
# Builds the libFuzzer targets of hpmoe's parsers with clang and runs each for
# a while from its seed corpus (fuzz/corpus/TARGET); a crash, a sanitizer
# report or an exception other than hpmoe::Error fails the run, and the input
# that caused it is left in build-fuzz/.
#   scripts/fuzz.sh [SECONDS_PER_TARGET]    (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHPMOE_FUZZ=ON \
  -DHPMOE_BUILD_TESTS=OFF -DHPMOE_BUILD_BENCH=OFF -DHPMOE_MPI=OFF > /dev/null
cmake --build build-fuzz -j "$(nproc)" --target fuzz_placement fuzz_program fuzz_checkpoint_index
for target in placement program checkpoint_index; do
  work=build-fuzz/corpus-$target
  mkdir -p "$work"
  echo "== fuzz_$target for $seconds s"
  (cd build-fuzz && ./fuzz_$target -max_total_time="$seconds" -max_len=65536 -timeout=10 -print_final_stats=1 \
     "corpus-$target" "../fuzz/corpus/$target" 2>&1 | grep -E "^(stat::number_of_executed_units|#[0-9]+ +DONE|==|SUMMARY)" || true)
  # libFuzzer exits non-zero and writes crash-*/leak-*/timeout-* on a failure.
  if ls build-fuzz/crash-* build-fuzz/leak-* build-fuzz/timeout-* build-fuzz/oom-* > /dev/null 2>&1; then
    echo "fuzz_$target found a failing input:"; ls build-fuzz/crash-* build-fuzz/leak-* build-fuzz/timeout-* build-fuzz/oom-* 2>/dev/null
    exit 1
  fi
done
echo "fuzz: all targets ran clean"
