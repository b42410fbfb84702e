import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
# The GPU suite runs through scripts/gpu_check.sh (BAGUA_LITE_GPU_CHECK=cuda, or cpu to check the harness).
collect_ignore = [] if os.environ.get("BAGUA_LITE_GPU_CHECK") else ["gpu"]


class _Clusters:
    """Keeps a few live clusters (by world size) so tests share them; replaces broken ones."""

    def __init__(self, keep=3):
        self.keep = keep
        self.live = {}

    def get(self, world_size):
        c = self.live.pop(world_size, None)
        if c is not None and c.broken:
            c.close()
            c = None
        if c is None:
            c = Cluster(world_size)
        self.live[world_size] = c  # most recently used last
        while len(self.live) > self.keep:
            oldest = next(iter(self.live))
            self.live.pop(oldest).close()
        return c

    def close(self):
        for c in self.live.values():
            c.close()
        self.live.clear()


@pytest.fixture(scope="session")
def clusters():
    cs = _Clusters()
    yield cs
    cs.close()


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda p: f"P{p}")
def world_size(request):
    # Session-scoped so that pytest groups the tests by world size: each cluster is started once (unless
    # a failure breaks it) instead of once per test function.
    return request.param


@pytest.fixture
def cluster(world_size, clusters):
    """A live gloo group of ``world_size`` spawned ranks (see cluster.py); shared between tests."""
    return clusters.get(world_size)
