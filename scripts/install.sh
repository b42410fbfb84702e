#!/usr/bin/env bash
# Installs everything bagua_lite needs on a machine that has only Python and pip.
# Keeps an already-installed torch; otherwise installs $BAGUA_LITE_TORCH (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "${BAGUA_LITE_TORCH:-torch==2.13.0}"
fi
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
"$PY" -m pip install --quiet "setuptools>=70" wheel ninja numpy pyyaml pytest hypothesis scikit-learn matplotlib
# The integrations' tests run too (the extras lightning, accelerate, hf; versions they were tested with). Each
# accepts the installed torch, so pip keeps it; checked below, since another torch would break the extension.
"$PY" -m pip install --quiet "pytorch-lightning==2.6.6" "accelerate==1.15.0" "transformers==5.24.0"
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
  echo "install.sh: installing the extras replaced torch $torch_before with $torch_after" >&2
  exit 1
fi
command -v cmake >/dev/null 2>&1 || "$PY" -m pip install --quiet cmake
# --no-build-isolation: compile against the torch installed above (an isolated build would fetch
# another torch and produce an extension with the wrong ABI).
"$PY" -m pip install --quiet --no-build-isolation -e .
"$PY" -c "import bagua_lite, bagua_lite.algorithms; print('bagua_lite', bagua_lite.__version__, 'installed; algorithms:', ', '.join(bagua_lite.algorithms.registered()))"
