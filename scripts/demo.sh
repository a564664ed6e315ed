#!/usr/bin/env bash
# Sets up, builds and runs the main demo: deepseek-v2-lite at its real sizes
# (64 experts, hidden 2048, inter 1408, top-6, 2 shared experts), expert
# parallel over 2 ranks with 2048 tokens each, forward and backward, checked
# against the fp64 oracle on sampled tokens. Needs about 13 GB of memory and
# two minutes on a 2-core machine. Extra arguments go to `hpmoe run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)" --target hpmoe
./build/hpmoe run --preset deepseek-v2-lite --ranks 2 --tokens 2048 --backward --iters 3 --warmup 1 "$@"
