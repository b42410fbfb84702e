#!/usr/bin/env bash
# The GPU check in one go: builds the extension against this machine's torch, then runs tests/gpu/ (every
# kernel and codec against its CPU version; every algorithm under NCCL at P = 1 and over gloo with CUDA
# tensors at P = 2 and 3, against its own CPU run) and prints two tables (kernels, algorithms): what x backend x P, ok, the largest
# difference, whether a repeat was bit-identical; then the kernel benchmark (python -m bagua_lite.bench.kernels) and the step
# cost at P = 1 against the plain loop and DDP (python -m bagua_lite.bench.gpu_step).
# The tables and the logs go to $OUT (default gpu_check_out/).
#
#   bash scripts/gpu_check.sh                  on a machine with a CUDA device
#   bash scripts/gpu_check.sh --cpu            without one: the CPU stands in for the device (checks the harness)
#   BAGUA_LITE_GPU_BENCH=0 bash scripts/gpu_check.sh    the build and the tests, no benchmarks
#   bash scripts/gpu_check.sh --fetch-wheels   with network: wheels of what the suite needs beyond torch
#                                              (pytest, numpy, pyyaml, ninja) for Python 3.12 into
#                                              build/gpu_wheels/, for a GPU machine without network
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${BAGUA_LITE_GPU_WHEELS:-build/gpu_wheels}
device=cuda
case "${1:-}" in
  --cpu) device=cpu; shift ;;
  --fetch-wheels)
    "$PY" -m pip download --quiet --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$WHEELS" pytest numpy pyyaml ninja
    du -sh "$WHEELS"
    exit 0 ;;
esac
start=$(date +%s)
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
if ! "$PY" -c "import pytest, numpy, yaml" 2>/dev/null; then
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" pytest numpy pyyaml ninja
  else
    "$PY" -m pip install --quiet pytest numpy pyyaml ninja
  fi
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" | tee "$OUT/versions.txt"
# --no-deps: nothing is fetched (the machine may have no network); the extension builds against this torch
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --quiet --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
echo "gpu_check: built in $(( $(date +%s) - start )) s"
rc=0
# the kernels first, in a session of their own: a rank that hangs in an algorithm run cannot cost their table
BAGUA_LITE_GPU_CHECK=$device BAGUA_LITE_GPU_TABLE=gpu_check_kernels OUT=$OUT "$PY" -m pytest -q -p no:cacheprovider \
  tests/gpu/test_gpu_kernels.py "$@" 2>&1 | tee "$OUT/pytest_kernels.log" || rc=$?
BAGUA_LITE_GPU_CHECK=$device BAGUA_LITE_GPU_TABLE=gpu_check_algorithms OUT=$OUT "$PY" -m pytest -q -p no:cacheprovider \
  tests/gpu --ignore=tests/gpu/test_gpu_kernels.py "$@" 2>&1 | tee "$OUT/pytest.log" || rc=$?
if [ "${BAGUA_LITE_GPU_BENCH:-1}" = 0 ]; then  # the tests alone
  echo "gpu_check: $(( $(date +%s) - start )) s in all (device: $device; no benchmarks)" | tee -a "$OUT/pytest.log"
  exit $rc
fi
# the kernel table (ms, GB/s, x the floor, torch in the same run); small sizes when the CPU stands in
if [ "$device" = cuda ]; then sizes=25000000,100000000; else sizes=1000000; fi
timeout 300 "$PY" -m bagua_lite.bench.kernels --device "$device" --sizes "$sizes" --json "$OUT/kernels.json" \
  2>&1 | tee "$OUT/kernels.txt" || rc=$?
# our own cost in a step at P = 1 against the plain loop and DDP (python -m bagua_lite.bench.gpu_step)
if [ "$device" = cuda ]; then step_args=""; else step_args="--small --steps 3 --warmup 1"; fi
timeout 300 "$PY" -m bagua_lite.bench.gpu_step --device "$device" $step_args --models gpt,resnet18 --json "$OUT/step.json" \
  2>&1 | tee "$OUT/step.txt" || rc=$?
# the engine's own stream (opt-in until measured): the same step, DDP and our dense and fp16 rows beside it
BAGUA_LITE_ENGINE_STREAM=1 timeout 200 "$PY" -m bagua_lite.bench.gpu_step --device "$device" $step_args --models gpt \
  --rows "plain,ddp,gradient_allreduce,gradient_allreduce fp16,topk 0.001,ddp fused,gradient_allreduce fused" --json "$OUT/step_engine_stream.json" \
  2>&1 | tee "$OUT/step_engine_stream.txt" || rc=$?
# the step table projected to GPU clusters (8-256 GPUs, 1-100 Gbit/s between nodes; docs/cost_model.md)
"$PY" -m bagua_lite.bench.project_gpu --step "$OUT/step.json" > "$OUT/projection.txt" 2>&1 || rc=$?
echo "gpu_check: $(( $(date +%s) - start )) s in all (device: $device); tables: $OUT/gpu_check_kernels.md, $OUT/gpu_check_algorithms.md" | tee -a "$OUT/pytest.log"
exit $rc
