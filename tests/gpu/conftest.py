"""The GPU suite: every kernel, codec and algorithm on a device against its own CPU run.

Run by ``bash scripts/gpu_check.sh`` (not by the default ``pytest``: tests/conftest.py leaves this folder
out unless ``BAGUA_LITE_GPU_CHECK`` is set). ``BAGUA_LITE_GPU_CHECK=cuda`` (the script's default) needs a
CUDA device; ``BAGUA_LITE_GPU_CHECK=cpu`` runs the same suite with the CPU standing in for the device, so
the harness itself is checked on a machine without a GPU (every difference is then 0).

Each test adds rows to one table (``record``), printed at the end of the session and written as
``<stem>.md`` and ``<stem>.json`` under ``$OUT`` (or the working directory); the stem is
``BAGUA_LITE_GPU_TABLE`` (default ``gpu_check``).
"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: algo_matrix.py
from gpu_device import DEVICE, device  # noqa: E402

ROWS = []


@pytest.fixture
def dev():
    return device()


@pytest.fixture
def record():
    def add(what, backend, P, ok, diff, repeat="", note=""):
        ROWS.append({"what": what, "backend": backend, "P": P, "ok": bool(ok), "max_diff": diff,
                     "repeat": repeat, "note": note})
        _write()  # row by row: a session killed by a timeout still leaves what it measured
    return add


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _table():
    head = ["what", "backend", "P", "ok", "max_diff", "repeat", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in head) + " |" for r in ROWS]
    bad = sum(not r["ok"] for r in ROWS)
    lines.append(f"\n{len(ROWS) - bad} of {len(ROWS)} rows ok (device: {DEVICE})")
    return "\n".join(lines)


def _write():
    out = os.environ.get("OUT") or os.getcwd()
    stem = os.environ.get("BAGUA_LITE_GPU_TABLE", "gpu_check")
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(_table() + "\n")
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(ROWS, f, indent=1)


def pytest_terminal_summary(terminalreporter):
    if ROWS:
        terminalreporter.write_line("")
        terminalreporter.write_line(_table())
