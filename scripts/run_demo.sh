#!/usr/bin/env bash
# Installs everything, then runs the main job: 4 local processes train a small model with every
# algorithm config in configs/ and print a comparison table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh benchmark
"$PY" -m bagua_lite.demo "$@"
