#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite: the release build, then the
# same suite under AddressSanitizer + UndefinedBehaviorSanitizer.
#   scripts/test.sh            both builds
#   HPMOE_SKIP_SANITIZERS=1 scripts/test.sh   release build only
#   HPMOE_SKIP_FUZZ=1 scripts/test.sh         without the libFuzzer runs
# The concurrent parts (worker pool, interleaved runtime, executors) also run
# under ThreadSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)

# ccache serves every configuration's compiles from a cache kept outside the
# clone, shared by all clones on this machine (CMake takes the launcher from
# the environment when it configures a build folder). Objects built with
# -march=native must not serve another CPU: one cache per compiler target.
if command -v ccache > /dev/null && [ "${HPMOE_NO_CCACHE:-0}" != 1 ]; then
  target=$(g++ -march=native -Q --help=target 2>/dev/null | md5sum | cut -c1-12)
  export CCACHE_DIR="${HPMOE_CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hpmoe-ccache}/$target"
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-8G}
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  ccache --zero-stats > /dev/null
fi
# Where the time goes: one line per stage, and the table at the end.
stages=()
stage_start=$SECONDS
stage() {
  stages+=("$(printf '%-34s %5d s' "$1" $((SECONDS - stage_start)))")
  stage_start=$SECONDS
}
report() {
  echo "== time per stage ($(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'))"
  printf '%s\n' "${stages[@]}"
  echo "total                              $SECONDS s"
  if [ -n "${CCACHE_DIR:-}" ]; then ccache --show-stats 2>/dev/null | grep -Ei "hits|misses" | head -4 || true; fi
}
trap report EXIT
stage "setup (packages)"

echo "== release build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$jobs"
stage "release build"
# Every label: unit, cli, integration, and python (the module's pytest
# suite, where Debian's PyTorch is: python3-torch, pybind11-dev, python3-dev).
ctest --test-dir build -j "$jobs" --output-on-failure
stage "release tests (C++, CLI, Python)"
# A short soak: a new routing every step, in process and over MPI (both
# paths), bit-identity spot checks (bench/soak.sh runs the full one).
HPMOE="$PWD/build/hpmoe" bench/soak.sh --short
stage "short soak"
# Where the CPU has AMX, bf16 tiles run on hpmoe's AMX kernel; the libxsmm
# path (the one CPUs without AMX take) is tested too, and oneDNN's AMX
# matmul, the engine kept to measure against.
HPMOE_BF16_ENGINE=libxsmm ctest --test-dir build -j "$jobs" --output-on-failure -R 'bf16|Bf16|TileGemm|Kernel'
stage "bf16 without AMX"
if grep -qw amx_bf16 /proc/cpuinfo && grep -q "HPMOE_ONEDNN:BOOL=ON" build/CMakeCache.txt; then
  HPMOE_BF16_ENGINE=onednn ctest --test-dir build -j "$jobs" --output-on-failure -R 'bf16|Bf16|TileGemm|Kernel'
  stage "bf16 on oneDNN's AMX matmul"
fi

if [ "${HPMOE_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer build"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHPMOE_SANITIZE=ON -DHPMOE_BUILD_BENCH=OFF > /dev/null
  cmake --build build-asan -j "$jobs"
  stage "asan+ubsan build"
  # The whole suite, but the executor sweeps under one schedule policy: a
  # policy only orders the same tasks, whose bodies and operands (what ASan
  # checks) do not change with it; the release run and TSan keep every
  # policy (bit-identity and interleavings). About a quarter of the stage.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan -j "$jobs" --output-on-failure \
      -E '(InterleavedForward|InterleavedBackward)\..*_(fill|rank_rotated|interleave_wgrad|ratr)( |$)'
  stage "asan+ubsan tests"
fi

if [ "${HPMOE_SKIP_FUZZ:-0}" != 1 ]; then
  echo "== libFuzzer under ASan + UBSan: every parser (bench/fuzz.sh), ${HPMOE_FUZZ_SECONDS:-20} s each"
  bench/fuzz.sh "${HPMOE_FUZZ_SECONDS:-20}"
  stage "fuzz (build + runs)"
fi

if [ "${HPMOE_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "== ThreadSanitizer build (runtime and executor tests)"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHPMOE_TSAN=ON -DHPMOE_BUILD_BENCH=OFF > /dev/null
  cmake --build build-tsan -j "$jobs" --target hpmoe_tests
  stage "tsan build"
  # The tests that run threads: executors, workers, placements that change the
  # exchange (lent weights among them), the kept layer. The executor sweeps' recorded-trace cases are
  # left to the release and ASan runs: under TSan they took a third of the
  # stage and add no pattern of concurrency that the uniform and Zipf cases
  # (P, W, pass, policy and dtype all swept) do not already run.
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan -j "$jobs" --output-on-failure \
      -R 'Interleaved|Serialized|WorkerActivity|Placement|ReplicaExecution|SplitExecution|Layer|RankExchangeExecution|LendExecution' \
      -E '(Interleaved(Forward|Backward)|SerializedVsOracleSweep|SerializedBaseline)\..*_trace'
  stage "tsan tests"
fi
