"""YAML configuration: which algorithm, with which options, and the bucket size.

    algorithm:
      name: gtopk
      density: 0.001
    bucket_size_mb: 25

``load_config(path)`` reads a file, ``parse_config(text)`` a YAML string; both validate everything
(unknown keys get the nearest valid name suggested) before any process-group traffic.
"""
import difflib
import math
import os
import re
from dataclasses import dataclass, field

import yaml

from .algorithm import Algorithm, build

TOP_LEVEL_KEYS = ("algorithm", "bucket_size_mb")
MAX_BUCKET_MB = 1 << 20  # 1 TiB: anything larger is a typo


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``; users write both) and
    refuses a key given twice in one mapping (plain YAML lets the last one silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"config: key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                 "each key may appear once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


@dataclass
class Config:
    algorithm: Algorithm
    bucket_size_mb: float = 25.0
    raw: dict = field(default_factory=dict)


def _unknown(kind, key, allowed):
    near = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"config: unknown {kind} {key!r}{hint} (allowed: {', '.join(allowed)})")


def config_from_dict(data, source="<dict>") -> Config:
    from . import algorithms  # noqa: F401  (registers the built-ins)

    if not isinstance(data, dict):
        raise ValueError(f"config {source}: expected a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise _unknown("key", key, TOP_LEVEL_KEYS)
    if "algorithm" not in data:
        raise ValueError(f"config {source}: missing required key 'algorithm'")
    alg = data["algorithm"]
    if isinstance(alg, str):
        alg = {"name": alg}
    if not isinstance(alg, dict) or "name" not in alg:
        raise ValueError(f"config {source}: 'algorithm' must be a name or a mapping with a 'name' key, got {alg!r}")
    options = {k: v for k, v in alg.items() if k != "name"}
    bucket = data.get("bucket_size_mb", 25.0)
    if not isinstance(bucket, (int, float)) or isinstance(bucket, bool):
        raise TypeError(f"config {source}: bucket_size_mb must be a number, got {type(bucket).__name__} {bucket!r}")
    if not math.isfinite(bucket) or not 0 < bucket <= MAX_BUCKET_MB:
        raise ValueError(f"config {source}: bucket_size_mb must be > 0 and <= {MAX_BUCKET_MB} (finite), got {bucket}")
    return Config(algorithm=build(alg["name"], **options), bucket_size_mb=float(bucket), raw=data)


def parse_config(text: str) -> Config:
    """Parse and validate a YAML string."""
    return config_from_dict(yaml.load(text, Loader=_Loader), "<string>")


def load_config(path) -> Config:
    """Read and validate a YAML file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"config: no such file {path!r}")
    with open(path) as f:
        return config_from_dict(yaml.load(f, Loader=_Loader), path)
