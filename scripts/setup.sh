#!/usr/bin/env bash
# Installs the Debian packages hpmoe builds against. Idempotent: when every
# package is already present it neither updates the package lists nor installs.
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config ccache libxsmm-dev nlohmann-json3-dev libcli11-dev libopenblas-dev
  libopenmpi-dev openmpi-bin libucx-dev  # libucx-dev: bench/bench_ucx (UCX measured against MPI)
          libdnnl-dev  # bf16 tiles on AMX (src/kernels/gemm.cpp); bench/bench_onednn
          libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev  # clang and its libFuzzer runtime: bench/fuzz.sh
  pybind11-dev python3-dev python3-torch python3-pytest python3-numpy python3-matplotlib  # the Python module, its tests, examples/train_moe_lm.py
  python3-venv python3-pip python3-wheel)  # pip install . (pyproject.toml) into a venv that sees Debian's torch
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" > /dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi
