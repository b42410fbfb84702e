#!/usr/bin/env bash
# Installs everything, then runs all tests: the C++ kernel tests (CMake + ctest) and pytest
# (kernels, every collective in real gloo groups at P = 1..8, training, the example configs under torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh test
prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/cmake
ctest --test-dir build/cmake --output-on-failure
"$PY" -m pytest -q "$@"
