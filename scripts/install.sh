#!/usr/bin/env bash
# Installs bagua_lite on a machine that has only Python and pip: what the core needs (numpy, pyyaml), torch
# if missing (an installed one is kept; else $BAGUA_LITE_TORCH, default torch==2.13.0), then the extension,
# compiled against that torch. The build is reused while it matches: it is rebuilt only when csrc/,
# setup.py, torch or Python changed since the last build of this checkout, or the installed bagua_lite is
# another checkout's.
#
# Arguments add what a command needs besides the core (each keeps the installed torch, checked below):
#   test        pytest and pytest-xdist (run_tests.sh runs two workers), hypothesis, scikit-learn, matplotlib
#               (the benchmark's plots are tested), cmake, and the integrations the tests cover (lightning
#               and pytorch-lightning: the strategy is tested under both packages; accelerate, hf; torchft,
#               whose DiLoCo the porting test runs) at the versions they were tested with
#   benchmark   matplotlib (plots) and scikit-learn (the digits task)
#   lightning | accelerate | hf   one integration (lightning: the unified `lightning` package)
#   torchft     torchft, for the benchmark's torchft_diloco row
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}

LIGHTNING="lightning==2.6.6" PYTORCH_LIGHTNING="pytorch-lightning==2.6.6"
ACCELERATE="accelerate==1.15.0" HF="transformers==5.24.0" TORCHFT="torchft==0.2.0"
extras=()
need_cmake=0
for what in "$@"; do
  case "$what" in
    test) extras+=(pytest pytest-xdist==3.8.0 hypothesis scikit-learn matplotlib "$LIGHTNING" "$PYTORCH_LIGHTNING" "$ACCELERATE" "$HF" "$TORCHFT")
          need_cmake=1 ;;
    benchmark) extras+=(matplotlib scikit-learn) ;;
    lightning) extras+=("$LIGHTNING") ;;
    accelerate) extras+=("$ACCELERATE") ;;
    hf) extras+=("$HF") ;;
    torchft) extras+=("$TORCHFT") ;;
    *) echo "install.sh: unknown argument '$what' (allowed: test, benchmark, lightning, accelerate, hf, torchft)" >&2
       exit 2 ;;
  esac
done

# numpy first: torch warns at import ("Failed to initialize NumPy") when it is missing
"$PY" -m pip install --quiet "setuptools>=70" wheel ninja numpy pyyaml
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "${BAGUA_LITE_TORCH:-torch==2.13.0}"
fi
torch_before=$("$PY" -c "import torch; print(torch.__version__)")

if [ ${#extras[@]} -gt 0 ]; then
  "$PY" -m pip install --quiet "${extras[@]}"
fi
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
  echo "install.sh: installing $* replaced torch $torch_before with $torch_after" >&2
  exit 1
fi
if [ "$need_cmake" = 1 ]; then
  command -v cmake >/dev/null 2>&1 || "$PY" -m pip install --quiet cmake
fi

# What the build depends on; the same digest means the same extension.
digest=$({ "$PY" -c "import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)"
           cat setup.py; find csrc -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1)
stamp=build/bagua_lite_build.sha256
installed_here() {  # the installed bagua_lite (and its algorithms) is this checkout's, and its extension loads
  (cd / && "$PY" - "$ROOT" <<'EOF'
import os, sys
import bagua_lite, bagua_lite._C, bagua_lite.algorithms
root = os.path.realpath(sys.argv[1])
sys.exit(0 if all(os.path.realpath(m.__file__).startswith(root + os.sep)
                  for m in (bagua_lite, bagua_lite._C, bagua_lite.algorithms)) else 1)
EOF
  ) >/dev/null 2>&1
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && installed_here; then
  echo "install.sh: the extension matches its sources and torch $torch_after: not rebuilt (delete $stamp to force)"
else
  # --no-build-isolation: compile against the torch installed above (an isolated build would fetch
  # another torch and produce an extension with the wrong ABI).
  "$PY" -m pip install --quiet --no-build-isolation -e .
  mkdir -p build
  echo "$digest" > "$stamp"
fi
(cd / && "$PY" -c "import bagua_lite, bagua_lite.algorithms; print('bagua_lite', bagua_lite.__version__, 'installed; algorithms:', ', '.join(bagua_lite.algorithms.registered()))")
