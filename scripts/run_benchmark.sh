#!/usr/bin/env bash
# Installs everything, then runs the main job: every algorithm against PyTorch DDP (plain, fp16 hook,
# PowerSGD hook) on loopback and an emulated 1 Gbit/s link (root needed for the emulation; without it
# the benchmark says so and runs loopback only), with projections to larger clusters.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh benchmark
"$PY" -m bagua_lite.bench --config configs/benchmark.yaml --project 16,32,128,1024 "$@"
