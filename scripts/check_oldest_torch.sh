#!/usr/bin/env bash
# Builds bagua_lite against the oldest torch it supports, in a virtual environment of its own, and runs a
# smoke subset there: a torch API newer than that release, used outside the compatibility modules
# (bagua_lite/_compat.py, csrc/compat.h), fails here before it lands. CI runs it after the main tests.
# The environment is kept between runs (BAGUA_LITE_OLDEST_VENV); the build uses a copy of the tracked
# files, so the main tree's extension (built against the newer torch) is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OLDEST=${BAGUA_LITE_OLDEST_TORCH:-2.11.0}
VENV=${BAGUA_LITE_OLDEST_VENV:-$HOME/.cache/bagua_lite/venv-torch-$OLDEST}
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$OLDEST')" 2>/dev/null; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # PyPI's Linux wheel of torch is a CUDA build (its CUDA libraries come along); it runs on a CPU-only machine.
  "$VENV/bin/python" -m pip install --quiet "torch==$OLDEST" "setuptools>=70" wheel ninja numpy pyyaml pytest hypothesis
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work"
cd "$work"
# With nvcc on the machine the build is the CUDA one (BAGUA_LITE_FORCE_CUDA: compiling needs no GPU), so the
# .cu kernels compile against this torch here and the smoke tests run with them linked in. The CUDA
# libraries' headers that ATen's CUDA headers include (cusparse.h, ...) come with the torch wheel.
cuda_env=()
if command -v nvcc >/dev/null && "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  inc=$("$VENV/bin/python" -c "import glob, nvidia; print(':'.join(glob.glob(list(nvidia.__path__)[0] + '/cu*/include')))" \
        2>/dev/null || true)
  # torch takes CUDA_HOME from nvcc's path, wrong for a wrapper such as /usr/local/bin/nvcc: nvcc says where it is
  home=${CUDA_HOME:-$(cd /tmp && nvcc --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1 | xargs readlink -f)}
  cuda_env=(BAGUA_LITE_FORCE_CUDA=1 "CUDA_HOME=$home" "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}"
            "CPATH=$inc${CPATH:+:$CPATH}")
fi
env "${cuda_env[@]}" "$VENV/bin/python" -m pip install --quiet --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, bagua_lite
print('bagua_lite built against torch', torch.__version__, '- CUDA kernels:', bagua_lite.kernels.cuda_kernels_enabled())"
"$VENV/bin/python" -m pytest -q tests/test_control.py tests/test_comm.py tests/test_ddp_parity.py \
  tests/test_readme_algorithm.py "$@"
