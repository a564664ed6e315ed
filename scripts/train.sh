#!/usr/bin/env bash
# Sets up, builds the Python module and runs the training example: a small
# byte-level MoE language model whose FFNs are hpmoe layers, trained next to
# its plain-PyTorch twin from the same weights (about 5 minutes on 2 cores).
# Pictures and figures go to train-out/. Extra arguments go to
# examples/train_moe_lm.py (--steps, --out, --resume, --check-resume, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)" --target hpmoe_python
PYTHONPATH="$PWD/build/python" /usr/bin/python3 examples/train_moe_lm.py "$@"
